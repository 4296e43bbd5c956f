"""The `docs-lm` corpus: the Python documentation text that every Python ships (`pydoc_data.topics`, 79 topics,
~465k characters of English), one document per topic encoded as BOS + byte-v1 ids + EOS, split into training and
held-out validation documents, deterministically. Torch-free; nothing is downloaded."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from contract.tokenizer import BOS_ID, EOS_ID, NUM_SPECIAL

CORPUS = "docs-lm"
DESCRIPTION = "the Python documentation shipped with Python (pydoc_data.topics): next-byte prediction"
DEFAULT_VAL_FRACTION = 0.1


class CorpusTooSmallError(ValueError):
    """A split holds too few tokens for the context length (or none at all)."""


@dataclass(frozen=True)
class Split:
    topics: tuple[str, ...]  # the documents, in order
    ids: tuple[int, ...]  # their tokens, concatenated: BOS + bytes + EOS per document


@dataclass(frozen=True)
class Corpus:
    train: Split
    val: Split

    def check(self, context: int) -> None:
        """CorpusTooSmallError unless each split holds at least one window of context + 1 tokens."""
        for name, split in (("training", self.train), ("validation", self.val)):
            if len(split.ids) < context + 1:
                raise CorpusTooSmallError(
                    f"the {name} split of {CORPUS} holds {len(split.ids)} tokens ({len(split.topics)} documents), "
                    f"fewer than one window of context + 1 = {context + 1}; change --val-fraction or --max-len"
                )


def documents() -> dict[str, str]:
    """Topic name -> text, sorted by name."""
    from pydoc_data.topics import topics

    return dict(sorted(topics.items()))


def encode_document(text: str) -> list[int]:
    """BOS, the UTF-8 bytes as byte-v1 ids, EOS."""
    return [BOS_ID, *(b + NUM_SPECIAL for b in text.encode("utf-8")), EOS_ID]


def _order_key(topic: str) -> str:
    return hashlib.sha256(f"{CORPUS}:{topic}".encode()).hexdigest()  # a fixed shuffle, the same on every Python


def load_corpus(val_fraction: float = DEFAULT_VAL_FRACTION) -> Corpus:
    """Whole documents in a fixed shuffled order go to validation until it holds val_fraction of the tokens; the
    rest, in name order, are the training split. The same split on every run; no document in both."""
    if not 0.0 < val_fraction < 1.0:
        raise CorpusTooSmallError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    encoded = {topic: encode_document(text) for topic, text in documents().items()}
    total = sum(len(ids) for ids in encoded.values())
    val_topics: list[str] = []
    held = 0
    for topic in sorted(encoded, key=_order_key):
        if held >= val_fraction * total:
            break
        val_topics.append(topic)
        held += len(encoded[topic])
    train_topics = [topic for topic in encoded if topic not in set(val_topics)]
    if not train_topics:
        raise CorpusTooSmallError(f"--val-fraction {val_fraction} leaves no training documents in {CORPUS}")
    return Corpus(_split(encoded, train_topics), _split(encoded, sorted(val_topics)))


def _split(encoded: dict[str, list[int]], topics: list[str]) -> Split:
    return Split(tuple(topics), tuple(i for topic in topics for i in encoded[topic]))
