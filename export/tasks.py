"""Built-in training tasks: generated, deterministic text classification over the byte tokenizer (no downloads).

Torch-free: a task is a name, label names, a max_len and a seeded generator of (text, label) examples.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

KV_KEYS = "abcdef"  # keys of the kv-compare task, always in this order; values are distinct digits 0-9
KV_PAIRS = (4, 6)  # min and max key-value pairs per sequence
KV_SEPARATOR = ":"
POSITIVE_WORDS = ("good", "great", "fine", "nice", "happy", "love")
NEGATIVE_WORDS = ("bad", "awful", "poor", "sad", "hate", "ugly")
NEUTRAL_WORDS = ("the", "a", "movie", "food", "was", "and", "it", "very", "day", "room")
SENTIMENT_WORDS = (4, 9)  # min and max words per sentence


class UnknownTaskError(ValueError):
    """A task name that is not one of the built-in tasks."""


@dataclass(frozen=True)
class Example:
    text: str
    label: int


@dataclass(frozen=True)
class Task:
    """A built-in task. `make(rng, label)` writes one text whose true label is `label`."""

    name: str
    labels: tuple[str, ...]
    max_len: int  # tokens, BOS included: every generated text fits
    description: str
    make: Callable[[random.Random, int], str]
    solve: Callable[[str], int]  # the reference rule: text -> label (tests check make and solve agree)

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def generate(self, n: int, seed: int) -> list[Example]:
        """n examples, the same for the same (n, seed); labels exactly balanced (up to n % num_classes)."""
        if n < 1:
            raise ValueError(f"number of examples must be >= 1, got n={n}")
        rng = random.Random(f"{self.name}:{seed}")
        labels = [i % self.num_classes for i in range(n)]
        rng.shuffle(labels)
        return [Example(self.make(rng, label), label) for label in labels]


# kv-compare: "a7b2c9d4:c" -> is the value of the queried key (c: 9) larger than the value of key a (7)?
# The query position needs two values from two other positions at once; either one alone leaves the label open.
def _kv_make(rng: random.Random, label: int) -> str:
    n_pairs = rng.randint(*KV_PAIRS)
    keys = KV_KEYS[:n_pairs]
    values = rng.sample(range(10), n_pairs)  # distinct: never a tie
    query = rng.randrange(1, n_pairs)
    if (values[query] > values[0]) != bool(label):
        values[query], values[0] = values[0], values[query]
    pairs = "".join(f"{k}{v}" for k, v in zip(keys, values, strict=True))
    return f"{pairs}{KV_SEPARATOR}{keys[query]}"


def kv_parse(text: str) -> tuple[dict[str, int], str]:
    """The key -> value table and the queried key of a kv-compare text."""
    pairs, query = text.split(KV_SEPARATOR)
    table = {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
    return table, query


def _kv_solve(text: str) -> int:
    table, query = kv_parse(text)
    return int(table[query] > table[KV_KEYS[0]])


# sentiment: a bag of words; positive when positive words outnumber negative ones (order never matters).
def _sentiment_make(rng: random.Random, label: int) -> str:
    n_words = rng.randint(*SENTIMENT_WORDS)
    n_polar = rng.randrange(1, n_words + 1, 2)  # odd: never a tie
    majority = rng.randint(n_polar // 2 + 1, n_polar)
    pos, neg = (majority, n_polar - majority) if label else (n_polar - majority, majority)
    words = [rng.choice(POSITIVE_WORDS) for _ in range(pos)] + [rng.choice(NEGATIVE_WORDS) for _ in range(neg)]
    words += [rng.choice(NEUTRAL_WORDS) for _ in range(n_words - n_polar)]
    rng.shuffle(words)
    return " ".join(words)


def _sentiment_solve(text: str) -> int:
    words = text.split()
    pos = sum(w in POSITIVE_WORDS for w in words)
    neg = sum(w in NEGATIVE_WORDS for w in words)
    return int(pos > neg)


TASKS: dict[str, Task] = {
    "kv-compare": Task(
        name="kv-compare",
        labels=("first-smaller", "first-larger"),
        max_len=16,  # BOS + 6 pairs + separator + query key = 15
        description="key-value pairs, then a key: is its value larger than key a's? (two lookups at once)",
        make=_kv_make,
        solve=_kv_solve,
    ),
    "sentiment": Task(
        name="sentiment",
        labels=("negative", "positive"),
        max_len=64,  # BOS + 9 words of <= 5 letters and a space = 55
        description="a bag of words: do positive words outnumber negative ones? (order-free, for contrast)",
        make=_sentiment_make,
        solve=_sentiment_solve,
    ),
}
DEFAULT_TASK = "kv-compare"


def get_task(name: str) -> Task:
    """The built-in task called `name`; UnknownTaskError lists the choices."""
    try:
        return TASKS[name]
    except KeyError:
        raise UnknownTaskError(f"unknown task {name!r}; choose from {', '.join(TASKS)}") from None
