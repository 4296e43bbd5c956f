"""Shared fixtures: tiny models built and exported here (no downloads), once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

TINY = {"d_model": 32, "layers": 1, "ff_dim": 64, "max_len": 32}  # exports in a few seconds


def export_tiny_model(out_dir: Path, heads: int, seed: int = 0, attention: bool = False, **overrides):
    """Build an untrained tiny EncoderClassifier with `heads` heads and export it through the normal path."""
    import torch

    from export.convert import export_model, exporter_versions
    from export.model import AttentionOutputs, EncoderClassifier, EncoderConfig

    torch.manual_seed(seed)
    config = EncoderConfig(heads=heads, **{**TINY, **overrides})
    model = EncoderClassifier(config)
    variant = AttentionOutputs(model) if attention else None
    return export_model(model, config.metadata(exporter_versions()), out_dir, attention_variant=variant)


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    """A models/ folder with two tiny head configurations, mha-h2-d32 and mha-h4-d32 (the latter with attention)."""
    out = tmp_path_factory.mktemp("models")
    export_tiny_model(out, heads=2, seed=2)
    export_tiny_model(out, heads=4, seed=4, attention=True)
    return out
