"""The docs-lm corpus and its training: a deterministic, disjoint split by document, BOS + bytes + EOS per document,
errors for a split too small, and a few dozen steps that bring the validation loss below uniform."""

from __future__ import annotations

import math

import pytest
import torch

from contract.tokenizer import BOS_ID, EOS_ID, ByteTokenizer
from export.docs_corpus import CorpusTooSmallError, documents, encode_document, load_corpus
from export.lm_train import LMTrainConfig, evaluate, train_lm


def test_the_split_is_deterministic_disjoint_and_covers_every_document():
    first, second = load_corpus(), load_corpus()
    assert first == second
    train, val = set(first.train.topics), set(first.val.topics)
    assert not train & val
    assert train | val == set(documents())
    total = len(first.train.ids) + len(first.val.ids)
    assert 0.1 <= len(first.val.ids) / total < 0.3  # whole documents until a tenth of the tokens is held out
    assert len(documents()) > 50 and total > 400_000  # the Python documentation shipped with Python


def test_each_document_is_bos_its_bytes_and_eos():
    text = "The ``for`` statement\n"
    ids = encode_document(text)
    assert ids[0] == BOS_ID and ids[-1] == EOS_ID
    assert ids[:-1] == ByteTokenizer(len(ids)).encode(text)
    corpus = load_corpus()
    assert corpus.val.ids.count(BOS_ID) == corpus.val.ids.count(EOS_ID) == len(corpus.val.topics)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5, 2.0])
def test_a_val_fraction_outside_zero_and_one_is_refused(fraction):
    with pytest.raises(CorpusTooSmallError, match="--val-fraction"):
        load_corpus(fraction)


def test_a_split_shorter_than_one_window_is_refused_naming_the_numbers():
    corpus = load_corpus()
    with pytest.raises(CorpusTooSmallError, match=r"validation split of docs-lm holds \d+ tokens"):
        corpus.check(len(corpus.val.ids))
    with pytest.raises(CorpusTooSmallError, match=r"training split of docs-lm holds \d+ tokens"):
        load_corpus(0.99).check(1024)  # one short document left to train on
    with pytest.raises(CorpusTooSmallError, match="leaves no training documents"):
        load_corpus(0.999)


def test_a_few_dozen_steps_bring_the_validation_loss_below_uniform():
    config = LMTrainConfig(heads=4, kv_heads=1, d_model=32, layers=1, max_len=48, steps=40, batch_size=16, lr=1e-2)
    corpus = load_corpus()
    result = train_lm(config, log=None, corpus=corpus)
    assert result.uniform_loss == pytest.approx(math.log(260))
    assert result.val_loss < result.uniform_loss - 1.5  # well below knowing nothing (5.56 nats)
    assert result.val_perplexity == pytest.approx(math.exp(result.val_loss))
    assert result.val_tokens > 40_000
    again, _ = evaluate(result.model, torch.tensor(corpus.val.ids), config.max_len)
    assert again == pytest.approx(result.val_loss)
