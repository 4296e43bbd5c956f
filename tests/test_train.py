"""Training (loss goes down, schedule, spikes, export with the task's labels) and the head-count sweep (complete
output, verdicts computed from the numbers, clear errors)."""

from __future__ import annotations

import csv
import json
import math
import shutil
from dataclasses import asdict

import onnx
import pytest

from contract.metadata import MODEL_FILE, ModelMetadata
from export import sweep, train_cli
from export.sweep_report import Row, Run, check_balance, check_diminishing_returns, check_instability
from export.tasks import get_task
from export.train import TRAINING_FILE, TrainConfig, _Tracker, export_trained, lr_at, train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = {"d_model": 32, "layers": 1, "ff_dim": 64, "batch_size": 32, "examples": 2000, "log_every": 20}


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models train faster on one thread than on two contended ones (CI has 2 cores); restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained():
    return train(TrainConfig(task="sentiment", heads=2, steps=80, seed=0, **TINY), log=None)


def test_training_loss_decreases(trained):
    first, last = trained.losses[:10], trained.losses[-10:]
    assert sum(last) / 10 < 0.8 * sum(first) / 10
    assert trained.val_loss < math.log(2)  # better than chance on held-out examples
    assert len(trained.losses) == 80 and len(trained.history) == 4  # a progress line every 20 steps


def test_training_records_gradient_norms_before_clipping(trained):
    assert trained.max_grad_norm >= trained.mean_grad_norm > 0
    assert max(line.grad_norm for line in trained.history) == pytest.approx(trained.max_grad_norm)


def test_training_is_reproducible_with_a_fixed_seed():
    config = TrainConfig(task="kv-compare", heads=4, steps=5, **TINY)
    a, b = train(config, log=None), train(config, log=None)
    assert a.losses == b.losses and a.val_loss == b.val_loss


def test_progress_lines_show_loss_accuracy_and_gradient_norm():
    lines = []
    train(TrainConfig(task="kv-compare", heads=1, steps=40, **TINY), log=lines.append)
    assert len(lines) == 3  # steps 20 and 40, then validation
    assert all(word in lines[0] for word in ("step", "loss", "acc", "grad-norm", "lr"))
    assert lines[-1].startswith("validation:")


def test_learning_rate_warms_up_linearly_then_decays_to_zero():
    config = TrainConfig(steps=100, lr=1e-3, warmup_fraction=0.1)
    warm = [lr_at(s, config) for s in range(10)]
    assert warm == sorted(warm) and warm[-1] == pytest.approx(1e-3)
    decay = [lr_at(s, config) for s in range(10, 100)]
    assert decay == sorted(decay, reverse=True) and decay[-1] < 1e-6


def test_a_jump_above_the_running_loss_is_recorded_as_a_spike():
    tracker = _Tracker(TrainConfig(steps=50, warmup_fraction=0.0, log_every=50), log=None)
    losses = [0.5] * 20 + [2.0] + [0.5] * 29
    for step, loss in enumerate(losses):
        tracker.record(step, loss, 1.0, 1.0, 1e-3)
    assert [s.step for s in tracker.spikes] == [21]


def test_exported_trained_model_carries_the_task_labels(trained, tmp_path):
    exported = export_trained(trained, tmp_path, attention=False)
    meta = ModelMetadata.from_props({p.key: p.value for p in onnx.load(exported.folder / MODEL_FILE).metadata_props})
    assert meta.labels == get_task("sentiment").labels and meta.task == "sentiment" and meta.heads == 2
    record = json.loads((exported.folder / TRAINING_FILE).read_text())
    assert record["val_acc"] == trained.val_acc and record["config"]["steps"] == 80


