"""Precision variants: int8 and fp16 made from exported models, written only past their quality gate, with the int8
settings chosen for the CPU, and the `mha-serving quantize` / `export --precision` command lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import export_tiny_model
from onnx import numpy_helper
from pruning import train_tiny

from contract.metadata import CONFIG_FILE, MODEL_FILE
from export import onnx_file
from export.quantize import (
    GateError,
    GateSettings,
    Int8Plan,
    QuantizeError,
    gpu_providers,
    make_variant,
    plan_int8,
)

MHA_SERVING = Path(sys.executable).parent / "mha-serving"


def _made_to_fail(model) -> None:
    """Outlier weights that change nothing in fp32 (they read a feature that is always 0) but set int8's scale of
    their whole matrix, so every other weight of it rounds to zero: attention and MLP both lost in int8."""
    import torch

    with torch.no_grad():
        for block in model.blocks:
            block.ln_1.weight[0], block.ln_1.bias[0] = 0.0, 0.0  # feature 0 of the attention's input is 0...
            block.attn.qkv.weight[:, 0] = 1e4  # (3 * A,): ...so its column of q, k and v weights adds nothing
            block.mlp.fc.bias[0] = -100.0  # GELU(-100 + x) = 0 for any x the model sees: hidden unit 0 never fires
            block.mlp.proj.weight[:, 0] = 1e4  # (D,): the column of that unit


@pytest.fixture(scope="module")
def untrained(tmp_path_factory) -> Path:
    return export_tiny_model(tmp_path_factory.mktemp("untrained"), heads=2, seed=3).folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(TrainResult, folder) of a tiny model trained on kv-compare, exported with its training record."""
    result, exported = train_tiny(tmp_path_factory.mktemp("trained"), heads=4)
    return result, exported.folder


def _int8_weights(path: Path) -> list[np.ndarray]:
    model = onnx.load(str(path))
    return [numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8]


def test_int8_settings_follow_the_cpus_int8_dot_product_unit():
    vnni = plan_int8(frozenset({"avx2", "avx512_vnni"}))
    assert (vnni.weights, vnni.reduce_range) == ("s8", False) and "avx512_vnni" in vnni.reason
    assert plan_int8(frozenset({"avx2", "avx_vnni"})).reduce_range is False
    no_vnni = plan_int8(frozenset({"avx2", "fma"}))
    assert (no_vnni.weights, no_vnni.reduce_range) == ("s8", True) and "no VNNI" in no_vnni.reason
    assert plan_int8(frozenset(), weights="u8").reduce_range is False  # u8 x u8 cannot saturate
    assert plan_int8(frozenset({"avx512_vnni"}), reduce_range="on").reduce_range is True
    assert plan_int8(frozenset(), reduce_range="off").reduce_range is False
    with pytest.raises(ValueError, match="reduce_range"):
        plan_int8(frozenset(), reduce_range="maybe")


