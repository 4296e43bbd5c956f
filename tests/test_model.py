"""The encoder classifier: padding invariance, attention outputs, and its configuration's validation."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from export.model import EncoderClassifier, EncoderConfig

HEADS = [1, 2, 4, 8]
TINY = {"d_model": 32, "layers": 2, "ff_dim": 64, "max_len": 24}


def _model(h: int, **overrides) -> EncoderClassifier:
    torch.manual_seed(h)
    return EncoderClassifier(EncoderConfig(heads=h, **{**TINY, **overrides})).eval()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(4, 260, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("h", HEADS)
def test_logits_do_not_change_when_padding_is_appended(h):
    model = _model(h)
    seq = _ids(9, seed=1)
    with torch.no_grad():
        alone = model(seq[None], torch.ones(1, 9, dtype=torch.int64))
        for pad, pad_id in [(1, 0), (6, 0), (15, 0), (6, 77)]:  # pad ids are ignored whatever their value
            ids = torch.cat([seq, torch.full((pad,), pad_id)])[None]  # (1, 9 + pad)
            mask = torch.cat([torch.ones(9), torch.zeros(pad)]).to(torch.int64)[None]  # (1, 9 + pad)
            torch.testing.assert_close(model(ids, mask), alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h", HEADS)
def test_logits_of_a_row_do_not_depend_on_the_other_rows_of_the_batch(h):
    model = _model(h)
    seq = _ids(7, seed=2)
    with torch.no_grad():
        alone = model(seq[None], torch.ones(1, 7, dtype=torch.int64))
        for seed, other_len, width in [(3, 3, 7), (4, 12, 12), (5, 20, 20)]:
            ids = torch.zeros(3, width, dtype=torch.int64)  # (3, width)
            mask = torch.zeros(3, width, dtype=torch.int64)  # (3, width)
            ids[1, :7], mask[1, :7] = seq, 1
            for row in (0, 2):
                ids[row, :other_len], mask[row, :other_len] = _ids(other_len, seed + 10 * row), 1
            torch.testing.assert_close(model(ids, mask)[1:2], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h", HEADS)
def test_forward_with_attention_gives_the_same_logits_and_per_layer_weights(h):
    model = _model(h)
    ids = torch.stack([_ids(10, 5), _ids(10, 6)])  # (2, 10)
    mask = torch.ones(2, 10, dtype=torch.int64)
    mask[1, 6:] = 0
    with torch.no_grad():
        logits, weights = model.forward_with_attention(ids, mask)
        torch.testing.assert_close(logits, model(ids, mask), atol=1e-5, rtol=1e-5)
    assert logits.shape == (2, 2) and logits.dtype == torch.float32
    assert weights.shape == (2, TINY["layers"], h, 10, 10)
    assert torch.all(weights[1, :, :, :, 6:] == 0)


def test_explicit_head_dim_is_in_the_name_only_when_it_differs_from_the_default():
    assert EncoderConfig(heads=8, d_model=512).name == "mha-h8-d512"
    assert EncoderConfig(heads=8, d_model=512, head_dim=64).name == "mha-h8-d512"
    assert EncoderConfig(heads=3, d_model=512, head_dim=128).name == "mha-h3-d512-hd128"
    model = _model(3, head_dim=16)
    ids = _ids(5, 0)[None]
    assert model(ids, torch.ones_like(ids)).shape == (1, 2)


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"d_model": 30, "heads": 4}, ["d_model=30", "h=4", "head_dim"]),
        ({"heads": 0}, ["h=0"]),
        ({"layers": 0}, ["layers=0"]),
        ({"max_len": -5}, ["max_len=-5"]),
        ({"vocab_size": 0}, ["vocab_size=0"]),
        ({"ff_dim": 0}, ["ff_dim=0"]),
        ({"dropout": 1.5}, ["dropout=1.5"]),
        ({"num_classes": 3}, ["2 labels", "num_classes=3"]),
        ({"num_classes": 2, "labels": ("a", "b", "c")}, ["3 labels", "num_classes=2"]),
    ],
)
def test_invalid_configuration_is_a_value_error_naming_the_value(overrides, words):
    with pytest.raises(ValueError) as err:
        EncoderConfig(**overrides)
    for word in words:
        assert word in str(err.value)


def test_configuration_is_frozen_and_metadata_follows_it():
    config = EncoderConfig(heads=4, d_model=64, num_classes=3, labels=("a", "b", "c"), task="demo")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.heads = 8  # type: ignore[misc]
    meta = config.metadata({"torch": torch.__version__})
    assert (meta.name, meta.heads, meta.head_dim, meta.d_model) == ("mha-h4-d64", 4, 16, 64)
    assert (meta.ff_dim, meta.labels, meta.task, meta.tokenizer) == (256, ("a", "b", "c"), "demo", "byte-v1")
    assert EncoderConfig(vocab_size=1000).metadata().tokenizer == "ids"


@pytest.mark.parametrize("layer_heads", [(3, 1), (1, 3), (2, 2)])
def test_layers_may_have_different_head_counts_of_one_head_dim(layer_heads):
    config = EncoderConfig(heads=max(layer_heads), head_dim=8, layer_heads=layer_heads, **TINY)
    model = EncoderClassifier(config).eval()
    assert [block.attn.h for block in model.blocks] == list(layer_heads)
    assert {block.attn.head_dim for block in model.blocks} == {8}
    assert [block.attn.qkv.weight.shape[0] for block in model.blocks] == [3 * h * 8 for h in layer_heads]
    ids = _ids(7, 1)[None]
    assert model(ids, torch.ones_like(ids)).shape == (1, 2)
    meta = config.metadata()
    assert meta.heads_per_layer == layer_heads and meta.heads == max(layer_heads)


def test_a_pruned_configuration_is_named_after_its_source_and_the_heads_each_layer_kept():
    config = EncoderConfig(heads=3, head_dim=8, layer_heads=(3, 1), pruned_from="mha-h4-d32", **TINY)
    assert config.name == "mha-h4-d32-keep3-1" == config.metadata().name
    assert config.metadata().pruned_from == "mha-h4-d32"


@pytest.mark.parametrize(("layer_heads", "heads"), [((3,), 3), ((3, 0), 3), ((2, 1), 3), ((3, 1, 1), 3)])
def test_per_layer_heads_that_do_not_fit_the_layers_or_the_widest_layer_are_refused(layer_heads, heads):
    with pytest.raises(ValueError, match=re.escape(f"layer_heads={layer_heads!r}")):
        EncoderConfig(heads=heads, head_dim=8, layer_heads=layer_heads, **TINY)


def test_attention_weights_of_layers_with_different_head_counts_are_refused_by_name():
    config = EncoderConfig(heads=3, head_dim=8, layer_heads=(3, 1), **TINY)
    ids = _ids(5, 2)[None]
    with pytest.raises(ValueError, match="different head counts"):
        EncoderClassifier(config).forward_with_attention(ids, torch.ones_like(ids))
