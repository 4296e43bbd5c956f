"""A decoder's metadata contract: props round trip with arch=decoder, the dispatch by arch (classifier files without
the key read as before), and errors that name the key at fault. Torch-free."""

from __future__ import annotations

import pytest

from contract.decoder_metadata import DecoderMetadata, metadata_from_props
from contract.metadata import MetadataError, ModelMetadata, config_name


def _meta(**overrides) -> DecoderMetadata:
    values = dict(
        name="lm-h4-kv1-d64",
        heads=4,
        kv_heads=1,
        head_dim=16,
        d_model=64,
        layers=2,
        vocab_size=260,
        max_len=128,
        bos_id=1,
        eos_id=2,
        pad_id=0,
        ff_dim=256,
        task="docs-lm",
        exporter={"torch": "2.13.0", "opset": "23"},
        attention_kernel="onnx.Attention",
    )
    return DecoderMetadata(**{**values, **overrides})


def test_props_round_trip_and_say_arch_decoder():
    meta = _meta()
    props = meta.to_props()
    assert props["arch"] == "decoder"
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in props.items())
    assert DecoderMetadata.from_props(props) == meta
    assert metadata_from_props(props) == meta
    assert meta.to_json()["arch"] == "decoder"


def test_a_classifier_file_without_arch_reads_as_before():
    classifier = ModelMetadata(
        name="mha-h4-d64", heads=4, head_dim=16, d_model=64, layers=2, vocab_size=260, max_len=32, num_classes=2,
        labels=("negative", "positive"),
    )  # fmt: skip
    props = classifier.to_props()
    assert "arch" not in props
    assert metadata_from_props(props) == classifier
    assert metadata_from_props({**props, "arch": "classifier"}) == classifier


def test_a_classifier_reader_refuses_a_decoder_saying_what_it_is():
    with pytest.raises(MetadataError, match="'arch' is 'decoder': not a classifier"):
        ModelMetadata.from_props(_meta().to_props())
    with pytest.raises(MetadataError, match="'arch' is 'seq2seq'"):
        metadata_from_props({**_meta().to_props(), "arch": "seq2seq"})


@pytest.mark.parametrize("key", ["name", "heads", "kv_heads", "head_dim", "max_len", "bos_id", "eos_id", "pad_id"])
def test_a_missing_required_key_is_named(key):
    props = _meta().to_props()
    del props[key]
    with pytest.raises(MetadataError, match=f"'{key}' is missing"):
        metadata_from_props(props)


def test_inconsistent_values_are_named():
    with pytest.raises(MetadataError, match="kv_heads=3 does not divide heads=4"):
        _meta(kv_heads=3)
    with pytest.raises(MetadataError, match="eos_id=300 is not below vocab_size=260"):
        _meta(eos_id=300)
    props = {**_meta().to_props(), "kv_heads": "two"}
    with pytest.raises(MetadataError, match="'kv_heads' has a malformed value 'two'"):
        metadata_from_props(props)


def test_the_cache_layout_and_its_cost_per_token():
    meta = _meta()
    assert meta.input_names == [
        "input_ids", "attention_mask", "position_ids",
        "past_key_values.0.key", "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value",
    ]  # fmt: skip
    assert meta.output_names == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert meta.kv_bytes_per_token == 2 * 2 * 1 * 16 * 4  # key and value, 2 layers, 1 kv head of 16, float32


@pytest.mark.parametrize(
    ("args", "name"),
    [((4, 64, 16, "lm", 1), "lm-h4-kv1-d64"), ((3, 64, 32, "lm", 3), "lm-h3-kv3-d64-hd32"), ((8, 512), "mha-h8-d512")],
)
def test_config_name_with_kv_heads(args, name):
    assert config_name(*args) == name


def test_config_name_refuses_kv_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="kv_heads=3 must be >= 1 and divide heads=4"):
        config_name(4, 64, kv_heads=3)
