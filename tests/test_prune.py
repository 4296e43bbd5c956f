"""Pruning heads: a pruned model's ONNX equals the masked torch model, per-layer heads in the fused graph, the order
heads go in, the `prune` and `prune-curve` commands, and their one-line errors with nothing half-written."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from pruning import DEAD_HEAD, train_tiny

from contract.metadata import ATTENTION_MASK, CONFIG_FILE, INPUT_IDS, MODEL_FILE
from export.checkpoint import CHECKPOINT_FILE, load_checkpoint
from export.convert import export_model
from export.fused_attention import FUSED_KERNEL
from export.importance import gated, run_splits
from export.model import EncoderClassifier, EncoderConfig
from export.parity import gate_inputs, gate_shapes
from export.prune import PruneError, heads_to_remove, iterative_prune, prune_model
from export.prune_cli import PRUNING_FILE
from export.prune_cli import main as prune_main
from export.prune_curve import main as curve_main
from export.prune_curve_report import CurveRow, saved_per_head, write_report
from export.tasks import get_task
from export.train import encode_examples

TINY = {"d_model": 32, "layers": 2, "ff_dim": 64, "max_len": 24, "task": "kv-compare"}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 1-layer, 4-head model trained briefly on kv-compare with head DEAD_HEAD dead; its exported folder."""
    _, exported = train_tiny(tmp_path_factory.mktemp("trained"), heads=4, layers=1)
    return exported.folder


def _random_model(heads: int = 4, seed: int = 0) -> EncoderClassifier:
    torch.manual_seed(seed)
    model = EncoderClassifier(EncoderConfig(heads=heads, **TINY)).eval()
    for block in model.blocks:  # non-zero biases, so a wrong slice of them shows
        torch.nn.init.normal_(block.attn.qkv.bias, std=0.1)
    return model


@pytest.mark.parametrize("keep", [[[0, 2, 3], [1]], [[2], [0, 3]], [[3, 1], [0, 1, 2]]])
def test_a_pruned_models_onnx_equals_its_masked_torch_model_within_the_parity_gate(keep, tmp_path):
    model = _random_model()
    pruned = prune_model(model, keep)
    meta = pruned.config.metadata()
    exported = export_model(pruned, meta, tmp_path)  # the parity gate: ORT against the pruned torch model
    session = ort.InferenceSession(str(exported.folder / MODEL_FILE), providers=["CPUExecutionProvider"])
    gates = [torch.tensor([1.0 if h in k else 0.0 for h in range(4)]) for k in keep]
    for batch, seq in gate_shapes(meta.max_len):
        ids, mask = gate_inputs(meta, batch, seq, seed=7)
        with torch.no_grad(), gated(model, gates):
            want = model(ids, mask).numpy()
        (got,) = session.run(None, {INPUT_IDS: ids.numpy(), ATTENTION_MASK: mask.numpy()})
        assert np.max(np.abs(got - want)) <= 1e-4
    assert exported.params < sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("keep", "fused_heads"), [([[0, 2, 3], [1]], [3]), ([[0, 1], [2, 3]], [2, 2])])
def test_each_multi_head_layer_is_one_fused_node_with_its_own_head_count_and_single_head_layers_stay_unfused(
    keep, fused_heads, tmp_path
):
    pruned = prune_model(_random_model(), keep)
    exported = export_model(pruned, pruned.config.metadata(), tmp_path)
    graph = onnx.load(str(exported.folder / MODEL_FILE)).graph
    nodes = [n for n in graph.node if n.op_type == "Attention" and n.domain == "com.microsoft"]
    assert [next(a.i for a in n.attribute if a.name == "num_heads") for n in nodes] == fused_heads
    assert exported.metadata.attention_kernel == FUSED_KERNEL


def test_the_metadata_and_config_json_record_heads_kept_per_layer_and_which_were_removed(tmp_path):
    first = prune_model(_random_model(), [[0, 1, 3], [0, 1, 2, 3]])
    first.config = dataclasses.replace(first.config, removed_heads=((2,), ()))
    exported = export_model(first, first.config.metadata(), tmp_path)
    config = json.loads((exported.folder / CONFIG_FILE).read_text())
    assert (config["name"], config["layer_heads"], config["removed_heads"]) == ("mha-h4-d32-keep3-4", [3, 4], [[2], []])
    assert (config["pruned_from"], config["heads"], config["head_dim"]) == ("mha-h4-d32", 4, 8)
    props = {p.key: p.value for p in onnx.load(str(exported.folder / MODEL_FILE)).metadata_props}
    assert json.loads(props["layer_heads"]) == [3, 4] and json.loads(props["removed_heads"]) == [[2], []]


