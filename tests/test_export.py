"""ONNX export: parity with torch on untraced shapes, metadata round trip, dynamic axes, the attention variant, and
the gate's refusals, which leave no folder behind."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import TINY
from torch import nn

from contract.metadata import ATTENTION_MODEL_FILE, CONFIG_FILE, MODEL_FILE, ModelMetadata
from export import parity
from export.convert import ExportError, export_model, exporter_versions
from export.fused_attention import FUSED_KERNEL
from export.model import EncoderClassifier, EncoderConfig

FIXTURE_SEEDS = {2: 2, 4: 4}  # heads -> seed used by the tiny_models_dir fixture (conftest.py)
SMALL = {"d_model": 16, "layers": 1, "ff_dim": 32, "max_len": 12}  # for the tests that export their own model


def _fixture_model(h: int) -> tuple[EncoderClassifier, EncoderConfig]:
    """The same torch model the fixture exported, rebuilt from its seed."""
    torch.manual_seed(FIXTURE_SEEDS[h])
    config = EncoderConfig(heads=h, **TINY)
    return EncoderClassifier(config).eval(), config


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _padded_batch(batch: int, seq: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random ids (B, T) with row i padded after max(1, seq - 3 * i) tokens; padding ids are random too."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 260, size=(batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for row in range(batch):
        mask[row, : max(1, seq - 3 * row)] = 1
    return ids, mask


def test_gate_shapes_are_untraced_and_cover_batch_1_and_7_by_seq_1_17_and_max_len():
    assert set(parity.gate_shapes(32)) == {(b, t) for b in (1, 7) for t in (1, 17, 32)}
    assert (2, 8) not in parity.gate_shapes(32)
    ids, mask = parity.gate_inputs(EncoderConfig(**TINY).metadata(), 7, 17)
    assert ids.shape == mask.shape == (7, 17)
    assert mask.sum(dim=1).tolist() == [17, 16, 15, 14, 13, 12, 11]  # padding in every row but the first


@pytest.mark.parametrize("h", [2, 4])
def test_onnx_runtime_matches_torch_on_untraced_shapes_with_padding(tiny_models_dir, h):
    model, config = _fixture_model(h)
    path = tiny_models_dir / config.name / MODEL_FILE
    assert parity.check(model, path, config.metadata(), atol=1e-4) <= 1e-4  # the real gate
    session = _session(path)
    for batch in (1, 7):
        for seq in (1, 17, config.max_len):
            ids, mask = _padded_batch(batch, seq, seed=100 * batch + seq)
            (got,) = session.run(["logits"], {"input_ids": ids, "attention_mask": mask})
            with torch.no_grad():
                want = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
            assert got.shape == (batch, config.num_classes) and got.dtype == np.float32
            np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("h", [2, 4])
def test_metadata_round_trips_through_the_onnx_file_and_config_json(tiny_models_dir, h):
    model, config = _fixture_model(h)
    folder = tiny_models_dir / config.name
    proto = onnx.load(str(folder / MODEL_FILE), load_external_data=False)
    meta = ModelMetadata.from_props({p.key: p.value for p in proto.metadata_props})
    assert meta == replace(config.metadata(exporter_versions()), attention_kernel=FUSED_KERNEL)  # what the graph runs
    assert meta.exporter["torch"] == torch.__version__ and meta.exporter["opset"] == "20"
    saved = json.loads((folder / CONFIG_FILE).read_text())
    assert saved.pop("params") == model.num_parameters()
    assert saved == json.loads(json.dumps(meta.to_json()))
    session_meta = _session(folder / MODEL_FILE).get_modelmeta().custom_metadata_map
    assert ModelMetadata.from_props(session_meta) == meta  # what a server reading through ORT sees


@pytest.mark.parametrize("h", [2, 4])
def test_batch_and_sequence_axes_are_dynamic(tiny_models_dir, h):
    path = tiny_models_dir / f"mha-h{h}-d32" / MODEL_FILE
    graph = onnx.load(str(path), load_external_data=False).graph
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        assert value.type.tensor_type.elem_type == onnx.TensorProto.INT64
        assert [bool(d.dim_param) for d in dims] == [True, True], value.name
    (logits,) = graph.output
    assert logits.name == "logits" and logits.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert logits.type.tensor_type.shape.dim[1].dim_value == 2
    session = _session(path)
    for batch, seq in [(1, 2), (64, 32), (3, 9)]:
        ids, mask = _padded_batch(batch, seq, seed=seq)
        assert session.run(None, {"input_ids": ids, "attention_mask": mask})[0].shape == (batch, 2)


def test_attention_variant_exposes_per_head_weights_next_to_the_same_logits(tiny_models_dir):
    folder = tiny_models_dir / "mha-h4-d32"
    assert not (tiny_models_dir / "mha-h2-d32" / ATTENTION_MODEL_FILE).exists()  # only when asked for
    session = _session(folder / ATTENTION_MODEL_FILE)
    assert [o.name for o in session.get_outputs()] == ["logits", "attention_weights"]
    ids, mask = _padded_batch(3, 11, seed=7)
    logits, weights = session.run(None, {"input_ids": ids, "attention_mask": mask})
    assert weights.shape == (3, TINY["layers"], 4, 11, 11)  # (B, layers, h, T, T)
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)
    padding = np.broadcast_to((mask == 0)[:, None, None, None, :], weights.shape)  # (B, layers, h, T, T)
    assert padding.any() and np.all(weights[padding] == 0)
    (plain,) = _session(folder / MODEL_FILE).run(None, {"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(logits, plain, atol=1e-5)
    model, _ = _fixture_model(4)
    with torch.no_grad():
        _, want = model.forward_with_attention(torch.from_numpy(ids), torch.from_numpy(mask))
    np.testing.assert_allclose(weights, want.numpy(), atol=1e-5)


def test_explicit_head_dim_exports_under_its_own_name_and_passes_the_gate(tmp_path):
    torch.manual_seed(3)
    config = EncoderConfig(heads=3, head_dim=8, **SMALL)  # h * head_dim = 24, d_model = 16
    model = EncoderClassifier(config)
    result = export_model(model, config.metadata(exporter_versions()), tmp_path)
    assert result.folder == tmp_path / "mha-h3-d16-hd8"
    assert result.max_diff <= 1e-4
    proto = onnx.load(str(result.folder / MODEL_FILE), load_external_data=False)
    meta = ModelMetadata.from_props({p.key: p.value for p in proto.metadata_props})
    assert (meta.heads, meta.head_dim, meta.d_model, meta.attention_dim) == (3, 8, 16, 24)


def _small_model(h: int = 2) -> tuple[EncoderClassifier, ModelMetadata]:
    torch.manual_seed(h)
    config = EncoderConfig(heads=h, **SMALL)
    return EncoderClassifier(config), config.metadata(exporter_versions())


class _ExtraOutput(nn.Module):
    """Breaks the contract by its output names: logits plus an unnamed second output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        logits = self.model(input_ids, attention_mask)
        return logits, logits * 2


