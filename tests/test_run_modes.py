"""`python -m benchmarks.run_modes`: each way of calling ORT gives the plain run's logits and is timed per batch size;
a mode that cannot run here says why; a bad batch list or a backend this ORT lacks is one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import onnxruntime as ort
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "benchmarks.run_modes", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_every_mode_that_runs_here_is_timed_and_cuda_graphs_off_the_gpu_say_why(tiny_models_dir, tmp_path):
    out = tmp_path / "modes.json"
    got = _run("--models", str(tiny_models_dir), "--model", "mha-h2-d32", "--backend", "cpu", "--batches", "1,4",
               "--seconds", "0.2", "--rounds", "2", "--json", str(out))  # fmt: skip
    assert got.returncode == 0, got.stdout + got.stderr
    figures = json.loads(out.read_text())["figures"]["mha-h2-d32"]
    for batch in ("1", "4"):
        for mode in ("plain", "iobinding"):
            row = figures[batch][mode]
            assert row["runs"] >= 40 and row["p50_ms"] > 0
            assert row["seq_s"] == pytest.approx(int(batch) / row["p50_ms"] * 1e3)
        assert "CUDA graphs need the GPU" in figures[batch]["cudagraph"]["why_not"]
    assert "mha-h2-d32 B=4: plain" in got.stdout


def test_a_bad_batch_list_is_one_line_and_exit_status_2(tiny_models_dir):
    got = _run("--models", str(tiny_models_dir), "--model", "mha-h2-d32", "--backend", "cpu", "--batches", "1,zero")
    assert got.returncode == 2 and "--batches: '1,zero' is not a list of positive batch sizes" in got.stderr
    assert "Traceback" not in got.stderr


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this ORT has CUDA")
def test_the_gpu_backend_on_a_cpu_only_ort_is_one_line_and_exit_status_2(tiny_models_dir):
    got = _run("--models", str(tiny_models_dir), "--model", "mha-h2-d32", "--backend", "gpu")
    assert got.returncode == 2 and "CPU-only package" in got.stderr and "Traceback" not in got.stderr
