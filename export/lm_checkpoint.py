"""A trained decoder's torch checkpoint (checkpoint.pt beside its export, written by export/lm_train.py): telling a
decoder's folder from a classifier's, and loading one, with one-line errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from contract.metadata import CONFIG_FILE
from export.checkpoint import CHECKPOINT_FILE, CheckpointError
from export.decoder import DecoderConfig, DecoderLM
from export.lm_train import LMTrainConfig

DECODER = "decoder"


@dataclass(frozen=True)
class DecoderCheckpoint:
    model: DecoderLM  # in eval mode
    training: LMTrainConfig
    path: Path  # the checkpoint file


def checkpoint_path(path: Path) -> Path:
    """checkpoint.pt of a model folder, or the file itself."""
    path = Path(path)
    return path / CHECKPOINT_FILE if path.is_dir() else path


def is_decoder(path: Path) -> bool:
    """Whether `path` (a model folder, or a checkpoint file) holds a decoder: by config.json's arch, else by the
    checkpoint's own record."""
    path = Path(path)
    config = path / CONFIG_FILE
    if path.is_dir() and config.is_file():
        try:
            return json.loads(config.read_text()).get("arch") == DECODER
        except (OSError, ValueError):
            return False
    if path.is_file():
        try:
            return torch.load(path, map_location="cpu", weights_only=True).get("arch") == DECODER
        except Exception:  # not a checkpoint we wrote: the caller's own loader says why
            return False
    return False


def load_decoder(path: Path) -> DecoderCheckpoint:
    """The trained decoder of a model folder (or its checkpoint.pt); CheckpointError (one line) when there is none."""
    file = checkpoint_path(path)
    if not file.is_file():
        raise CheckpointError(
            f"{path} has no {CHECKPOINT_FILE}: train the decoder with `mha-serving train --task docs-lm` (or the "
            f"sweep), which keeps one beside the export; an untrained `export --decoder` folder has none"
        )
    try:
        record = torch.load(file, map_location="cpu", weights_only=True)
        if record.get("arch") != DECODER:
            raise CheckpointError(f"{file} is not a decoder's checkpoint (arch {record.get('arch')!r})")
        model = DecoderLM(DecoderConfig(**record["config"]))
        model.load_state_dict(record["state_dict"])
        known = {f.name for f in fields(LMTrainConfig)}
        training = LMTrainConfig(**{k: v for k, v in record["training"].items() if k in known})
    except CheckpointError:
        raise
    except (OSError, RuntimeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{file} cannot be loaded as a decoder ({detail})") from exc
    return DecoderCheckpoint(model.eval(), training, file)