@pytest.mark.parametrize("reduce_range", [False, True], ids=["full-range", "reduce-range"])
def test_a_trained_model_passes_the_gate_with_either_int8_choice_and_records_it(trained, tmp_path, reduce_range):
    from export.tasks import get_task
    from export.train import encode_examples, evaluate, split_data

    result, folder = trained
    plan = Int8Plan("s8", reduce_range, "chosen by the test")
    # 7-bit weights on this 32-wide model flip a few more argmaxes, how many depends on the CPU's int8 kernels (3 of
    # 200, 98.5 %, on an AVX512-VNNI Xeon, where `auto` would not choose them); the gate's own threshold is tested
    # below, here the choice reaching the quantizer and its record.
    settings = GateSettings(min_agreement=0.97 if reduce_range else 0.99)
    variant = make_variant(folder, "int8", tmp_path, plan=plan, gate=settings)
    gate = variant.gate
    assert variant.name == f"{folder.name}-int8" and variant.folder == tmp_path / variant.name
    assert gate.data == "kv-compare validation split" and gate.examples == int(result.config.examples * 0.1)
    _, val = split_data(encode_examples(get_task("kv-compare"), result.config.examples, result.config.seed), 0.1)
    assert abs(gate.fp32_accuracy - evaluate(result.model, val)[1] * 100) < 1e-6  # the split train() validates on
    assert gate.fp32_accuracy - gate.accuracy <= 0.5 and gate.agreement >= settings.min_agreement
    weights = np.concatenate([w.ravel() for w in _int8_weights(variant.folder / MODEL_FILE)])
    # 7-bit weights when reduce_range is on: the choice really reached the quantizer
    assert (np.abs(weights.astype(int)).max() <= 64) == reduce_range
    meta = onnx_file.read_metadata(variant.folder / MODEL_FILE)
    assert (meta.precision, meta.quantized_from, meta.task) == ("int8", folder.name, "kv-compare")
    assert meta.quantization["reduce_range"] is reduce_range and meta.quantization["mode"] == "dynamic"
    assert meta.quantization["gate"]["accuracy"] == gate.accuracy
    config = json.loads((variant.folder / CONFIG_FILE).read_text())
    assert config["precision"] == "int8" and config["quantization"]["gate"]["agreement"] == gate.agreement
    assert variant.file_bytes < 0.5 * variant.source_bytes


def test_static_int8_is_calibrated_on_other_inputs_than_the_gate(untrained, tmp_path):
    variant = make_variant(untrained, "int8", tmp_path, mode="static")
    method = variant.meta.quantization
    assert method["mode"] == "static" and "seed 11" in method["calibration"] and "seed 7" in variant.gate.data
    ops = {node.op_type for node in onnx.load(str(variant.folder / MODEL_FILE)).graph.node}
    assert "QLinearMatMul" in ops  # activations quantized ahead of time, not per run (MatMulInteger)


