"""Saving a model file: its metadata written into the ONNX file, weights past 1 GiB as external data, the checker run.

Torch-free: the export (after torch.onnx) and the precision variants (after ONNX Runtime's quantizer) both save here.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from contract.decoder_metadata import DecoderMetadata, metadata_from_props
from contract.metadata import MetadataError, ModelMetadata

EXTERNAL_DATA_THRESHOLD = 1 << 30  # 1 GiB: larger models keep weights in model.onnx.data (protobuf caps at 2 GiB)


def save(model: onnx.ModelProto, meta: ModelMetadata | DecoderMetadata, path: Path) -> None:
    """Write `model` to `path` with `meta` as its only metadata; onnx.checker.ValidationError if the file is invalid."""
    del model.metadata_props[:]
    for key, value in meta.to_props().items():
        model.metadata_props.add(key=key, value=value)
    model.producer_name = "mha-serving"
    for stale in path.parent.glob(path.name + ".*"):  # external data is appended to an existing file: start afresh
        stale.unlink()
    large = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    onnx.save_model(model, str(path), save_as_external_data=large, location=path.name + ".data" if large else None)
    onnx.checker.check_model(str(path), full_check=True)


def read_metadata(path: Path) -> ModelMetadata:
    """The metadata of an exported classifier file, without loading its weights; MetadataError says what is wrong."""
    return ModelMetadata.from_props(_props(path))


def read_any_metadata(path: Path) -> ModelMetadata | DecoderMetadata:
    """The metadata of either kind of model file (a classifier or a decoder, by its `arch`)."""
    return metadata_from_props(_props(path))


def _props(path: Path) -> dict[str, str]:
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise MetadataError(f"{path.name} is not a readable ONNX file: {exc}") from exc
    return {p.key: p.value for p in model.metadata_props}
