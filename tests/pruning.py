"""Test support: a tiny model trained briefly (fixed seed: deterministic) on the default task, one of whose heads is
made dead (its columns of the output projection zeroed), exported with its checkpoint like `mha-serving train`."""

from __future__ import annotations

from pathlib import Path

TINY_TRAINING = {"d_model": 32, "ff_dim": 64, "steps": 200, "examples": 2000, "log_every": 1000, "lr": 3e-3}
DEAD_HEAD = 1  # in every layer


def train_tiny(out_dir: Path, heads: int = 4, layers: int = 1, seed: int = 0):
    """(TrainResult, ExportResult) of a tiny model on kv-compare whose head DEAD_HEAD is dead in every layer."""
    import torch

    from export.train import TrainConfig, export_trained, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model on 2 shared cores: 10x faster than two threads contending
    try:
        result = train(TrainConfig(heads=heads, layers=layers, seed=seed, **TINY_TRAINING), log=None)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        for block in result.model.blocks:
            hs = block.attn.head_dim
            block.attn.out.weight[:, DEAD_HEAD * hs : (DEAD_HEAD + 1) * hs] = 0.0  # (D, hs): the head adds nothing
    return result, export_trained(result, out_dir, attention=False)
