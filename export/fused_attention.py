"""The fused attention kernel of the exported graph: one ONNX Runtime `com.microsoft.Attention` node per layer.

While exporting, each MultiHeadAttention calls a torch custom op whose ONNX translation is that node (QKV projection,
padding mask, softmax and values in one CPU kernel); the attention-weights variant stays unfused."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import onnx
import torch
import torch.nn.functional as F
from onnx.defs import OpSchema
from onnxscript import opset20 as op
from onnxscript.values import Op, Opset
from torch import nn

from export.attention import MultiHeadAttention, attention_mask

FUSED_KERNEL = "com.microsoft.Attention"  # what the metadata's attention_kernel says of a fused graph
UNFUSED_KERNEL = "unfused"  # attention as separate MatMul, Softmax, Transpose... nodes
_DOMAIN, _OP = "com.microsoft", "Attention"


@torch.library.custom_op("mha_serving::fused_attention", mutates_args=())
def fused_attention(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    heads: int,
    causal: bool,
) -> torch.Tensor:
    """x (B, T, D), weight (3 h hs, D) and bias of the fused QKV projection, key_padding_mask (B, T) 1 = token
    -> softmax(q k^T / sqrt(hs)) v as (B, T, h hs): what the exported node computes, in torch."""
    B, T, _ = x.shape
    inner = weight.shape[0] // 3
    q, k, v = F.linear(x, weight, bias).split(inner, dim=2)  # 3 x (B, T, h*hs)
    q, k, v = (t.reshape(B, T, heads, inner // heads).transpose(1, 2) for t in (q, k, v))  # 3 x (B, h, T, hs)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(key_padding_mask, T, causal, x.device))
    return y.transpose(1, 2).reshape(B, T, inner)  # (B, T, h*hs)


@fused_attention.register_fake
def _(x, weight, bias, key_padding_mask, heads, causal):
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[0] // 3)  # (B, T, h*hs)


def _attention_schema() -> OpSchema:
    """The part of ORT's contrib `Attention` schema the exporter needs to build the node; ORT checks the full one."""
    single, optional = OpSchema.FormalParameterOption.Single, OpSchema.FormalParameterOption.Optional
    inputs = [("input", "T", single), ("weights", "T", single), ("bias", "T", optional), ("mask_index", "M", optional)]
    return OpSchema(
        _OP,
        _DOMAIN,
        1,
        inputs=[OpSchema.FormalParameter(name, kind, param_option=option) for name, kind, option in inputs],
        outputs=[OpSchema.FormalParameter("output", "T")],
        type_constraints=[("T", ["tensor(float)"], "float32 activations"), ("M", ["tensor(int32)"], "1 = token")],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "number of heads"),
            OpSchema.Attribute("unidirectional", OpSchema.AttrType.INT, "1: causal"),
        ],
    )


_ATTENTION = Op(Opset(_DOMAIN, 1), _OP, _attention_schema())


def _attention_node(x, weight, bias, key_padding_mask, heads: int, causal: bool):
    """The translation of `fused_attention`: one Attention node (ORT wants the weight as (D, 3 h hs))."""
    weights = op.Transpose(weight, perm=[1, 0])  # (D, 3*h*hs), folded into the initializer at export
    mask = None if key_padding_mask is None else op.Cast(key_padding_mask, to=onnx.TensorProto.INT32)  # (B, T)
    return _ATTENTION(x, weights, bias, mask, num_heads=heads, unidirectional=int(causal))  # (B, T, h*hs)


def translation_table() -> dict:
    """For `torch.onnx.export(..., custom_translation_table=...)`."""
    return {torch.ops.mha_serving.fused_attention.default: _attention_node}


@contextlib.contextmanager
def fused_layers(module: nn.Module) -> Iterator[int]:
    """Within: every multi-head MultiHeadAttention of `module` in eval mode runs as the custom op (unless weights
    are asked for); yields how many layers do. A single-head layer stays unfused: ORT's kernel splits its work by
    batch x heads, so at batch 1 one head leaves a thread idle (measured: fused 0.85-0.87x the unfused graph at
    batch 1, and 0.94x torch at 1 x 512; the unfused h = 1 graph was 1.02-1.91x torch at every shape)."""
    layers = [
        m
        for m in module.modules()
        if isinstance(m, MultiHeadAttention) and not m.training and m.h > 1 and m.kv_heads == m.h  # no GQA in the op
    ]
    for layer in layers:
        layer.export_kernel = fused_attention
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.export_kernel = None


def kernel_of(model: onnx.ModelProto) -> str:
    """FUSED_KERNEL when the graph runs attention as the fused node, else UNFUSED_KERNEL."""
    fused = any(node.op_type == _OP and node.domain == _DOMAIN for node in model.graph.node)
    return FUSED_KERNEL if fused else UNFUSED_KERNEL
