"""Head importance (Michel et al.) and masked accuracy on a tiny trained model with one dead head, and the `heads`
command's report and its one-line errors."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from pruning import DEAD_HEAD, train_tiny

from export.checkpoint import CHECKPOINT_FILE, load_checkpoint
from export.heads_cli import main as heads_main
from export.importance import gated, gradient_importance, masked_evaluate, run_splits, score_heads

HEADS = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 1-layer, 2-head model trained briefly on kv-compare, head DEAD_HEAD then made dead, so the other head
    carries every lookup (without attention, mean-pooled tokens cannot compare two values); its exported folder."""
    _, exported = train_tiny(tmp_path_factory.mktemp("trained"), heads=HEADS, layers=1)
    return exported.folder


@pytest.fixture(scope="module")
def report(trained):
    checkpoint = load_checkpoint(trained)
    return score_heads(checkpoint.model, trained.name, run_splits(checkpoint)[1])


def test_importance_is_finite_normalised_per_layer_and_zero_for_a_dead_head(report):
    assert [(s.layer, s.head) for s in report.scores] == [(0, h) for h in range(HEADS)]
    assert all(math.isfinite(s.importance) and s.importance >= 0 for s in report.scores)
    assert sum(s.importance**2 for s in report.scores) == pytest.approx(1.0, rel=1e-5)
    dead = report.scores[DEAD_HEAD]
    assert dead.raw_importance == 0.0 and dead.importance == 0.0
    assert all(s.raw_importance > 0 for s in report.scores if s.head != DEAD_HEAD)


def test_masking_the_most_important_head_hurts_more_than_masking_the_least_important(report):
    ranked = sorted(report.scores, key=lambda s: s.importance)
    least, most = ranked[0], ranked[-1]
    assert least.head == DEAD_HEAD and least.masked_loss == pytest.approx(report.base_loss, abs=1e-6)
    assert most.masked_loss > least.masked_loss and most.masked_acc < least.masked_acc


def test_importance_is_the_mean_absolute_gate_gradient_over_examples_not_of_the_mean(trained):
    """Per-example gradients, then |.|, then the mean: at least what |gradient of the mean loss| gives."""
    checkpoint = load_checkpoint(trained)
    val = run_splits(checkpoint)[1]
    (per_example,) = gradient_importance(checkpoint.model, val)
    (one_batch,) = gradient_importance(checkpoint.model, val, batch_size=len(val.labels))
    torch.testing.assert_close(per_example, one_batch, rtol=1e-4, atol=1e-7)  # independent of the batching
    gate = torch.ones(HEADS, requires_grad=True)
    with gated(checkpoint.model, [gate]):
        loss = torch.nn.functional.cross_entropy(checkpoint.model(val.ids, val.mask), val.labels)
    (of_mean,) = torch.autograd.grad(loss, gate)
    assert torch.all(per_example >= of_mean.abs() - 1e-6)


def test_masked_evaluation_leaves_the_model_unmasked_afterwards(trained):
    checkpoint = load_checkpoint(trained)
    val = run_splits(checkpoint)[1]
    masked_evaluate(checkpoint.model, val, 0, 0)
    assert all(block.attn.head_gate is None for block in checkpoint.model.blocks)


def test_heads_command_writes_the_table_csv_json_and_heatmap_all_at_once(trained, tmp_path, capsys):
    out = tmp_path / "report"
    assert heads_main(["--model", str(trained), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["heads.csv", "heads.json", "heads.md", "heads.png"]
    assert [p.name for p in tmp_path.iterdir()] == ["report"]  # no staging folder left behind
    record = json.loads((out / "heads.json").read_text())
    assert record["model"] == trained.name and len(record["scores"]) == HEADS
    assert len((out / "heads.csv").read_text().splitlines()) == 1 + HEADS
    assert (out / "heads.png").read_bytes()[:4] == b"\x89PNG"
    assert "| 0 | 1 | 0.000 |" in capsys.readouterr().out  # the dead head's row


def _no_checkpoint(trained, tmp_path):
    folder = tmp_path / trained.name
    shutil.copytree(trained, folder)
    (folder / CHECKPOINT_FILE).unlink()
    return folder


@pytest.mark.parametrize(
    ("make_folder", "words"),
    [
        (_no_checkpoint, "has no checkpoint.pt"),
        (lambda trained, tmp_path: tmp_path / "nowhere", "is not a model folder"),
    ],
)
def test_heads_command_on_a_folder_it_cannot_score_is_one_line_naming_the_fix(
    trained, tmp_path, capsys, make_folder, words
):
    out = tmp_path / "report"
    assert heads_main(["--model", str(make_folder(trained, tmp_path)), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "mha-serving" in err and "Traceback" not in err
    assert not out.exists()


def test_heads_command_on_an_untrained_model_says_to_train_one(tiny_models_dir, tmp_path, capsys):
    out = tmp_path / "report"
    assert heads_main(["--model", str(tiny_models_dir / "mha-h2-d32"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "untrained" in err and "mha-serving train" in err
    assert not out.exists()
