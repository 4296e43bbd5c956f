"""The metadata contract: names, props round trip, and errors that name the key at fault."""

from __future__ import annotations

import dataclasses
import re

import pytest

from contract.metadata import MetadataError, ModelMetadata, config_name

REQUIRED = ["name", "heads", "head_dim", "d_model", "layers", "vocab_size", "max_len", "num_classes", "labels"]


def _meta(**overrides) -> ModelMetadata:
    values = dict(
        name="mha-h4-d64",
        heads=4,
        head_dim=16,
        d_model=64,
        layers=2,
        vocab_size=260,
        max_len=32,
        num_classes=3,
        labels=("a", "b", "c"),
        ff_dim=256,
        task="demo",
        exporter={"torch": "2.13.0", "opset": "20"},
    )
    return ModelMetadata(**{**values, **overrides})


def test_props_round_trip_to_an_equal_metadata():
    meta = _meta()
    props = meta.to_props()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in props.items())
    assert ModelMetadata.from_props(props) == meta
    assert ModelMetadata.from_props(_meta(labels=("x, y", "z"), num_classes=2).to_props()).labels == ("x, y", "z")


@pytest.mark.parametrize("key", REQUIRED)
def test_a_missing_required_key_is_named(key):
    props = _meta().to_props()
    del props[key]
    with pytest.raises(MetadataError, match=f"'{key}' is missing"):
        ModelMetadata.from_props(props)


@pytest.mark.parametrize(
    ("key", "raw"),
    [("heads", "eight"), ("max_len", "1.5"), ("labels", "not json"), ("labels", '["a", 2, "c"]'), ("exporter", "[1]")],
)
def test_a_malformed_value_is_named_with_its_key(key, raw):
    props = _meta().to_props()
    props[key] = raw
    with pytest.raises(MetadataError) as err:
        ModelMetadata.from_props(props)
    assert f"'{key}'" in str(err.value)
    assert raw in str(err.value)


@pytest.mark.parametrize("schema", [None, "0", "2"])
def test_a_missing_or_foreign_schema_is_named(schema):
    props = _meta().to_props()
    if schema is None:
        del props["mha_serving.schema"]
    else:
        props["mha_serving.schema"] = schema
    with pytest.raises(MetadataError, match=r"mha_serving\.schema"):
        ModelMetadata.from_props(props)


@pytest.mark.parametrize(
    ("key", "raw", "words"),
    [
        ("heads", "0", "heads=0"),
        ("num_classes", "2", "3 labels for num_classes=2"),
        ("tokenizer", "bpe", "tokenizer='bpe'"),
        ("name", "../etc", "name='../etc'"),
    ],
)
def test_inconsistent_values_are_a_metadata_error_naming_them(key, raw, words):
    props = _meta().to_props()
    props[key] = raw
    with pytest.raises(MetadataError, match=re.escape(words)):
        ModelMetadata.from_props(props)


def test_optional_keys_fall_back_to_their_defaults():
    props = _meta().to_props()
    for key in ("tokenizer", "ff_dim", "task", "exporter"):
        del props[key]
    meta = ModelMetadata.from_props(props)
    assert (meta.tokenizer, meta.ff_dim, meta.task, meta.exporter) == ("byte-v1", 0, "", {})


@pytest.mark.parametrize(
    ("heads", "d_model", "head_dim", "want"),
    [(8, 512, None, "mha-h8-d512"), (8, 512, 64, "mha-h8-d512"), (3, 512, 128, "mha-h3-d512-hd128")],
)
def test_config_name_is_the_one_spelling(heads, d_model, head_dim, want):
    assert config_name(heads, d_model, head_dim) == want
    assert config_name(heads, d_model, head_dim, prefix="mine").startswith("mine-")


def test_json_form_holds_every_field_and_attention_dim_is_h_times_head_dim():
    meta = _meta(head_dim=8)
    data = meta.to_json()
    assert set(data) == {f.name for f in dataclasses.fields(ModelMetadata)}
    assert data["labels"] == ["a", "b", "c"]
    assert meta.attention_dim == 32


def test_a_pruned_models_heads_per_layer_and_removed_heads_round_trip_through_props_and_json():
    meta = _meta(layer_heads=(4, 2), removed_heads=((), (0, 3)), pruned_from="mha-h4-d64")
    assert ModelMetadata.from_props(meta.to_props()) == meta
    assert meta.to_json()["layer_heads"] == [4, 2] and meta.to_json()["removed_heads"] == [[], [0, 3]]
    assert meta.heads_per_layer == (4, 2) and _meta().heads_per_layer == (4, 4)


@pytest.mark.parametrize(("layer_heads", "label"), [((), "4"), ((3, 3), "3"), ((4, 2), "4,2"), ((1, 4), "1,4")])
def test_heads_label_is_the_count_or_the_per_layer_counts_when_layers_differ(layer_heads, label):
    heads = max(layer_heads) if layer_heads else 4
    assert _meta(heads=heads, layer_heads=layer_heads).heads_label == label


@pytest.mark.parametrize(
    ("key", "raw", "words"),
    [
        ("layer_heads", "[4]", "layer_heads=[4]"),  # one count for two layers
        ("layer_heads", "[2, 3]", "layer_heads=[2, 3]"),  # the widest layer is not `heads`
        ("layer_heads", "[4, 0]", "layer_heads=[4, 0]"),
        ("layer_heads", '["4", 2]', "'layer_heads'"),
        ("removed_heads", "[[1]]", "removed_heads has 1 entries"),
    ],
)
def test_inconsistent_per_layer_heads_are_a_metadata_error_naming_them(key, raw, words):
    props = _meta().to_props()
    props[key] = raw
    with pytest.raises(MetadataError, match=re.escape(words)):
        ModelMetadata.from_props(props)