def test_importance_order_removes_the_dead_head_first_and_records_original_indices(trained):
    checkpoint = load_checkpoint(trained)
    val = run_splits(checkpoint)[1]
    found = iterative_prune(checkpoint.model, val, [1, 2])
    assert found[1].order == ((0, DEAD_HEAD),)
    assert found[2].order[0] == (0, DEAD_HEAD) and len(set(found[2].order)) == 2
    assert found[2].model.config.removed_heads == (tuple(sorted(h for _, h in found[2].order)),)
    assert found[2].kept == (tuple(h for h in range(4) if (0, h) not in found[2].order),)


def test_random_order_is_repeatable_for_a_seed_and_differs_between_seeds(trained):
    checkpoint = load_checkpoint(trained)
    val = run_splits(checkpoint)[1]
    orders = [iterative_prune(checkpoint.model, val, [3], "random", seed)[3].order for seed in range(6)]
    assert iterative_prune(checkpoint.model, val, [3], "random", 0)[3].order == orders[0]
    assert len(set(orders)) > 1


@pytest.mark.parametrize("order", ["importance", "random"])
def test_a_layer_never_loses_its_last_head_while_others_have_heads_to_spare(order):
    split = encode_examples(get_task("kv-compare"), 64, seed=5)
    found = iterative_prune(_random_model(), split, [6], order, seed=3)
    assert [block.attn.h for block in found[6].model.blocks] == [1, 1]


@pytest.mark.parametrize(
    ("drop", "layer_heads", "words"),
    [
        ([0.0], [4], "outside (0, 1)"),
        ([1.0], [4], "outside (0, 1)"),
        ([-0.25], [4], "outside (0, 1)"),
        ([0.1], [4], "removes none of 4 heads"),
        ([0.9], [4], "leave a layer without heads"),
        ([0.25, 0.9], [4, 4], "use at most 0.75"),
        ([0.25, 0.3], [4, 4], "both remove 2 of 8 heads"),
    ],
)
def test_a_drop_fraction_that_cannot_work_names_the_fix(drop, layer_heads, words):
    with pytest.raises(PruneError, match=words.replace("(", r"\(").replace(")", r"\)")):
        heads_to_remove(drop, layer_heads)


@pytest.mark.slow
def test_prune_command_exports_each_fraction_with_its_checkpoint_and_record(trained, tmp_path, capsys):
    out = tmp_path / "models"
    argv = ["--model", str(trained), "--drop", "0.25,0.75", "--out", str(out), "--finetune-steps", "3"]
    assert prune_main(argv) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"{trained.name}-keep{k}" for k in (1, 3)]
    for k in (1, 3):
        folder = out / f"{trained.name}-keep{k}"
        config = json.loads((folder / CONFIG_FILE).read_text())
        record = json.loads((folder / PRUNING_FILE).read_text())
        assert config["layer_heads"] == [k] and len(config["removed_heads"][0]) == 4 - k
        assert record["removed_in_order"][0] == [0, DEAD_HEAD] and record["finetune_steps"] == 3
        assert load_checkpoint(folder).model.config.layer_heads == (k,)
    assert json.loads((out / f"{trained.name}-keep1" / CONFIG_FILE).read_text())["attention_kernel"] == "unfused"
    assert capsys.readouterr().out.count("exported ") == 2


def _without_checkpoint(trained, tmp_path):
    folder = tmp_path / "copy" / trained.name
    shutil.copytree(trained, folder)
    (folder / CHECKPOINT_FILE).unlink()
    return str(folder)


