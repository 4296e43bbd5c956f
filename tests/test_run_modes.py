"""`python -m benchmarks.run_modes` (its main, in this process): each way of calling ORT gives the plain run's logits
and is timed per batch size; a mode that cannot run here says why; a bad batch list or a backend this ORT lacks is
one line and exit status 2."""

from __future__ import annotations

import json
from types import SimpleNamespace

import onnxruntime as ort
import pytest

from benchmarks.run_modes import main


def _run(capsys, *args: str) -> SimpleNamespace:
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's error: one line on stderr, exit status 2
        code = exc.code
    out = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def test_every_mode_that_runs_here_is_timed_and_cuda_graphs_off_the_gpu_say_why(tiny_models_dir, tmp_path, capsys):
    out = tmp_path / "modes.json"
    args = ["--models", str(tiny_models_dir), "--model", "mha-h2-d32", "--backend", "cpu", "--batches", "1,4"]
    got = _run(capsys, *args, "--seconds", "0.2", "--rounds", "2", "--json", str(out))
    assert got.returncode == 0, got.stdout + got.stderr
    figures = json.loads(out.read_text())["figures"]["mha-h2-d32"]
    for batch in ("1", "4"):
        for mode in ("plain", "iobinding"):
            row = figures[batch][mode]
            assert row["runs"] >= 40 and row["p50_ms"] > 0
            assert row["seq_s"] == pytest.approx(int(batch) / row["p50_ms"] * 1e3)
        assert "CUDA graphs need the GPU" in figures[batch]["cudagraph"]["why_not"]
    assert "mha-h2-d32 B=4: plain" in got.stdout


def test_a_bad_batch_list_is_one_line_and_exit_status_2(tiny_models_dir, capsys):
    args = ["--models", str(tiny_models_dir), "--model", "mha-h2-d32", "--backend", "cpu", "--batches", "1,zero"]
    got = _run(capsys, *args)
    assert got.returncode == 2 and "--batches: '1,zero' is not a list of positive batch sizes" in got.stderr
    assert "Traceback" not in got.stderr


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this ORT has CUDA")
def test_the_gpu_backend_on_a_cpu_only_ort_is_one_line_and_exit_status_2(tiny_models_dir, capsys):
    got = _run(capsys, "--models", str(tiny_models_dir), "--model", "mha-h2-d32", "--backend", "gpu")
    assert got.returncode == 2 and "CPU-only package" in got.stderr and "Traceback" not in got.stderr
