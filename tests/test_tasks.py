"""Built-in tasks: deterministic, balanced, within max_len, and kv-compare's label needs two positions at once."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from contract.tokenizer import ByteTokenizer
from export.tasks import KV_KEYS, TASKS, UnknownTaskError, get_task, kv_parse

N = 2000


@pytest.mark.parametrize("name", sorted(TASKS))
def test_same_seed_gives_the_same_examples_and_another_seed_others(name):
    task = get_task(name)
    assert task.generate(200, seed=3) == task.generate(200, seed=3)
    assert task.generate(200, seed=3) != task.generate(200, seed=4)


@pytest.mark.parametrize("name", sorted(TASKS))
@pytest.mark.parametrize("n", [1000, 1001])
def test_labels_are_balanced(name, n):
    task = get_task(name)
    counts = [0] * task.num_classes
    for example in task.generate(n, seed=0):
        counts[example.label] += 1
    assert max(counts) - min(counts) <= 1, counts


@pytest.mark.parametrize("name", sorted(TASKS))
def test_every_text_fits_max_len_and_its_label_follows_the_rule(name):
    task = get_task(name)
    tokenizer = ByteTokenizer(task.max_len)
    for example in task.generate(N, seed=1):
        tokenizer.encode(example.text)  # raises SequenceTooLongError past max_len
        assert task.solve(example.text) == example.label, example
    assert len(task.labels) == task.num_classes >= 2


def _value_position(text: str, key: str) -> int:
    return text.index(key) + 1  # pairs are "<key><digit>"; keys are unique before the separator


def test_kv_compare_label_depends_on_exactly_the_two_looked_up_values():
    task = get_task("kv-compare")
    rng = random.Random(0)
    for example in task.generate(500, seed=2):
        table, query = kv_parse(example.text)
        assert query != KV_KEYS[0] and query in table
        needed = {_value_position(example.text, KV_KEYS[0]), _value_position(example.text, query)}
        assert len(needed) == 2  # two different positions
        for key in table:
            pos = _value_position(example.text, key)
            changed = example.text[:pos] + str(rng.randrange(10)) + example.text[pos + 1 :]
            if pos not in needed:  # any other value can change without changing the label
                assert task.solve(changed) == example.label


@pytest.mark.parametrize("which", ["first key (a)", "queried key"])
def test_kv_compare_label_is_not_decided_by_either_value_alone(which):
    task = get_task("kv-compare")
    labels_by_digit = defaultdict(set)
    for example in task.generate(4000, seed=5):
        table, query = kv_parse(example.text)
        digit = table[KV_KEYS[0]] if which == "first key (a)" else table[query]
        labels_by_digit[digit].add(example.label)
    assert all(labels_by_digit[d] == {0, 1} for d in range(1, 9)), dict(labels_by_digit)


def test_sentiment_label_ignores_word_order():
    task = get_task("sentiment")
    rng = random.Random(1)
    for example in task.generate(300, seed=0):
        words = example.text.split()
        rng.shuffle(words)
        assert task.solve(" ".join(words)) == example.label


def test_unknown_task_is_a_clear_error_listing_the_choices():
    with pytest.raises(UnknownTaskError, match="unknown task 'nope'; choose from kv-compare, sentiment"):
        get_task("nope")


def test_generate_rejects_a_count_below_one():
    with pytest.raises(ValueError, match="n=0"):
        get_task("sentiment").generate(0, seed=0)