def test_the_torch_checkpoint_is_kept_beside_the_export_and_loads_the_trained_model(trained, tmp_path):
    import torch

    from export.checkpoint import load_checkpoint

    exported = export_trained(trained, tmp_path, attention=False)
    checkpoint = load_checkpoint(exported.folder)
    assert checkpoint.model.config == trained.model.config and checkpoint.training == asdict(trained.config)
    ids = torch.randint(4, 260, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(checkpoint.model(ids, mask), trained.model(ids, mask), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "3", "--d-model", "32"], "not divisible by h=3"),
        (["--task", "nope"], "unknown task 'nope'"),
        (["--steps", "0"], "steps must be an integer >= 1"),
    ],
)
def test_train_cli_bad_input_is_one_line_and_nonzero(argv, message, capsys, tmp_path):
    assert train_cli.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not any(tmp_path.iterdir())  # nothing trained or written


@pytest.fixture(scope="module")
def sweep_out(tmp_path_factory):
    """A tiny sweep's report folder (default settings: int8 twins on)."""
    out = tmp_path_factory.mktemp("sweep")
    argv = ["--task", "sentiment", "--heads", "1,2", "--seeds", "2", "--steps", "15", "--d-model", "16"]
    argv += ["--examples", "400", "--repeats", "5", "--log-every", "15", "--out", str(out)]
    assert sweep.main(argv) == 0
    return out


def test_sweep_output_is_complete(sweep_out, tmp_path, capsys):
    shutil.copytree(sweep_out, tmp_path, dirs_exist_ok=True)  # the retime below rewrites the report
    with (tmp_path / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["heads"]) for r in rows] == [1, 2] and all(r["seeds"] == "2" for r in rows)
    assert all(float(r["p50_b1_ms"]) > 0 and float(r["p50_b32_ms"]) > 0 for r in rows)
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert sorted((r["heads"], r["seed"]) for r in record["runs"]) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert len(record["claims"]) == 3
    table = (tmp_path / "sweep.md").read_text()
    assert "| 1 | 16 |" in table and "| 2 | 8 |" in table
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    assert (tmp_path / "models" / "mha-h2-d16" / MODEL_FILE).is_file()  # each h exported once, through export_model

    variant = tmp_path / "models" / "mha-h2-d16-int8"  # as `mha-serving quantize` writes beside its source
    variant.mkdir()
    (variant / "config.json").write_text(json.dumps({"heads": 2, "precision": "int8"}))
    capsys.readouterr()
    argv = ["--retime", "--repeats", "5", "--no-int8", "--out", str(tmp_path)]
    assert sweep.main(argv) == 0  # time again, no training, the fp32 models only
    assert "validation:" not in capsys.readouterr().out
    retimed = json.loads((tmp_path / "sweep.json").read_text())
    assert retimed["runs"] == record["runs"] and retimed["settings"]["retime"] is True
    assert all(r["int8_val_acc"] is None and r["int8_p50_b1_ms"] is None for r in retimed["rows"])
    assert retimed["settings"]["int8"] == "not measured: --no-int8"
    assert "## int8" not in (tmp_path / "sweep.md").read_text()


def test_sweep_measures_an_int8_twin_of_each_h_beside_fp32_by_default(sweep_out):
    record = json.loads((sweep_out / "sweep.json").read_text())
    for row in record["rows"]:
        assert 0 <= row["int8_val_acc"] <= 1 and 0 <= row["int8_fp32_val_acc"] <= 1 and 0 <= row["int8_agreement"] <= 1
        assert row["int8_p50_b1_ms"] > 0 and row["int8_p50_b32_ms"] > 0
    seed0 = {r["heads"]: r["val_acc"] for r in record["runs"] if r["seed"] == 0}
    # the fp32 side of the int8 table is the exported seed-0 model on the split training validated on, now in ORT
    assert all(abs(r["int8_fp32_val_acc"] - seed0[r["heads"]]) <= 0.01 for r in record["rows"])
    method = record["settings"]["int8"]
    assert method["mode"] == "dynamic" and method["data"] == "sentiment validation split"
    table = (sweep_out / "sweep.md").read_text()
    assert "## int8" in table and "| p50 batch 1 (ms), fp32 → int8 |" in table and "x) |" in table
    assert not any(p.name.endswith("-int8") for p in (sweep_out / "models").iterdir())  # the twins were temporary


