"""lm-eval tasks on the `docs-lm` corpus's held-out split (export/docs_corpus.py): the documents for perplexity
(`loglikelihood_rolling`), and from them a line to choose among four (`multiple_choice`) and a line to write
(`generate_until`), as local JSONL beside the tasks' YAML in evaluation/lm_eval/. `python -m evaluation.docs_tasks`
writes them; they are committed, so `lm_eval --include_path evaluation/lm_eval` needs nothing else. Torch-free."""

from __future__ import annotations

import hashlib
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

from export.docs_corpus import CORPUS, DEFAULT_VAL_FRACTION, documents, load_corpus

TASKS_DIR = Path(__file__).resolve().parent / "lm_eval"
DOCUMENTS = "docs_lm_val.jsonl"
CHOICES = "docs_lm_choice.jsonl"
CONTINUATIONS = "docs_lm_continue.jsonl"
MANIFEST = "manifest.json"
# Sized for the smallest context served (`make run`'s decoder: 128 tokens, a token per byte): the lines before a line
# (whole lines, at most CONTEXT_CHARS) and the line itself (docs_lm_continue.yaml's max_gen_toks) fit in it.
LINE_CHARS = (20, 60)  # a line to choose or to write: long enough to say something, short enough to generate
CONTEXT_CHARS = 64
PER_DOCUMENT = 12  # items of each kind per document, spread over it
DISTRACTORS = 3


@dataclass(frozen=True)
class Item:
    topic: str
    context: str  # whole lines, each ending in a newline
    line: str  # the next line, without its newline


def _digest(*parts: str) -> int:
    return int(hashlib.sha256(":".join((CORPUS, *parts)).encode()).hexdigest()[:16], 16)


def _items(topic: str, text: str) -> list[Item]:
    """Every line of the right length with at least one line before it, its context the whole lines before it that
    fit in CONTEXT_CHARS."""
    lines = text.split("\n")
    items = []
    for at in range(1, len(lines)):
        if not LINE_CHARS[0] <= len(lines[at].strip()) <= LINE_CHARS[1] or len(lines[at]) > LINE_CHARS[1]:
            continue
        context: list[str] = []
        for before in reversed(lines[:at]):
            if sum(len(c) + 1 for c in context) + len(before) + 1 > CONTEXT_CHARS:
                break
            context.insert(0, before)
        if any(c.strip() for c in context):
            items.append(Item(topic, "".join(c + "\n" for c in context), lines[at]))
    return items


def _spread(items: list[Item], count: int, offset: int) -> list[Item]:
    """`count` items evenly spaced over `items`; `offset` 1 starts half a step in (the two tasks take different lines),
    and where there are too few, each takes every other item from its own first."""
    if len(items) <= count:
        return items[offset::2]
    step = len(items) / count
    return [items[int(step * (k + offset / 2))] for k in range(count)]


def task_rows(val_fraction: float = DEFAULT_VAL_FRACTION) -> dict[str, list[dict[str, object]]]:
    """Each file's rows: the held-out documents, the multiple-choice items, the continuation items."""
    texts = documents()
    topics = load_corpus(val_fraction).val.topics
    by_topic = {topic: _items(topic, texts[topic]) for topic in topics}
    pool = [item for topic in topics for item in by_topic[topic]]
    choices, continuations = [], []
    for topic in topics:
        for item in _spread(by_topic[topic], PER_DOCUMENT, 0):
            others = sorted((i for i in pool if i.topic != topic), key=lambda i: _digest(item.line, i.line))
            options = [item.line, *(i.line for i in others[:DISTRACTORS])]
            options.sort(key=lambda line: _digest(item.context, line))  # the answer's place, fixed and spread
            choices.append(
                {"topic": topic, "context": item.context, "choices": options, "label": options.index(item.line)}
            )
        for item in _spread(by_topic[topic], PER_DOCUMENT, 1):
            continuations.append({"topic": topic, "context": item.context, "target": item.line})
    return {
        DOCUMENTS: [{"topic": topic, "text": texts[topic]} for topic in topics],
        CHOICES: choices,
        CONTINUATIONS: continuations,
    }


def manifest(rows: dict[str, list[dict[str, object]]]) -> dict[str, object]:
    """What the files were made from: the Python whose documentation it is (its pydoc topics change between
    releases), and each file's rows and SHA-256."""
    return {
        "corpus": CORPUS,
        "python": platform.python_version(),
        "val_fraction": DEFAULT_VAL_FRACTION,
        "files": {name: {"rows": len(r), "sha256": hashlib.sha256(_jsonl(r)).hexdigest()} for name, r in rows.items()},
    }


def _jsonl(rows: list[dict[str, object]]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()


def write(out: Path = TASKS_DIR) -> dict[str, object]:
    rows = task_rows()
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, file_rows in rows.items():
        (out / "data" / name).write_bytes(_jsonl(file_rows))
    record = manifest(rows)
    (out / "data" / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    return record


if __name__ == "__main__":
    written = write()
    counts = ", ".join(f"{name} {f['rows']} rows" for name, f in written["files"].items())
    print(f"evaluation/lm_eval/data: {counts} (Python {written['python']})", file=sys.stderr)