def test_the_gate_refuses_an_untrained_model_made_to_fail_and_writes_nothing(tmp_path):
    import torch

    from export.convert import export_model
    from export.model import EncoderClassifier, EncoderConfig

    torch.manual_seed(0)
    config = EncoderConfig(heads=2, d_model=32, layers=1, ff_dim=64, max_len=32)
    model = EncoderClassifier(config).eval()
    _made_to_fail(model)
    folder = export_model(model, config.metadata(), tmp_path).folder
    with pytest.raises(GateError, match="of the fp32 logits' spread") as failed:
        make_variant(folder, "int8")
    assert "not written" in str(failed.value) and "\n" not in str(failed.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # no variant, no staging folder left
    run = subprocess.run([MHA_SERVING, "quantize", "--model", folder], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "failed the quality gate" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]


def test_the_gate_refuses_a_trained_model_made_to_fail_on_its_validation_accuracy(trained, tmp_path):
    import copy
    from dataclasses import replace

    from export.train import export_trained

    result, _ = trained
    broken = copy.deepcopy(result.model)
    _made_to_fail(broken)
    folder = export_trained(replace(result, model=broken), tmp_path, attention=False).folder
    with pytest.raises(
        GateError, match=r"failed the quality gate: argmax agreement .*; accuracy .* \(drop > 0\.5 points\)"
    ):
        make_variant(folder, "int8")
    assert not (tmp_path / f"{folder.name}-int8").exists()


def test_an_fp16_variant_keeps_int64_inputs_and_float32_logits_and_says_where_its_gpu_gate_ran(untrained, tmp_path):
    variant = make_variant(untrained, "fp16", tmp_path)
    model = onnx.load(str(variant.folder / MODEL_FILE))
    types = {t.data_type for t in model.graph.initializer}
    assert onnx.TensorProto.FLOAT16 in types
    assert [i.type.tensor_type.elem_type for i in model.graph.input] == [onnx.TensorProto.INT64] * 2
    assert [o.type.tensor_type.elem_type for o in model.graph.output] == [onnx.TensorProto.FLOAT]
    assert variant.meta.precision == "fp16" and variant.gate.max_logit_diff < 0.01
    providers, why_not = gpu_providers()
    if providers is None:
        assert variant.gate.gpu_gate == f"not run: {why_not}" and variant.gate.device == "cpu"
        assert variant.meta.quantization["gate"]["gpu_gate"].startswith("not run")


@pytest.mark.gpu
def test_an_fp16_variant_passes_its_gate_on_the_gpu(untrained, tmp_path):
    variant = make_variant(untrained, "fp16", tmp_path)
    assert (variant.gate.gpu_gate, variant.gate.device) == ("passed", "gpu")


def test_a_variant_is_never_made_from_a_variant_or_a_folder_without_a_model(untrained, tmp_path):
    variant = make_variant(untrained, "int8", tmp_path)
    with pytest.raises(QuantizeError, match="already int8: make variants from its fp32 source"):
        make_variant(variant.folder, "int8")
    for argv, message in (
        (["--model", str(variant.folder)], "already int8"),
        (["--model", str(tmp_path / "nothing")], "no model.onnx"),
        (["--model", str(untrained), "--precision", "int4"], "invalid choice: 'int4'"),
        (["--model", str(untrained), "--min-agreement", "2"], "min_agreement must be in [0, 1]"),
        ([], "--model"),
    ):
        run = subprocess.run([MHA_SERVING, "quantize", *argv], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and message in run.stderr and len(run.stderr.strip().splitlines()) == 1, argv


def test_quantize_skips_a_variant_that_exists_unless_forced(untrained, tmp_path):
    command = [MHA_SERVING, "quantize", "--model", untrained, "--out", tmp_path]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "passed the gate" in first.stdout, first.stderr
    written = (tmp_path / f"{untrained.name}-int8" / MODEL_FILE).stat().st_mtime_ns
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "exists, skipped" in again.stdout
    assert (tmp_path / f"{untrained.name}-int8" / MODEL_FILE).stat().st_mtime_ns == written
    forced = subprocess.run([*command, "--force"], capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0 and "passed the gate" in forced.stdout
    assert (tmp_path / f"{untrained.name}-int8" / MODEL_FILE).stat().st_mtime_ns != written


@pytest.mark.slow  # a CLI export with every precision: 7-9 s on 2 cores
def test_export_with_precision_writes_each_fp32_model_and_its_variants(tmp_path):
    command = [MHA_SERVING, "export", "--out", tmp_path, "--heads", "2", "--d-model", "16", "--layers", "1"]
    command += ["--ff-dim", "32", "--max-len", "12", "--precision", "int8,fp16"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mha-h2-d16", "mha-h2-d16-fp16", "mha-h2-d16-int8"]
    for name, precision in (("mha-h2-d16", "fp32"), ("mha-h2-d16-int8", "int8"), ("mha-h2-d16-fp16", "fp16")):
        assert onnx_file.read_metadata(tmp_path / name / MODEL_FILE).precision == precision
    bad = subprocess.run([*command[:2], "--precision", "int4"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "precision must be a comma-separated list of fp32, int8, fp16" in bad.stderr


def test_a_pruned_model_quantizes_under_its_own_name(trained, tmp_path):
    import torch

    from export.convert import export_model
    from export.prune import prune_model

    result, _ = trained
    with torch.no_grad():
        pruned = prune_model(result.model, [[0, 2, 3]])
    folder = export_model(pruned, pruned.config.metadata(), tmp_path).folder
    variant = make_variant(folder, "int8")
    assert variant.name == f"{folder.name}-int8" and variant.meta.layer_heads == pruned.config.metadata().layer_heads
    assert variant.meta.pruned_from == pruned.config.metadata().pruned_from
    assert variant.gate.accuracy is not None  # a pruned model of a task is gated on the task's data


def test_gate_settings_refuse_values_outside_their_range():
    for kwargs in ({"min_agreement": -0.1}, {"max_accuracy_drop": -1}, {"max_relative_diff": 0}, {"examples": 0}):
        with pytest.raises(ValueError):
            GateSettings(**kwargs)
