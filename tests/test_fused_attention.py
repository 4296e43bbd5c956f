"""Fused attention in the exported graph: one com.microsoft.Attention node per layer, parity with torch on padded
batches for h = 1..16 and head_dim != d_model / h, the weights variant unfused, older unfused files still load."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from conftest import TINY
from torch import nn

from contract.metadata import ATTENTION_MODEL_FILE, MODEL_FILE, ModelMetadata
from export.attention import MultiHeadAttention
from export.convert import export_model, exporter_versions
from export.fused_attention import FUSED_KERNEL, UNFUSED_KERNEL, fused_attention, fused_layers, kernel_of
from export.model import EncoderClassifier, EncoderConfig

ALL_HEADS = list(range(1, 17))
SWEEP_D, SWEEP_HEAD_DIM, SWEEP_LEN = 8, 4, 12  # h * 4 differs from d_model 8 for every h but 2


def _padded(batch: int, seq: int, vocab: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (B, T) and mask (B, T): row i keeps max(1, seq - 2 i) tokens, padding ids random too."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, vocab, size=(batch, seq), dtype=np.int64)
    mask = np.zeros((batch, seq), dtype=np.int64)
    for row in range(batch):
        mask[row, : max(1, seq - 2 * row)] = 1
    return ids, mask


def _graph(path) -> onnx.GraphProto:
    return onnx.load(str(path), load_external_data=False).graph


def _meta(path) -> ModelMetadata:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return ModelMetadata.from_props(session.get_modelmeta().custom_metadata_map)


class HeadSweep(nn.Module):
    """One attention layer per h = 1..16 side by side on the same input, then a causal one (h = 4); logits = each
    layer's masked mean, so columns [d (i-1), d i) belong to layer i. Default nn.Linear init: outputs are O(1)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(260, SWEEP_D)
        layers = [MultiHeadAttention(SWEEP_D, h, head_dim=SWEEP_HEAD_DIM) for h in ALL_HEADS]
        self.layers = nn.ModuleList([*layers, MultiHeadAttention(SWEEP_D, 4, head_dim=SWEEP_HEAD_DIM, causal=True)])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)  # (B, T, d)
        m = attention_mask.to(x.dtype)[:, :, None]  # (B, T, 1)
        pooled = [(layer(x, attention_mask)[0] * m).sum(dim=1) / m.sum(dim=1) for layer in self.layers]  # (B, d)
        return torch.cat(pooled, dim=1)  # (B, 17 * d)


@pytest.fixture(scope="module")
def head_sweep(tmp_path_factory):
    """The HeadSweep model and an ORT session of its fused export (which passed the parity gate)."""
    torch.manual_seed(0)
    model = HeadSweep().eval()
    classes = (len(ALL_HEADS) + 1) * SWEEP_D
    labels = tuple(f"c{i}" for i in range(classes))
    meta = ModelMetadata("heads-1-16", 16, SWEEP_HEAD_DIM, SWEEP_D, 16, 260, SWEEP_LEN, classes, labels)
    path = export_model(model, meta, tmp_path_factory.mktemp("sweep")).folder / MODEL_FILE
    return model, path, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_every_multi_head_count_is_one_fused_node_with_its_own_num_heads_and_one_head_stays_unfused(head_sweep):
    _, path, _ = head_sweep
    nodes = [n for n in _graph(path).node if n.op_type == "Attention"]
    assert all(n.domain == "com.microsoft" for n in nodes)
    attributes = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    assert sorted(a["num_heads"] for a in attributes) == sorted([h for h in ALL_HEADS if h > 1] + [4])
    assert [a.get("unidirectional", 0) for a in attributes].count(1) == 1  # the causal layer
    assert sum(n.op_type == "Softmax" for n in _graph(path).node) == 1  # the single-head layer's, unfused
    assert _meta(path).attention_kernel == FUSED_KERNEL


