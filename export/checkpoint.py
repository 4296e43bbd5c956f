"""The torch checkpoint kept beside a trained model's export (checkpoint.pt): its configuration, its weights and the
training settings that made it, so its heads can be scored and pruned later; and the one-line errors of loading it.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from contract.metadata import CONFIG_FILE
from export.model import EncoderClassifier, EncoderConfig

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A model folder that cannot be scored or pruned: no such folder, no checkpoint, an untrained model."""


@dataclass(frozen=True)
class Checkpoint:
    model: EncoderClassifier  # in eval mode
    training: dict[str, object]  # the TrainConfig it was trained with (export/train.py), as a dict
    folder: Path


def checkpoint_bytes(model: EncoderClassifier, training: dict[str, object]) -> bytes:
    """What checkpoint.pt holds: the EncoderConfig and training settings as plain values, and the state dict."""
    buffer = io.BytesIO()
    record = {
        "version": CHECKPOINT_VERSION,
        "config": asdict(model.config),
        "training": dict(training),
        "state_dict": model.state_dict(),
    }
    torch.save(record, buffer)
    return buffer.getvalue()


def _config(values: dict[str, object]) -> EncoderConfig:
    known = {f.name for f in fields(EncoderConfig)}
    values = {k: v for k, v in values.items() if k in known}
    values["labels"] = tuple(values["labels"])  # type: ignore[arg-type]
    if values.get("layer_heads") is not None:
        values["layer_heads"] = tuple(values["layer_heads"])  # type: ignore[arg-type]
    values["removed_heads"] = tuple(tuple(layer) for layer in values.get("removed_heads", ()))  # type: ignore[union-attr]
    return EncoderConfig(**values)  # type: ignore[arg-type]


def load_checkpoint(folder: Path) -> Checkpoint:
    """The trained model of a model folder; CheckpointError (one line, naming the fix) when there is none."""
    folder = Path(folder)
    config_path, path = folder / CONFIG_FILE, folder / CHECKPOINT_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{folder} is not a model folder (no {CONFIG_FILE}); pass a folder under models/")
    try:
        record = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {config_path}: {exc}") from exc
    if record.get("arch") == "decoder":
        raise CheckpointError(
            f"{folder.name} is a decoder (language model): pruning applies to classifiers only for now (a decoder's "
            f"query heads share key/value heads in groups); `mha-serving heads --model {folder}` scores its heads"
        )
    task = record.get("task", "")
    if not task:
        raise CheckpointError(
            f"{folder.name} is untrained (exported by `mha-serving export`, no task); train one with "
            f"`mha-serving train --heads N --out models/` and pass its folder"
        )
    if not path.is_file():
        raise CheckpointError(
            f"{folder.name} has no {CHECKPOINT_FILE} (exported before checkpoints were kept); train it again with "
            f"`mha-serving train` (or the sweep), which keeps one beside the export"
        )
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
        model = EncoderClassifier(_config(record["config"]))
        model.load_state_dict(record["state_dict"])
    except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} cannot be loaded ({detail}); train the model again") from exc
    return Checkpoint(model.eval(), dict(record["training"]), folder)
