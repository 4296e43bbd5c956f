"""The decoder's attention over its KV cache as ONNX Runtime's `com.microsoft.GroupQueryAttention`, one node per layer.

That kernel reads each row's own length (`seqlens_k`, from the attention mask) and writes the new keys and values
after them, so a server can keep the cache in one buffer of the whole context and bind it as both `past` and
`present`: nothing is copied from step to step (ORT GenAI's `past_present_share_buffer`). Its layout: every row's
tokens from column 0 (padding on the right), the mask 1 on each row's first tokens. While exporting, each layer calls
a torch custom op whose ONNX translation is that node; the torch model itself keeps its own attention."""

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

from contract.decoder_metadata import IN_PLACE_KERNEL
from export.attention import MultiHeadAttention

_DOMAIN, _OP = IN_PLACE_KERNEL.rsplit(".", 1)
HEAD_DIM_MULTIPLE = 8  # ORT's kernel takes head_dim in multiples of 8 only


@torch.library.custom_op("mha_serving::cache_attention", mutates_args=())
def cache_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    past_key: torch.Tensor,
    past_value: torch.Tensor,
    attention_mask: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, T, h hs), k and v (B, T, kv hs), past (B, kv, P, hs) with row b's tokens in columns [0, n_b - T),
    attention_mask (B, M) with n_b ones from column 0 -> out (B, T, h hs) and present (B, kv, max(M, P), hs), row b's
    new keys and values written after its past: what the exported node computes, in torch."""
    B, T, _ = q.shape
    kv, hs = kv_heads, past_key.shape[3]
    width = max(attention_mask.shape[1], past_key.shape[2])
    out = q.new_zeros(B, T, heads * hs)
    present = [past_key.new_zeros(B, kv, width, hs), past_value.new_zeros(B, kv, width, hs)]
    new = [t.reshape(B, T, kv, hs).transpose(1, 2) for t in (k, v)]  # 2 x (B, kv, T, hs)
    for b in range(B):
        total = int(attention_mask[b].sum())
        first = 0 if attention_mask.shape[1] == T else total - T  # a whole prompt starts at 0, else after the past
        for cache, past, fresh in zip(present, (past_key, past_value), new, strict=True):
            cache[b, :, :first] = past[b, :, :first]
            cache[b, :, first : first + T] = fresh[b]
        qb = q[b].reshape(T, heads, hs).transpose(0, 1)[None]  # (1, h, T, hs)
        causal = torch.arange(first + T)[None, :] <= torch.arange(first, first + T)[:, None]  # (T, first + T)
        keys, values = (cache[b : b + 1, :, : first + T] for cache in present)  # (1, kv, first + T, hs)
        y = F.scaled_dot_product_attention(qb, keys, values, attn_mask=causal, enable_gqa=heads != kv)  # (1, h, T, hs)
        out[b] = y[0].transpose(0, 1).reshape(T, heads * hs)
    return out, present[0], present[1]


@cache_attention.register_fake
def _(q, k, v, past_key, past_value, attention_mask, heads, kv_heads):
    B, T, _ = q.shape
    shape = (B, past_key.shape[1], past_key.shape[2] + T, past_key.shape[3])  # (B, kv, P + T, hs) as traced
    return q.new_empty(q.shape), past_key.new_empty(shape), past_value.new_empty(shape)


def _schema() -> OpSchema:
    """The part of ORT's contrib `GroupQueryAttention` schema the exporter needs to build the node; ORT checks the
    full one."""
    single = OpSchema.FormalParameterOption.Single
    inputs = [("query", "T"), ("key", "T"), ("value", "T"), ("past_key", "T"), ("past_value", "T")]
    inputs += [("seqlens_k", "M"), ("total_sequence_length", "M")]
    return OpSchema(
        _OP,
        _DOMAIN,
        1,
        inputs=[OpSchema.FormalParameter(name, kind, param_option=single) for name, kind in inputs],
        outputs=[OpSchema.FormalParameter(name, "T") for name in ("output", "present_key", "present_value")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "activations"), ("M", ["tensor(int32)"], "")],
        attributes=[
            OpSchema.Attribute("num_heads", OpSchema.AttrType.INT, "query heads"),
            OpSchema.Attribute("kv_num_heads", OpSchema.AttrType.INT, "key/value heads"),
        ],
    )


_GQA = Op(Opset(_DOMAIN, 1), _OP, _schema())


def _cache_attention_node(q, k, v, past_key, past_value, attention_mask, heads: int, kv_heads: int):
    """The translation: each row's last position (ones - 1) and the mask's width, then the node. The exporter
    shares the two small computations between layers."""
    ones = op.ReduceSum(attention_mask, op.Constant(value_ints=[1]), keepdims=0)  # (B,)
    seqlens = op.Cast(op.Sub(ones, op.Constant(value_int=1)), to=onnx.TensorProto.INT32)  # (B,)
    total = op.Cast(op.Gather(op.Shape(attention_mask), op.Constant(value_int=1), axis=0), to=onnx.TensorProto.INT32)
    return _GQA(q, k, v, past_key, past_value, seqlens, total, num_heads=heads, kv_num_heads=kv_heads)


def translation_table() -> dict:
    """For `torch.onnx.export(..., custom_translation_table=...)`."""
    return {torch.ops.mha_serving.cache_attention.default: _cache_attention_node}


def takes(layer: MultiHeadAttention) -> bool:
    """Whether ORT's kernel can run this layer."""
    return layer.head_dim % HEAD_DIM_MULTIPLE == 0


@contextlib.contextmanager
def in_place_layers(module: nn.Module) -> Iterator[bool]:
    """Within: every MultiHeadAttention of `module` runs its cached attention as the custom op, when the kernel takes
    every one of them; yields whether they do."""
    layers = [m for m in module.modules() if isinstance(m, MultiHeadAttention)]
    fits = bool(layers) and all(takes(m) for m in layers)
    if fits:
        for layer in layers:
            layer.cache_kernel = cache_attention
    try:
        yield fits
    finally:
        for layer in layers:
            layer.cache_kernel = None