@pytest.mark.parametrize(
    ("model", "drop", "words"),
    [
        ("trained", "1.2", "--drop 1.2 is outside (0, 1)"),
        ("trained", "0.25,0.9", "leave a layer without heads"),
        ("trained", "half", "comma-separated fractions"),
        ("no-checkpoint", "0.5", "no checkpoint.pt"),
        ("untrained", "0.5", "untrained"),
    ],
)
def test_prune_bad_input_is_one_line_naming_the_fix_and_writes_nothing(
    trained, tiny_models_dir, tmp_path, capsys, model, drop, words
):
    folder = {
        "trained": str(trained),
        "no-checkpoint": _without_checkpoint(trained, tmp_path),
        "untrained": str(tiny_models_dir / "mha-h2-d32"),
    }[model]
    out = tmp_path / "models"
    assert prune_main(["--model", folder, "--drop", drop, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.slow
def test_prune_curve_writes_accuracy_and_latency_per_heads_pruned_for_both_orders_and_int8(trained, tmp_path):
    out = tmp_path / "curve"
    assert curve_main(["--model", str(trained), "--seeds", "2", "--repeats", "10", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["curve.csv", "curve.json", "curve.md", "curve.png"]
    record = json.loads((out / "curve.json").read_text())
    rows = record["rows"]
    assert [r["removed"] for r in rows] == [0, 1, 2, 3] and [r["heads_kept"] for r in rows] == [4, 3, 2, 1]
    assert rows[0]["acc_importance"] == rows[0]["acc_random_mean"] and rows[0]["acc_random_std"] == 0.0
    assert rows[1]["acc_importance"] == rows[0]["acc_importance"]  # the dead head goes first: nothing changes
    assert all(r["p50_b1_ms"] > 0 and r["p50_b32_ms"] > 0 for r in rows)
    assert rows[-1]["kernel"] == "unfused" and rows[0]["kernel"] == FUSED_KERNEL
    assert set(record["saved_per_head_ms"]) == {"batch_1", "batch_32"}
    assert [p.name for p in tmp_path.iterdir()] == ["curve"]  # its scratch exports and staging are gone
    # int8 by default: each importance-order model's twin, on the same test examples, timed in the same rounds
    assert all(0 <= r["int8_acc"] <= 1 and 0 <= r["int8_agreement"] <= 1 for r in rows)
    assert all(r["int8_p50_b1_ms"] > 0 and r["int8_p50_b32_ms"] > 0 for r in rows)
    assert all(abs(r["int8_fp32_acc"] - r["acc_importance"]) <= 0.01 for r in rows)  # ORT's fp32 = torch's (parity)
    assert record["settings"]["int8"]["mode"] == "dynamic" and "test examples" in record["settings"]["int8"]["data"]
    assert set(record["int8_saved_per_head_ms"]) == {"batch_1", "batch_32"}
    assert "acc, int8 (importance)" in (out / "curve.md").read_text()


def _curve_row(removed: int, int8: bool) -> CurveRow:
    figures = {"int8_acc": 0.9, "int8_fp32_acc": 0.91, "int8_agreement": 0.98, "int8_p50_b1_ms": 0.08} if int8 else {}
    figures |= {"int8_p50_b32_ms": 2.0} if int8 else {}
    return CurveRow(removed, removed / 4, 4 - removed, 0.91, 0.9, 0.01, 0.1, 3.0, FUSED_KERNEL, **figures)


@pytest.mark.parametrize("int8", [True, False])
def test_prune_curve_report_puts_int8_beside_fp32_only_when_the_twins_were_measured(int8, tmp_path):
    rows = [_curve_row(n, int8) for n in range(3)]
    method = {"mode": "dynamic", "weights": "s8", "reduce_range": False, "why": "vnni", "data": "test examples"}
    settings = {"model": "m", "task": "kv-compare", "int8": method if int8 else "not measured: --no-int8"}
    write_report(tmp_path, rows, settings)
    table = (tmp_path / "curve.md").read_text()
    record = json.loads((tmp_path / "curve.json").read_text())
    header = (
        "| acc, importance order | acc, int8 (importance) | acc, random order | p50 batch 1 (ms) | int8 p50 batch 1"
    )
    assert (header in table) is int8 and ("| 0.9100 | 0.9000 | 0.9000 ± 0.0100 | 0.100 | 0.080 |" in table) is int8
    assert ("int8_saved_per_head_ms" in record) is int8 and ("0.80x fp32 at batch 1" in table) is int8
    assert all((r["int8_acc"] is None) is not int8 for r in record["rows"])  # JSON null when not measured


def test_latency_saved_per_head_is_the_slope_over_the_models_that_run_the_full_models_kernel():
    def row(removed: int, b1: float, b32: float, kernel: str) -> CurveRow:
        return CurveRow(removed, removed / 8, 8 - removed, 1.0, 1.0, 0.0, b1, b32, kernel)

    per_head_b1, per_head_b32 = 0.004, 0.12
    rows = [row(k, 0.1 - per_head_b1 * k, 3.0 - per_head_b32 * k, FUSED_KERNEL) for k in range(7)]
    rows.append(row(7, 0.5, 0.1, "unfused"))  # another kernel: left out of the slope
    b1, b32 = saved_per_head(rows)
    assert b1 == pytest.approx(per_head_b1) and b32 == pytest.approx(per_head_b32)
