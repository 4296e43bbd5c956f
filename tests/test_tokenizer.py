"""The byte tokenizer: round trip, special ids, too-long texts, padding to the longest text of a batch."""

from __future__ import annotations

import pytest

from contract.tokenizer import BOS_ID, NUM_SPECIAL, PAD_ID, VOCAB_SIZE, ByteTokenizer, SequenceTooLongError

TEXTS = ["", "hello", "héllo wörld ✓", "tabs\tand\nnewlines", "日本語のテキスト", "emoji 🙂 too"]


@pytest.mark.parametrize("text", TEXTS)
def test_decode_of_encode_returns_the_text(text):
    tok = ByteTokenizer(max_len=128)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) == 1 + len(text.encode("utf-8"))


@pytest.mark.parametrize("text", TEXTS)
def test_bos_comes_first_and_bytes_sit_past_the_special_ids(text):
    ids = ByteTokenizer(max_len=128).encode(text)
    assert ids[0] == BOS_ID
    assert all(NUM_SPECIAL <= i < VOCAB_SIZE for i in ids[1:])
    assert VOCAB_SIZE == NUM_SPECIAL + 256


def test_decode_skips_special_ids():
    tok = ByteTokenizer(max_len=16)
    assert tok.decode([BOS_ID, *tok.encode("ab")[1:], PAD_ID, PAD_ID]) == "ab"


@pytest.mark.parametrize("max_len", [1, 5, 32])
def test_text_longer_than_max_len_is_an_error_with_the_counts(max_len):
    tok = ByteTokenizer(max_len=max_len)
    fits = "x" * (max_len - 1)
    assert len(tok.encode(fits)) == max_len
    with pytest.raises(SequenceTooLongError) as err:
        tok.encode(fits + "é")  # 2 UTF-8 bytes
    assert f"{max_len + 2} tokens" in str(err.value)
    assert f"max_len={max_len}" in str(err.value)
    with pytest.raises(SequenceTooLongError):
        tok.encode_batch(["ok"[: max_len - 1], fits + "y"])


def test_batch_is_padded_to_its_longest_text_not_to_max_len():
    tok = ByteTokenizer(max_len=64)
    texts = ["a", "abcd", "ab"]
    ids, mask = tok.encode_batch(texts)
    assert [len(row) for row in ids] == [5, 5, 5]
    assert mask == [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    for row, m, text in zip(ids, mask, texts, strict=True):
        assert row[: sum(m)] == tok.encode(text)
        assert all(i == PAD_ID for i in row[sum(m) :])
    assert tok.encode_batch([]) == ([], [])


def test_tokens_label_each_position_printably():
    tok = ByteTokenizer(max_len=8)
    assert tok.tokens("a\tb") == ["<bos>", "a", "\\x09", "b"]
    assert len(tok.tokens("é")) == len(tok.encode("é"))
    with pytest.raises(SequenceTooLongError):
        tok.tokens("x" * 8)
