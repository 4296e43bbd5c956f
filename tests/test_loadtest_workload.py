"""Load tester workload: sequence-length specs, generated texts of exact token counts, request bodies."""

from __future__ import annotations

import json
import re

import pytest

from contract.rpc import inference_pb2 as pb
from contract.tokenizer import ByteTokenizer
from loadtest.binary import HEADER_NAME
from loadtest.workload import PROTOCOLS, SeqLenSpec, WorkloadError, build_bodies, endpoint, make_texts, parse_protocols
from service.protocol import binary as server_binary
from service.protocol.v2 import InferRequest


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
    bodies, _ = build_bodies(SeqLenSpec.parse("fixed:10"), 32, 3, (protocol,), pool=5)
    assert list(bodies) == [protocol] and len(bodies[protocol]) == 5
    for body in bodies[protocol]:
        payload = json.loads(body.content)
        texts = payload["texts"] if protocol == "simple" else payload["inputs"][0]["data"]
        assert len(texts) == body.sequences == 3
        assert body.tokens == 30
        if protocol == "v2":
            assert payload["inputs"][0]["shape"] == [3] and payload["inputs"][0]["datatype"] == "BYTES"
    assert endpoint(protocol, "mha-h2-d32").endswith("/predict" if protocol == "simple" else "/infer")


def test_batch_size_below_one_is_an_error():
    with pytest.raises(WorkloadError, match="--batch-size"):
        build_bodies(SeqLenSpec.parse("fixed:10"), 32, 0, ("simple",))


def texts_of(protocol: str, content: bytes, headers: tuple) -> list[str]:
    """The texts a request carries, read back the way the service reads each protocol."""
    if protocol == "simple":
        return json.loads(content)["texts"]
    if protocol == "v2":
        return json.loads(content)["inputs"][0]["data"]
    if protocol == "grpc":
        return [b.decode() for b in pb.ModelInferRequest.FromString(content).inputs[0].contents.bytes_contents]
    header, blob = server_binary.split(content, dict(headers)[HEADER_NAME])
    request = InferRequest.model_validate_json(header)
    server_binary.attach(request, blob)
    return request.inputs[0].data


def test_every_protocol_carries_the_same_texts_in_the_same_order():
    bodies, _ = build_bodies(SeqLenSpec.parse("uniform:2:30"), 32, 2, PROTOCOLS, pool=6, model="mha-h2-d32")
    assert list(bodies) == list(PROTOCOLS)
    carried = {p: [texts_of(p, b.content, b.headers) for b in bodies[p]] for p in PROTOCOLS}
    assert all(len(texts) == 2 for texts in carried["simple"]) and len({t for ts in carried["simple"] for t in ts}) > 1
    assert all(carried[p] == carried["simple"] for p in PROTOCOLS)
    assert {b.tokens for b in bodies["v2-binary"]} == {b.tokens for b in bodies["simple"]}
    assert [p for p in PROTOCOLS if any(b.headers for b in bodies[p])] == ["v2-binary"]
    assert endpoint("v2-binary", "mha-h2-d32") == endpoint("v2", "mha-h2-d32") == "/v2/models/mha-h2-d32/infer"


def test_protocols_parse_as_a_comma_separated_list_in_the_order_given():
    assert parse_protocols("grpc, v2,v2-binary") == ("grpc", "v2", "v2-binary")
    assert parse_protocols("simple") == ("simple",)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("v3", "unknown protocol(s) v3; give one or more of simple, v2, v2-binary, grpc"),
        ("v2,binary", "unknown protocol(s) binary"),
        (" , ", "no protocol"),
        ("v2,grpc,v2", "names v2 more than once"),
    ],
)
def test_a_bad_protocol_list_is_one_clear_error(text, message):
    with pytest.raises(WorkloadError, match=re.escape(message)):
        parse_protocols(text)
