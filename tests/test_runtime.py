"""The ORT runtime: honest provider choice (gpu fails saying why, auto says why CPU), contract checks, model files."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest
from pydantic import ValidationError
from serving import bare_logits

from service.config import DeploymentSettings
from service.errors import BackendError, ModelFileError
from service.model_store import check_contract, find_models
from service.runtime import gpu_visible, load_runtime, plan_providers, session_options

HAS_CUDA_PROVIDER = "CUDAExecutionProvider" in ort.get_available_providers()
NAMES = ["mha-h2-d32", "mha-h4-d32"]


@pytest.mark.skipif(HAS_CUDA_PROVIDER, reason="this onnxruntime has CUDA: the CPU-only message does not apply")
def test_backend_gpu_with_a_cpu_only_onnxruntime_fails_saying_so(tiny_models_dir):
    with pytest.raises(BackendError, match=r"CPU-only package.*install onnxruntime-gpu"):
        load_runtime(tiny_models_dir, "mha-h2-d32", "gpu", threads=1)


@pytest.mark.skipif(HAS_CUDA_PROVIDER, reason="this onnxruntime has CUDA")
def test_backend_auto_picks_cpu_here_and_says_why(tiny_models_dir):
    rt = load_runtime(tiny_models_dir, "mha-h2-d32", "auto", threads=1)
    assert rt.backend == "cpu"
    assert rt.reason.startswith("auto chose CPU:") and "CUDAExecutionProvider" in rt.reason


def test_no_visible_gpu_is_explained_when_ray_hides_it(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    visible, why = gpu_visible()
    assert not visible and "CUDA_VISIBLE_DEVICES is empty" in why


def test_backend_gpu_without_a_visible_gpu_fails_saying_so(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(BackendError, match=r"backend gpu: .*(CPU-only|CUDA_VISIBLE_DEVICES is empty)"):
        plan_providers("gpu")


def test_unknown_backend_is_rejected():
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        plan_providers("tpu")


@pytest.mark.parametrize("name", NAMES)
def test_cpu_runtime_reads_metadata_from_the_file_and_matches_bare_ort(tiny_models_dir, name):
    rt = load_runtime(tiny_models_dir, name, "cpu", threads=1)
    assert rt.backend == "cpu" and rt.session.get_providers()[0] == "CPUExecutionProvider"
    assert rt.meta.name == name and rt.meta.heads == int(name.split("-h")[1].split("-")[0])
    ids = np.random.default_rng(0).integers(4, rt.meta.vocab_size, size=(3, 7))  # (B, T)
    logits = rt.run(ids, np.ones_like(ids))
    assert logits.shape == (3, rt.meta.num_classes) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, bare_logits(tiny_models_dir, name, ids), rtol=0, atol=1e-6)


def test_thread_setting_reaches_the_session(tiny_models_dir):
    rt = load_runtime(tiny_models_dir, "mha-h2-d32", "cpu", threads=2)
    assert rt.threads == 2
    assert rt.session.get_session_options().intra_op_num_threads == 2


@pytest.mark.parametrize(("spinning", "allow", "stop"), [("off", "0", None), ("run", "1", "1"), ("always", "1", None)])
def test_each_spinning_mode_reaches_the_session_and_an_unknown_one_is_refused(tiny_models_dir, spinning, allow, stop):
    rt = load_runtime(tiny_models_dir, "mha-h2-d32", "cpu", threads=2, spinning=spinning)
    opts = rt.session.get_session_options()
    assert opts.get_session_config_entry("session.intra_op.allow_spinning") == allow
    if stop is None:  # ORT's default: threads spin on after a run
        with pytest.raises(RuntimeError, match="force_spinning_stop"):
            opts.get_session_config_entry("session.force_spinning_stop")
    else:
        assert opts.get_session_config_entry("session.force_spinning_stop") == stop
    with pytest.raises(ValueError, match="spinning must be one of"):
        session_options(2, "fast")


def test_ort_spinning_takes_a_mode_or_the_old_booleans():
    assert [DeploymentSettings(ort_spinning=v).ort_spinning for v in ("run", True, False)] == ["run", "always", "off"]
    assert DeploymentSettings().ort_spinning == "run"
    with pytest.raises(ValidationError):
        DeploymentSettings(ort_spinning="fast")


def test_missing_model_file_is_reported(tmp_path):
    (tmp_path / "mha-h2-d32").mkdir()
    with pytest.raises(ModelFileError, match=r"model\.onnx is missing"):
        load_runtime(tmp_path, "mha-h2-d32", "cpu", threads=1)


def test_corrupt_model_file_is_reported(tmp_path):
    (tmp_path / "mha-h2-d32").mkdir()
    (tmp_path / "mha-h2-d32" / "model.onnx").write_bytes(b"not a protobuf")
    with pytest.raises(ModelFileError, match="ONNX Runtime cannot load"):
        load_runtime(tmp_path, "mha-h2-d32", "cpu", threads=1)


def test_folder_name_that_disagrees_with_the_metadata_is_reported(tiny_models_dir, tmp_path):
    shutil.copytree(tiny_models_dir / "mha-h2-d32", tmp_path / "mha-h8-d32")
    with pytest.raises(ModelFileError, match="folder 'mha-h8-d32' holds a model whose metadata name is 'mha-h2-d32'"):
        load_runtime(tmp_path, "mha-h8-d32", "cpu", threads=1)


def _arg(name, type_="tensor(int64)", shape=("batch", "seq")):
    return SimpleNamespace(name=name, type=type_, shape=list(shape))


def test_contract_check_names_wrong_inputs_and_outputs(tiny_models_dir):
    props = load_runtime(tiny_models_dir, "mha-h2-d32", "cpu", threads=1).meta.to_props()
    inputs = [_arg("ids"), _arg("attention_mask", "tensor(int32)")]
    outputs = [_arg("logits", "tensor(float)", ("batch", 3))]
    with pytest.raises(ModelFileError) as err:
        check_contract("mha-h2-d32", props, inputs, outputs)
    message = str(err.value)
    assert "inputs are ['ids', 'attention_mask']" in message
    assert "'attention_mask' is tensor(int32)" in message
    assert "3 classes, metadata says num_classes=2" in message


def test_contract_check_rejects_a_file_without_our_metadata():
    inputs = [_arg("input_ids"), _arg("attention_mask")]
    with pytest.raises(ModelFileError, match=r"mha_serving\.schema"):
        check_contract("x", {}, inputs, [_arg("logits", "tensor(float)", ("batch", 2))])


def test_a_decoder_opened_as_a_classifier_is_refused_saying_it_is_a_decoder():
    props = {"mha_serving.schema": "1", "arch": "decoder", "name": "lm-h4-kv1-d64"}
    inputs = [_arg("input_ids"), _arg("attention_mask"), _arg("position_ids")]
    with pytest.raises(ModelFileError, match=r"'lm-h4-kv1-d64' is a decoder \(arch=decoder\): not a classifier"):
        check_contract("lm-h4-kv1-d64", props, inputs, [_arg("logits", "tensor(float)", ("batch", "seq", 260))])


def test_find_models_lists_folders_and_names_what_is_wrong(tiny_models_dir, tmp_path):
    assert find_models(tiny_models_dir) == NAMES
    assert find_models(tiny_models_dir, ["mha-h4-d32"]) == ["mha-h4-d32"]
    with pytest.raises(ModelFileError, match=r"\['mha-h7-d32'\] not found"):
        find_models(tiny_models_dir, ["mha-h7-d32"])
    with pytest.raises(ModelFileError, match="does not exist"):
        find_models(tmp_path / "nope")
    with pytest.raises(ModelFileError, match="no model folders"):
        find_models(tmp_path)


@pytest.mark.gpu
def test_backend_gpu_runs_on_cuda_and_agrees_with_cpu(tiny_models_dir):
    gpu = load_runtime(tiny_models_dir, "mha-h4-d32", "gpu", threads=1)
    assert gpu.backend == "gpu" and gpu.session.get_providers()[0] == "CUDAExecutionProvider"
    ids = np.random.default_rng(1).integers(4, gpu.meta.vocab_size, size=(4, 9))  # (B, T)
    np.testing.assert_allclose(
        gpu.run(ids, np.ones_like(ids)), bare_logits(tiny_models_dir, "mha-h4-d32", ids), atol=1e-4
    )


@pytest.mark.gpu
def test_backend_auto_picks_gpu_when_one_is_there(tiny_models_dir):
    rt = load_runtime(tiny_models_dir, "mha-h2-d32", "auto", threads=1)
    assert rt.backend == "gpu" and rt.reason.startswith("auto chose GPU")