def test_retime_without_an_earlier_sweep_is_a_clear_error(tmp_path, capsys):
    assert sweep.main(["--retime", "--out", str(tmp_path)]) == 2
    assert "run the sweep without --retime first" in capsys.readouterr().err


@pytest.mark.serve
def test_sweep_times_a_running_service_with_url(serve_port, tiny_models_dir, tmp_path):
    """--retime --url: a sweep's models, served, timed through /v1/models/{name}/predict at batch 1 and 32."""
    from serving import deploy

    shutil.copytree(tiny_models_dir, tmp_path / "models")
    settings = {"num_cpus": 0.1, "max_batch_size": 32}  # the sweep sends 32 texts in one request
    served = deploy(serve_port, "sweep", tmp_path / "models", deployment=settings)
    runs = [Run(h, 32 // h, 1000, 0, 0.5, 0.5, 1.0, 0, 1.0) for h in (2, 4)]
    settings = {"task": "kv-compare", "d_model": 32, "layers": 1, "steps": 1, "seeds": 1}
    (tmp_path / "sweep.json").write_text(json.dumps({"settings": settings, "runs": [asdict(r) for r in runs]}))
    assert sweep.main(["--retime", "--url", served.base_url, "--repeats", "5", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["heads"] for r in record["rows"]] == [2, 4]
    assert all(r["p50_b1_ms"] > 0 and r["p50_b32_ms"] > 0 for r in record["rows"])
    assert record["settings"]["timed_by"] == f"service at {served.base_url}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "1,3", "--d-model", "32"], "not divisible by h=3"),
        (["--heads", "1,x"], "comma-separated list of integers"),
        (["--task", "nope"], "unknown task 'nope'"),
    ],
)
def test_sweep_bad_input_is_one_line_and_nonzero_before_training(argv, message, capsys, tmp_path):
    assert sweep.main([*argv, "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "\n" not in captured.err.strip()
    assert "step" not in captured.out


def _row(h: int, acc: float, ms: float, head_dim: int = 16, spikes: float = 0.0, grad: float = 1.0, sd=0.001) -> Row:
    return Row(h, head_dim, 1000, 3, 0.1, sd, acc, sd, 1.0, ms, 10 * ms, spikes, grad)


def test_balance_verdict_follows_the_numbers():
    rows = [_row(1, 0.80, 0.10), _row(2, 0.90, 0.11), _row(4, 0.97, 0.12), _row(8, 0.97, 0.14), _row(16, 0.975, 0.2)]
    assert check_balance(rows).verdict == "supported"  # h=4 is within the tolerance of the best and fastest of those
    rows[0] = _row(1, 0.98, 0.10)
    assert check_balance(rows).verdict == "not supported"


def test_diminishing_returns_verdict_follows_the_numbers():
    flat_after = [_row(1, 0.80, 0.1), _row(8, 0.95, 0.1), _row(16, 0.955, 0.1)]
    steep_after = [_row(1, 0.80, 0.1), _row(8, 0.82, 0.1), _row(16, 0.95, 0.1)]
    assert check_diminishing_returns(flat_after).verdict == "supported"
    assert check_diminishing_returns(steep_after).verdict == "not supported"
    assert check_diminishing_returns(flat_after[:2]).verdict == "cannot check"


def test_instability_verdict_compares_small_and_large_head_dims():
    stable_small = [_row(1, 0.9, 0.1, head_dim=64, spikes=2, grad=9, sd=0.05), _row(8, 0.9, 0.1, spikes=0, grad=1)]
    unstable_small = [_row(1, 0.9, 0.1, head_dim=64, spikes=0, grad=1), _row(8, 0.9, 0.1, spikes=2, grad=9, sd=0.05)]
    assert check_instability(stable_small).verdict == "not supported"
    assert check_instability(unstable_small).verdict == "supported"
    assert check_instability(stable_small[1:]).verdict == "cannot check"
