"""Load tester workload: sequence-length specs, generated texts of exact token counts, request bodies."""

from __future__ import annotations

import json

import pytest

from contract.tokenizer import ByteTokenizer
from loadtest.workload import SeqLenSpec, WorkloadError, build_bodies, endpoint, make_texts


@pytest.mark.parametrize(
    ("text", "expected"),
    [("fixed:32", SeqLenSpec("fixed", 32, 32)), ("uniform:8:64", SeqLenSpec("uniform", 8, 64))],
)
def test_seq_len_specs_parse(text, expected):
    assert SeqLenSpec.parse(text) == expected
    assert SeqLenSpec.parse(text).describe() == text


@pytest.mark.parametrize("bad", ["fixed", "fixed:x", "uniform:9:3", "fixed:1", "normal:3", "file:", "uniform:3"])
def test_bad_seq_len_specs_are_one_clear_error(bad):
    with pytest.raises(WorkloadError, match="--seq-len"):
        SeqLenSpec.parse(bad)


@pytest.mark.parametrize("max_len", [32, 128])
def test_generated_texts_have_the_asked_token_counts_under_the_byte_tokenizer(max_len):
    tokenizer = ByteTokenizer(max_len=max_len)
    texts, notes = make_texts(SeqLenSpec.parse("uniform:2:24"), max_len, 300, seed=3)
    lengths = [len(tokenizer.encode(t)) for t in texts]
    assert min(lengths) >= 2 and max(lengths) <= 24 and len(set(lengths)) > 10
    assert notes == []
    fixed, _ = make_texts(SeqLenSpec.parse("fixed:17"), max_len, 20)
    assert {len(tokenizer.encode(t)) for t in fixed} == {17}


def test_lengths_over_max_len_are_clamped_and_noted():
    texts, notes = make_texts(SeqLenSpec.parse("uniform:8:64"), 32, 200)
    assert max(len(ByteTokenizer(32).encode(t)) for t in texts) <= 32
    assert len(notes) == 1 and "clamped to 8..32" in notes[0]


def test_texts_from_a_file_are_cut_to_max_len_at_a_character_boundary(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("short one\n\n" + "é" * 40 + "\n", encoding="utf-8")
    texts, notes = make_texts(SeqLenSpec.parse(f"file:{path}"), 16, 4)
    assert texts[0] == "short one" and texts[2] == "short one"
    assert texts[1] == "é" * 7  # 14 bytes + BOS = 15 tokens <= 16; an 8th "é" would need 17
    assert "2 of 4 texts" in notes[0]


def test_an_empty_text_file_is_an_error(tmp_path):
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(WorkloadError, match="no non-empty lines"):
        make_texts(SeqLenSpec.parse(f"file:{tmp_path / 'empty.txt'}"), 32, 1)


@pytest.mark.parametrize("protocol", ["simple", "v2"])
def test_bodies_carry_batch_size_texts_in_the_protocols_json(protocol):
    bodies, _ = build_bodies(SeqLenSpec.parse("fixed:10"), 32, 3, protocol, pool=5)
    assert len(bodies) == 5
    for body in bodies:
        payload = json.loads(body.content)
        texts = payload["texts"] if protocol == "simple" else payload["inputs"][0]["data"]
        assert len(texts) == body.sequences == 3
        assert body.tokens == 30
        if protocol == "v2":
            assert payload["inputs"][0]["shape"] == [3] and payload["inputs"][0]["datatype"] == "BYTES"
    assert endpoint(protocol, "mha-h2-d32").endswith("/predict" if protocol == "simple" else "/infer")


def test_batch_size_below_one_is_an_error():
    with pytest.raises(WorkloadError, match="--batch-size"):
        build_bodies(SeqLenSpec.parse("fixed:10"), 32, 0, "simple")
