"""The decoders' sweep (`mha-serving sweep --task docs-lm`): over h (MHA) and over kv_heads at the largest h, the
report's KV bytes column and the mean and spread over seeds, the exported seed-0 models, and bad input."""

from __future__ import annotations

import csv
import json
import math
import shutil
from statistics import mean, pstdev

import pytest

from export import sweep
from export.lm_sweep import configurations
from export.lm_sweep_report import LMRun, findings, summarize

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
D_MODEL, LAYERS = 32, 1
TINY = ["--task", "docs-lm", "--d-model", str(D_MODEL), "--layers", str(LAYERS), "--steps", "3", "--batch-size", "4"]
TINY += ["--max-len", "40", "--log-every", "3", "--seeds", "2"]


@pytest.fixture(scope="module")
def sweep_out(tmp_path_factory):
    """A tiny sweep over h in {1, 2} and kv_heads in {1, 2} at h = 2: three configurations, two seeds each."""
    out = tmp_path_factory.mktemp("lm-sweep")
    assert sweep.main([*TINY, "--heads", "1,2", "--kv-heads", "1,2", "--out", str(out)]) == 0
    return out


def test_configurations_are_every_h_as_mha_then_every_kv_heads_at_the_largest_h():
    assert configurations([1, 2, 4, 8], [1, 2, 4, 8]) == [(1, 1), (2, 2), (4, 4), (8, 8), (8, 1), (8, 2), (8, 4)]
    assert configurations([4], []) == [(4, 4)]


def test_the_report_has_every_configuration_and_file(sweep_out):
    assert {p.name for p in sweep_out.iterdir()} >= {"sweep.md", "sweep.csv", "sweep.json", "sweep.png", "models"}
    assert (sweep_out / "sweep.png").read_bytes().startswith(PNG_MAGIC)
    with (sweep_out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["heads"]), int(r["kv_heads"])) for r in rows] == [(1, 1), (2, 2), (2, 1)]
    table = (sweep_out / "sweep.md").read_text()
    assert "| KV bytes / token |" in table and "kv_heads=1: 0.50 x MHA's KV bytes per token" in table
    exported = sorted(p.name for p in (sweep_out / "models").iterdir())
    assert exported == ["lm-h1-kv1-d32", "lm-h2-kv1-d32", "lm-h2-kv2-d32"]  # each configuration's seed-0 model


def test_a_sweep_started_again_reuses_the_runs_it_finished_and_trains_only_the_new_ones(sweep_out, tmp_path, capsys):
    """runs.jsonl holds each run as it ends; the same sweep (its folder moved) with one more seed trains only that
    seed's runs."""
    before = json.loads((sweep_out / "sweep.json").read_text())["runs"]
    assert len((sweep_out / "runs.jsonl").read_text().splitlines()) == 6
    out = shutil.copytree(sweep_out, tmp_path / "moved")
    capsys.readouterr()
    argv = [*TINY, "--heads", "1,2", "--kv-heads", "1,2", "--out", str(out)]
    assert sweep.main([*argv[: argv.index("--seeds")], "--seeds", "3", *argv[argv.index("--seeds") + 2 :]]) == 0
    printed = capsys.readouterr().out
    assert printed.count("found in runs.jsonl") == 6 and "seed=2\n" in printed
    after = json.loads((out / "sweep.json").read_text())["runs"]
    assert [r for r in after if r["seed"] < 2] == before and sum(r["seed"] == 2 for r in after) == 3


def test_kv_bytes_per_token_is_two_x_layers_x_kv_heads_x_head_dim_x_four(sweep_out):
    with (sweep_out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        head_dim = D_MODEL // int(r["heads"])
        assert int(r["head_dim"]) == head_dim
        assert int(r["kv_bytes_per_token"]) == 2 * LAYERS * int(r["kv_heads"]) * head_dim * 4
    assert [int(r["kv_bytes_per_token"]) for r in rows] == [256, 256, 128]


def test_mean_spread_and_perplexity_come_from_the_seeds_figures(sweep_out):
    record = json.loads((sweep_out / "sweep.json").read_text())
    assert len(record["runs"]) == 6 and record["settings"]["kv_heads"] == [1, 2]
    for row in record["rows"]:
        mine = [r for r in record["runs"] if (r["heads"], r["kv_heads"]) == (row["heads"], row["kv_heads"])]
        assert sorted(r["seed"] for r in mine) == [0, 1] and row["seeds"] == 2
        losses = [r["val_loss"] for r in mine]
        assert row["val_loss_mean"] == pytest.approx(mean(losses))
        assert row["val_loss_std"] == pytest.approx(pstdev(losses))
        assert row["val_loss_std"] > 0  # two seeds, two different models
        assert row["perplexity"] == pytest.approx(math.exp(row["val_loss_mean"]))
        assert 0 < row["val_loss_mean"] < math.log(260) + 0.5  # a few steps: near the uniform baseline
    first = record["rows"][0]
    assert f"{first['val_loss_mean']:.4f} ± {first['val_loss_std']:.4f}" in (sweep_out / "sweep.md").read_text()


def _run(h: int, kv: int, seed: int, loss: float) -> LMRun:
    return LMRun(h, kv, 64 // h, 2, seed, 1000, loss, math.exp(loss), 2 * 2 * kv * (64 // h) * 4, 1.0, 1.0)


def test_summary_and_findings_follow_the_numbers():
    runs = [_run(4, 4, 0, 2.0), _run(4, 4, 1, 2.2), _run(4, 1, 0, 2.5), _run(4, 1, 1, 2.5), _run(1, 1, 0, 3.0)]
    rows = summarize(runs)
    assert [(r.heads, r.kv_heads) for r in rows] == [(4, 4), (4, 1), (1, 1)]
    assert rows[0].val_loss_mean == pytest.approx(2.1) and rows[0].val_loss_std == pytest.approx(0.1)
    lines = findings(rows)
    assert lines[0].startswith("over h (kv_heads = h): the lowest validation loss is at h=4")
    assert "h=4, kv_heads=1: 0.25 x MHA's KV bytes per token, validation loss +0.4000" in lines[1]
    assert "outside the seed spread of 0.1000" in lines[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heads", "2,4", "--kv-heads", "3"], "--kv-heads 3 does not divide h=4"),
        (["--heads", "4", "--kv-heads", "1,x"], "--kv-heads must be a comma-separated list of integers"),
        (["--heads", "4", "--retime"], "--retime does not apply to --task docs-lm"),
        (["--heads", "4", "--max-len", "20"], "--max-len 20 is below"),
        (["--heads", "4", "--max-len", "100000"], "the validation split of docs-lm holds"),
        (["--heads", "3"], "d_model=32 is not divisible by h=3"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_training(argv, message, capsys, tmp_path):
    base = [a for a in TINY if a != "40"]
    base.remove("--max-len")
    assert sweep.main([*base, *argv, "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert message in err and "\n" not in err
    assert "[1/" not in captured.out  # nothing was trained
    assert not (tmp_path / "out").exists()


def test_kv_heads_with_a_classifier_task_is_refused(capsys, tmp_path):
    assert sweep.main(["--task", "kv-compare", "--kv-heads", "1", "--out", str(tmp_path)]) == 2
    assert "--kv-heads applies to --task docs-lm only" in capsys.readouterr().err
