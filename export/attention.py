"""The multi-head attention layer: query heads and key/value heads (MHA, GQA, MQA), fused QKV projection, SDPA
kernel, padding and causal masks, a KV cache for decoding, weights on demand, a gate on each head's output
(importance scores, masking) and a copy with fewer heads (pruning)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


def resolve_head_dim(d_model: int, heads: int, head_dim: int | None) -> int:
    """head_dim as given, else d_model // heads; ValueError naming the numbers when that does not divide."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"the number of heads must be an integer >= 1, got h={heads!r}")
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
        raise ValueError(f"d_model must be an integer >= 1, got d_model={d_model!r}")
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"head_dim must be an integer >= 1, got head_dim={head_dim!r}")
        return head_dim
    if d_model % heads != 0:
        raise ValueError(
            f"d_model={d_model} is not divisible by h={heads}; pass head_dim explicitly "
            f"(for example head_dim={math.ceil(d_model / heads)}, so that h * head_dim = "
            f"{heads * math.ceil(d_model / heads)} is projected back to d_model)"
        )
    return d_model // heads


def resolve_kv_heads(heads: int, kv_heads: int | None) -> int:
    """kv_heads as given (None: heads, plain multi-head attention); ValueError naming the numbers unless it divides
    heads (each key/value head serves heads // kv_heads query heads: 1 is MQA, between 1 and heads GQA)."""
    if kv_heads is None:
        return heads
    if isinstance(kv_heads, bool) or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ValueError(f"kv_heads must be an integer >= 1, got kv_heads={kv_heads!r}")
    if heads % kv_heads != 0:
        divisors = [k for k in range(1, heads + 1) if heads % k == 0]
        raise ValueError(
            f"kv_heads={kv_heads} does not divide h={heads}: each key/value head serves a whole group of query "
            f"heads; choose kv_heads from {divisors}"
        )
    return kv_heads


def cache_mask(key_padding_mask: torch.Tensor, T: int) -> torch.Tensor:
    """The boolean SDPA mask (True = attend) of T new queries over a KV cache: key_padding_mask (B, P + T), 1 = token,
    covers the P cached positions and the T new ones; query i sits at position P + i and sees keys 0 .. P + i that
    are tokens, and always itself, so that a padding query's row is never empty (an empty row is NaN in ONNX)."""
    S = key_padding_mask.shape[1]
    key_pos = torch.arange(S, device=key_padding_mask.device)  # (S,)
    query_pos = torch.arange(T, device=key_padding_mask.device) + (S - T)  # (T,): positions P .. P + T - 1
    causal = key_pos[None, :] <= query_pos[:, None]  # (T, S)
    itself = key_pos[None, :] == query_pos[:, None]  # (T, S)
    tokens = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, S)
    return (tokens & causal[None, None]) | itself[None, None]  # (B, 1, T, S)


def attention_mask(
    key_padding_mask: torch.Tensor | None, T: int, causal: bool, device: torch.device
) -> torch.Tensor | None:
    """The boolean mask SDPA takes (True = attend) from a (B, T) padding mask (1 = token) and causality, or None."""
    mask = None
    if key_padding_mask is not None:
        mask = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, T)
    if causal:
        tril = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]  # (1, 1, T, T)
        mask = tril if mask is None else mask & tril
    return mask