class _PerTokenLogits(nn.Module):
    """Breaks the contract by its output shape: (B, T, C) instead of (B, C)."""

    def __init__(self, model: EncoderClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        x = self.model.tok_emb(input_ids)  # (B, T, d_model)
        return self.model.head(x)  # (B, T, C)


def test_a_gate_that_cannot_pass_raises_with_the_max_diff_and_leaves_no_folder(tmp_path):
    model, meta = _small_model()
    with pytest.raises(parity.ParityError, match=r"max abs [0-9.e+-]+ > atol -1"):
        export_model(model, meta, tmp_path, atol=-1.0)  # any difference, even 0, is over a negative tolerance
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("wrap", "error", "words"),
    [(_ExtraOutput, ExportError, "does not follow the contract"), (_PerTokenLogits, parity.ParityError, "contract")],
)
def test_a_model_breaking_the_output_contract_is_refused_and_leaves_no_folder(tmp_path, wrap, error, words):
    model, meta = _small_model()
    with pytest.raises(error, match=words):
        export_model(wrap(model), meta, tmp_path)
    assert list(tmp_path.iterdir()) == []


class _IdsOnly(nn.Module):
    """Cannot be exported with the contract's two inputs: forward takes one."""

    def __init__(self, model: EncoderClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids, torch.ones_like(input_ids))


def test_an_exporter_failure_is_a_one_line_export_error_and_leaves_no_folder(tmp_path):
    model, meta = _small_model()
    with pytest.raises(ExportError, match=f"torch.onnx.export failed for {meta.name}: TypeError") as err:
        export_model(_IdsOnly(model), meta, tmp_path)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_failed_re_export_keeps_the_existing_folder_as_it_was(tmp_path):
    model, meta = _small_model()
    first = export_model(model, meta, tmp_path)
    before = {p.name: p.read_bytes() for p in first.folder.iterdir()}
    with pytest.raises(ExportError, match="exists"):
        export_model(model, meta, tmp_path, overwrite=False)
    with torch.no_grad():
        model.head.bias.add_(1.0)
    with pytest.raises(parity.ParityError):
        export_model(model, meta, tmp_path, atol=-1.0)
    assert [p.name for p in tmp_path.iterdir()] == [meta.name]  # no staging folder left either
    assert {p.name: p.read_bytes() for p in first.folder.iterdir()} == before
    second = export_model(model, meta, tmp_path)  # overwrite=True replaces it
    assert [p.name for p in tmp_path.iterdir()] == [meta.name]
    assert (second.folder / MODEL_FILE).read_bytes() != before[MODEL_FILE]


def test_an_unwritable_output_folder_is_an_export_error(tmp_path):
    model, meta = _small_model()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ExportError, match="cannot write to output folder"):
        export_model(model, meta, blocker / "models")