@pytest.mark.parametrize("h", [*ALL_HEADS, "causal h=4"])
def test_fused_graph_matches_torch_on_padded_rows_for_every_head_count(head_sweep, h):
    model, _, session = head_sweep
    layer = len(ALL_HEADS) + 1 if isinstance(h, str) else h
    columns = slice(SWEEP_D * (layer - 1), SWEEP_D * layer)
    for batch, seq in [(1, 1), (5, 7), (6, SWEEP_LEN)]:
        ids, mask = _padded(batch, seq, 260, seed=layer + seq)
        (got,) = session.run(None, {"input_ids": ids, "attention_mask": mask})
        with torch.no_grad():
            want = model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
        assert np.abs(want[:, columns]).max() > 0.05  # far from 0: a wrong kernel could not hide under atol
        np.testing.assert_allclose(got[:, columns], want[:, columns], atol=1e-5, rtol=0)


@pytest.mark.parametrize("h", [2, 4])
def test_exported_model_runs_attention_fused_and_its_attention_variant_unfused(tiny_models_dir, h):
    folder = tiny_models_dir / f"mha-h{h}-d32"
    graph = _graph(folder / MODEL_FILE)
    assert sum(n.op_type == "Attention" and n.domain == "com.microsoft" for n in graph.node) == TINY["layers"]
    assert not any(n.op_type == "Softmax" for n in graph.node)  # no per-head softmax left in the main model
    assert _meta(folder / MODEL_FILE).attention_kernel == FUSED_KERNEL
    if h == 4:  # exported with --attention: the weights need the unfused path
        assert _meta(folder / ATTENTION_MODEL_FILE).attention_kernel == UNFUSED_KERNEL
        assert any(n.op_type == "Softmax" for n in _graph(folder / ATTENTION_MODEL_FILE).node)


@pytest.mark.parametrize(
    ("h", "head_dim", "causal", "bias"),
    [(2, None, False, True), (3, 16, False, True), (4, None, True, True), (8, None, False, False)],
)
def test_the_custom_op_in_torch_equals_the_layer(h, head_dim, causal, bias):
    torch.manual_seed(h)
    layer = MultiHeadAttention(32, h, head_dim=head_dim, causal=causal, bias=bias).eval()
    x = torch.randn(3, 9, 32)
    mask = torch.ones(3, 9, dtype=torch.int64)
    mask[1, 6:], mask[2, 2:] = 0, 0
    with torch.no_grad():
        want, _ = layer(x, mask)
        with fused_layers(layer) as count:
            got, _ = layer(x, mask)
        assert count == 1 and layer.export_kernel is None  # restored on exit
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    y = fused_attention(x, layer.qkv.weight, layer.qkv.bias, None, h, causal)
    assert y.shape == (3, 9, layer.inner_dim)


def test_a_training_layer_or_a_single_head_or_a_weights_request_is_not_fused():
    layer = MultiHeadAttention(16, 2)
    with fused_layers(layer) as count:
        assert count == 0 and layer.export_kernel is None
    with fused_layers(MultiHeadAttention(16, 1).eval()) as count:
        assert count == 0
    layer.eval()
    x = torch.randn(1, 4, 16)
    with fused_layers(layer), torch.no_grad():
        _, weights = layer(x, None, need_weights=True)
    assert weights.shape == (1, 2, 4, 4)


def test_a_model_exported_unfused_the_old_way_still_loads_and_agrees(tiny_models_dir, tmp_path):
    """What files exported before this change look like: unfused graph, no attention_kernel key."""
    torch.manual_seed(2)
    config = EncoderConfig(heads=2, **TINY)
    model = EncoderClassifier(config).eval()
    result = export_model(model, config.metadata(exporter_versions()), tmp_path, fuse_attention=False)
    path = result.folder / MODEL_FILE
    proto = onnx.load(str(path))
    assert kernel_of(proto) == UNFUSED_KERNEL and any(n.op_type == "Softmax" for n in proto.graph.node)
    kept = [p for p in proto.metadata_props if p.key != "attention_kernel"]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    onnx.save(proto, str(path))
    meta = _meta(path)
    assert meta.attention_kernel == ""  # not recorded: files exported before it was
    assert replace(meta, attention_kernel=FUSED_KERNEL) == _meta(tiny_models_dir / config.name / MODEL_FILE)
    old = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    fused = ort.InferenceSession(str(tiny_models_dir / config.name / MODEL_FILE), providers=["CPUExecutionProvider"])
    ids, mask = _padded(5, 13, config.vocab_size, seed=5)
    feed = {"input_ids": ids, "attention_mask": mask}
    np.testing.assert_allclose(old.run(None, feed)[0], fused.run(None, feed)[0], atol=1e-5, rtol=0)