class MultiHeadAttention(nn.Module):
    """Self-attention with `h` heads of size `head_dim` (default d_model // h; h * head_dim may differ from d_model)
    and `kv_heads` key/value heads (default h; query head i reads key/value head i // (h // kv_heads)).

    forward(x, key_padding_mask) -> (out, weights): x (B, T, d_model); key_padding_mask (B, T) with 1 = token,
    0 = padding; out (B, T, d_model); weights (B, h, T, T) when need_weights, else None. While `head_gate` is set
    ((h,) or (B, h)), each head's output is multiplied by its gate before the output projection (0 masks the head).
    """

    def __init__(
        self,
        d_model: int = 512,
        h: int = 8,
        head_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        causal: bool = False,
        kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.h = h
        self.head_dim = resolve_head_dim(d_model, h, head_dim)
        self.kv_heads = resolve_kv_heads(h, kv_heads)
        self.inner_dim = self.h * self.head_dim
        self.kv_dim = self.kv_heads * self.head_dim
        self.dropout = dropout
        self.causal = causal
        # fused [q; k; v], (h + 2 kv) * hs rows: with kv_heads == h, [q; k; v] of nn.MultiheadAttention's layout
        self.qkv = nn.Linear(d_model, self.inner_dim + 2 * self.kv_dim, bias=bias)
        self.out = nn.Linear(self.inner_dim, d_model, bias=bias)
        self.export_kernel: Callable[..., torch.Tensor] | None = None  # set while exporting (export/fused_attention.py)
        self.head_gate: torch.Tensor | None = None  # set while scoring or masking heads (export/importance.py)
        self.cache_kernel: Callable[..., tuple] | None = (
            None  # set while exporting a decoder (export/cache_attention.py)
        )

    def forward(
        self,
        x: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.export_kernel is not None and not need_weights and self.head_gate is None:  # one fused node
            y = self.export_kernel(x, self.qkv.weight, self.qkv.bias, key_padding_mask, self.h, self.causal)
            return self.out(y), None  # y: (B, T, h*hs)
        B, T, _ = x.shape
        q, k, v = self._project(x)  # (B, h, T, hs), 2 x (B, kv, T, hs)
        k, v = self._repeat_kv(k), self._repeat_kv(v)  # 2 x (B, h, T, hs)
        mask = attention_mask(key_padding_mask, T, self.causal, x.device)  # (B or 1, 1, T or 1, T), True = attend
        p = self.dropout if self.training else 0.0
        if need_weights:
            y, weights = self._manual_attention(q, k, v, mask, p)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)  # (B, h, T, hs)
            weights = None
        if self.head_gate is not None:
            y = y * self.head_gate.reshape(-1, self.h, 1, 1)  # (B, h, T, hs) x (B or 1, h, 1, 1)
        y = y.transpose(1, 2).reshape(B, T, self.inner_dim)  # (B, T, h*hs)
        return self.out(y), weights

    def forward_cached(
        self, x: torch.Tensor, mask: torch.Tensor, past_key: torch.Tensor, past_value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attention of T new tokens over a KV cache: x (B, T, d_model); past_key, past_value (B, kv, P, hs), P >= 0;
        mask (B, 1, T, P + T) True = attend (cache_mask). Returns out (B, T, d_model) and the present key and value
        (B, kv, P + T, hs): the cache holds kv_heads heads, shared by the query heads of each group. While exporting
        with `cache_kernel`, `mask` is the attention mask (B, M) itself and the cache is left-aligned (its module)."""
        if self.cache_kernel is not None:
            q, k, v = self.qkv(x).split([self.inner_dim, self.kv_dim, self.kv_dim], dim=2)  # (B, T, h*hs), 2 x kv*hs
            y, key, value = self.cache_kernel(q, k, v, past_key, past_value, mask, self.h, self.kv_heads)
            return self.out(y), key, value  # y: (B, T, h*hs)
        B, T, _ = x.shape
        q, k, v = self._project(x)  # (B, h, T, hs), 2 x (B, kv, T, hs)
        k = torch.cat([past_key, k], dim=2)  # (B, kv, P+T, hs)
        v = torch.cat([past_value, v], dim=2)  # (B, kv, P+T, hs)
        # enable_gqa: query head i reads key/value head i // (h // kv), as _repeat_kv spells out; exported at opset
        # 23 as one ONNX Attention node that takes the kv heads as they are (no repeated copy of the cache)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.h)  # (B, h, T, hs)
        if self.head_gate is not None:  # scoring or masking a decoder's query heads (export/lm_importance.py)
            y = y * self.head_gate.reshape(-1, self.h, 1, 1)  # (B, h, T, hs) x (B or 1, h, 1, 1)
        y = y.transpose(1, 2).reshape(B, T, self.inner_dim)  # (B, T, h*hs)
        return self.out(y), k, v

    def cached_weights(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The weights (B, h, T, T) forward_cached applies to T tokens with no cache (mask: cache_mask's
        (B, 1, T, T)), by the readable path; query head i reads key/value head i // (h // kv_heads)."""
        q, k, v = self._project(x)  # (B, h, T, hs), 2 x (B, kv, T, hs)
        _, weights = self._manual_attention(q, self._repeat_kv(k), self._repeat_kv(v), mask, 0.0)
        return weights

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection split into heads: q (B, h, T, hs), k and v (B, kv, T, hs)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.inner_dim, self.kv_dim, self.kv_dim], dim=2)  # (B, T, h*hs), 2 x kv*hs
        q = q.view(B, T, self.h, self.head_dim).transpose(1, 2)  # (B, h, T, hs)
        k = k.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, hs)
        v = v.view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, kv, T, hs)
        return q, k, v

    def _repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        """(B, kv, S, hs) -> (B, h, S, hs): each key/value head repeated for the query heads of its group."""
        if self.kv_heads == self.h:
            return t  # plain multi-head attention: nothing to share
        return t.repeat_interleave(self.h // self.kv_heads, dim=1)  # (B, h, S, hs)

    def _manual_attention(self, q, k, v, mask, p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The readable path: softmax(q k^T / sqrt(hs)) v, returning the weights (B, h, T, T) as well."""
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, h, T, T)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        weights = F.softmax(scores, dim=-1)  # (B, h, T, T), rows sum to 1 over unmasked keys
        if mask is not None:
            weights = weights.masked_fill(~mask, 0.0)  # a query with no key to attend gets zeros, as SDPA gives
        y = F.dropout(weights, p=p) @ v  # (B, h, T, hs)
        return y, weights

    @torch.no_grad()
    def keep_heads(self, heads: Sequence[int]) -> MultiHeadAttention:
        """A new layer with only `heads` (indices into this layer's, in that order): smaller QKV and output
        projections, the same head_dim. Its output equals this layer's with every other head's gate at 0."""
        heads = list(heads)
        if self.kv_heads != self.h:
            raise ValueError(f"pruning needs kv_heads == h; this layer has h={self.h}, kv_heads={self.kv_heads}")
        if not heads or len(set(heads)) != len(heads) or any(not 0 <= i < self.h for i in heads):
            raise ValueError(f"heads to keep must be distinct indices in [0, {self.h}), at least one; got {heads}")
        bias = self.qkv.bias is not None
        layer = MultiHeadAttention(self.d_model, len(heads), self.head_dim, self.dropout, bias, self.causal)
        index = torch.tensor(heads)
        qkv = self.qkv.weight.view(3, self.h, self.head_dim, self.d_model)  # (3, h, hs, D)
        layer.qkv.weight.copy_(qkv[:, index].reshape(3 * layer.inner_dim, self.d_model))  # (3 h' hs, D)
        out = self.out.weight.view(self.d_model, self.h, self.head_dim)  # (D, h, hs)
        layer.out.weight.copy_(out[:, index].reshape(self.d_model, layer.inner_dim))  # (D, h' hs)
        if bias:
            qkv_bias = self.qkv.bias.view(3, self.h, self.head_dim)  # (3, h, hs)
            layer.qkv.bias.copy_(qkv_bias[:, index].reshape(3 * layer.inner_dim))  # (3 h' hs,)
            layer.out.bias.copy_(self.out.bias)
        return layer

    @torch.no_grad()
    def load_from_torch(self, mha: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy weights from a `torch.nn.MultiheadAttention` of the same shape (its in_proj is fused like ours).

        Weights only: this layer always takes batch-first input, and its mask is 1 = token where torch's
        key_padding_mask is True = ignore (pass `~key_padding_mask`)."""
        if (
            mha.embed_dim != self.d_model
            or mha.num_heads != self.h
            or self.inner_dim != self.d_model
            or self.kv_heads != self.h
        ):
            raise ValueError(
                f"cannot load nn.MultiheadAttention(embed_dim={mha.embed_dim}, num_heads={mha.num_heads}) into "
                f"MultiHeadAttention(d_model={self.d_model}, h={self.h}, head_dim={self.head_dim}, "
                f"kv_heads={self.kv_heads})"
            )
        if mha.in_proj_weight is None:
            raise ValueError("nn.MultiheadAttention with separate q/k/v dimensions (kdim/vdim) is not supported")
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError("nn.MultiheadAttention with add_bias_kv or add_zero_attn has no equivalent here")
        if (mha.in_proj_bias is None) != (self.qkv.bias is None):
            raise ValueError("bias mismatch: one layer has projection biases and the other does not")
        self.qkv.weight.copy_(mha.in_proj_weight)  # (3E, E)
        self.out.weight.copy_(mha.out_proj.weight)  # (E, E)
        if self.qkv.bias is not None:
            self.qkv.bias.copy_(mha.in_proj_bias)
            self.out.bias.copy_(mha.out_proj.bias)
        return self

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, causal: bool = False) -> MultiHeadAttention:
        """A new layer holding the weights of `mha`."""
        layer = cls(mha.embed_dim, mha.num_heads, dropout=mha.dropout, bias=mha.in_proj_bias is not None, causal=causal)
        return layer.load_from_torch(mha)
