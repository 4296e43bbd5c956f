"""The built-in byte-level tokenizer ("byte-v1"): UTF-8 bytes shifted past a few special ids.

Standard library only, so the service (which must not import torch) tokenizes text the same way training did.
"""

from __future__ import annotations

from dataclasses import dataclass

PAD_ID = 0  # padding; attention_mask is 0 there
BOS_ID = 1  # prepended to every text
EOS_ID = 2  # reserved
UNK_ID = 3  # reserved
NUM_SPECIAL = 4
SPECIAL_NAMES = ("<pad>", "<bos>", "<eos>", "<unk>")  # by id, as tokenizer.json names them
VOCAB_SIZE = NUM_SPECIAL + 256  # 260: every byte value has an id


class SequenceTooLongError(ValueError):
    """A text encodes to more tokens than the model's max_len."""


@dataclass(frozen=True)
class ByteTokenizer:
    """Text to ids and back; one id per UTF-8 byte plus a leading BOS."""

    max_len: int

    def encode(self, text: str) -> list[int]:
        ids = [BOS_ID] + [b + NUM_SPECIAL for b in text.encode("utf-8")]
        if len(ids) > self.max_len:
            raise SequenceTooLongError(
                f"text encodes to {len(ids)} tokens (1 BOS + {len(ids) - 1} UTF-8 bytes), "
                f"over the model's max_len={self.max_len}"
            )
        return ids

    def encode_batch(self, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
        """Ids and attention mask, padded with PAD_ID to the longest text of the batch (not to max_len)."""
        rows = [self.encode(t) for t in texts]
        width = max((len(r) for r in rows), default=0)
        ids = [r + [PAD_ID] * (width - len(r)) for r in rows]
        mask = [[1] * len(r) + [0] * (width - len(r)) for r in rows]
        return ids, mask

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - NUM_SPECIAL for i in ids if i >= NUM_SPECIAL)
        return data.decode("utf-8", errors="replace")

    @staticmethod
    def token_text(token: int) -> str:
        """One id as a string, distinct for every id (for logprobs): a special token's name, a byte below 128 as its
        character, any other byte as `bytes:\\xNN` (what OpenAI writes for part of a character)."""
        if token < NUM_SPECIAL:
            return SPECIAL_NAMES[token]
        byte = token - NUM_SPECIAL
        return chr(byte) if byte < 128 else f"bytes:\\x{byte:02x}"

    def tokens(self, text: str) -> list[str]:
        """A printable label per token (for attention maps): '<bos>' then one entry per byte."""
        out = ["<bos>"]
        for b in text.encode("utf-8"):
            ch = chr(b)
            out.append(ch if 32 <= b < 127 else f"\\x{b:02x}")
        if len(out) > self.max_len:
            raise SequenceTooLongError(f"text has {len(out)} tokens, over max_len={self.max_len}")
        return out
