"""Head importance for a decoder (`mha-serving heads` on a trained docs-lm model): one score per query head, each
naming its key/value head, against the validation loss; a dead head scores 0; the report; and pruning a decoder is
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from export.heads_cli import main as heads_main
from export.lm_checkpoint import DecoderCheckpoint, load_decoder
from export.lm_importance import evaluate, gradient_importance, score_decoder_heads, val_windows
from export.lm_train import LMTrainConfig, export_trained_lm, train_lm
from export.prune_cli import main as prune_main

WINDOWS = 24  # held-out windows scored: enough for nonzero gradients, quick on 2 cores
DEAD = (1, 2)  # (layer, query head) whose output projection is zeroed


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-layer decoder with 4 query heads and 2 key/value heads, trained a few steps and exported."""
    torch.set_num_threads(1)
    config = LMTrainConfig(heads=4, kv_heads=2, d_model=32, layers=2, max_len=40, steps=5, batch_size=4, log_every=5)
    return export_trained_lm(train_lm(config, log=None), tmp_path_factory.mktemp("lm")).folder


@pytest.fixture(scope="module")
def with_dead_head(trained) -> DecoderCheckpoint:
    checkpoint = load_decoder(trained)
    layer, head = DEAD
    attn = checkpoint.model.blocks[layer].attn
    with torch.no_grad():
        attn.out.weight[:, head * attn.head_dim : (head + 1) * attn.head_dim] = 0.0  # its output reaches nothing
    return checkpoint


def test_one_score_per_query_head_normalised_per_layer_each_naming_its_kv_head(trained):
    report = score_decoder_heads(load_decoder(trained), trained.name, WINDOWS)
    assert report.arch == "decoder" and report.examples == WINDOWS and report.unit == "windows of 40 tokens"
    assert [(s.layer, s.head) for s in report.scores] == [(layer, head) for layer in range(2) for head in range(4)]
    assert [s.kv_head for s in report.scores[:4]] == [0, 0, 1, 1]  # 2 query heads per key/value head
    for layer in range(2):
        mine = [s for s in report.scores if s.layer == layer]
        assert sum(s.importance**2 for s in mine) == pytest.approx(1.0, rel=1e-5)
        assert all(s.raw_importance > 0 for s in mine)


def test_a_dead_query_head_scores_zero_and_masking_it_changes_nothing(with_dead_head):
    report = score_decoder_heads(with_dead_head, "dead", WINDOWS)
    dead = next(s for s in report.scores if (s.layer, s.head) == DEAD)
    assert dead.raw_importance == 0.0
    assert dead.masked_loss == pytest.approx(report.base_loss, abs=1e-6)
    assert dead.masked_acc == pytest.approx(report.base_acc)
    others = [s for s in report.scores if (s.layer, s.head) != DEAD]
    assert max(abs(s.masked_loss - report.base_loss) for s in others) > 0


def test_importance_does_not_depend_on_the_batching_and_the_gates_at_one_change_nothing(with_dead_head, monkeypatch):
    from export import lm_importance

    model = with_dead_head.model
    x, y = val_windows(with_dead_head, WINDOWS)
    assert x.shape == y.shape == (WINDOWS, 40)
    in_batches = gradient_importance(model, x, y)
    monkeypatch.setattr(lm_importance, "SCORE_BATCH", WINDOWS)
    at_once = gradient_importance(model, x, y)
    for a, b in zip(in_batches, at_once, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-8)
    loss, _ = evaluate(model, x, y)  # every gate at 1 ...
    for block in model.blocks:
        assert block.attn.head_gate is None  # ... and removed afterwards
    with torch.no_grad():
        logits, _ = model(x, torch.ones_like(x), torch.arange(40)[None].expand_as(x))
        plain = torch.nn.functional.cross_entropy(logits.transpose(1, 2), y)
    assert loss == pytest.approx(float(plain), rel=1e-5)


def test_heads_command_writes_the_decoder_report(trained, tmp_path, capsys):
    out = tmp_path / "heads"
    assert heads_main(["--model", str(trained), "--windows", str(WINDOWS), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["heads.csv", "heads.json", "heads.md", "heads.png"]
    table = (out / "heads.md").read_text()
    assert "| layer | query head | kv head |" in table and "next-token accuracy" in table
    record = json.loads((out / "heads.json").read_text())
    assert record["arch"] == "decoder" and len(record["scores"]) == 8
    assert len((out / "heads.csv").read_text().splitlines()) == 1 + 8
    assert "4 query heads per layer" in capsys.readouterr().out


def test_heads_bad_windows_is_one_line_and_exit_2(trained, tmp_path, capsys):
    assert heads_main(["--model", str(trained), "--windows", "0", "--out", str(tmp_path / "h")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--windows must be >= 1" in err and "\n" not in err


def test_pruning_a_decoder_is_refused_in_one_line(trained, tmp_path, capsys):
    assert prune_main(["--model", str(trained), "--drop", "0.25", "--out", str(tmp_path / "pruned")]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a decoder (language model): pruning applies to classifiers only" in err and "\n" not in err
    assert not (tmp_path / "pruned").exists()
