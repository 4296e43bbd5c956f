"""The benchmarks' models: the small and the default size, exported on demand by `mha-serving export` and their int8
variants by `mha-serving quantize`, each in a subprocess (torch stays out of the benchmark's process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from contract.metadata import MODEL_FILE, config_name

MODELS = {"small": (128, 4, 2), "default": (512, 8, 4)}  # d_model, heads, layers


def ensure_model(
    models_dir: Path, heads: int, d_model: int, layers: int, max_len: int = 128, prefix: str = "mha"
) -> str:
    """The model of these sizes in `models_dir`, exported if missing; its name."""
    name = config_name(heads, d_model, prefix=prefix)
    if not (models_dir / name / MODEL_FILE).is_file():
        cmd = [sys.executable, "-m", "service.cli", "export", "--heads", str(heads), "--d-model", str(d_model)]
        cmd += ["--layers", str(layers), "--max-len", str(max_len), "--name-prefix", prefix, "--out", str(models_dir)]
        print(f"exporting {name}: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True)
    return name


def ensure_variant(models_dir: Path, name: str, precision: str = "int8") -> str:
    """The `precision` variant of model `name`, made by `mha-serving quantize` (its gate included) if missing."""
    variant = f"{name}-{precision}"
    if not (models_dir / variant / MODEL_FILE).is_file():
        cmd = [sys.executable, "-m", "service.cli", "quantize", "--model", str(models_dir / name)]
        print(f"making {variant}: {' '.join(cmd[2:])} --precision {precision}", flush=True)
        subprocess.run([*cmd, "--precision", precision], check=True)
    return variant
