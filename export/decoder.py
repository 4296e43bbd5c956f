"""The decoder-only language model built from our attention layer (query heads and key/value heads), with a KV cache,
and its one configuration dataclass. nanoGPT's shape: pre-LN blocks of causal self-attention and an MLP, token and
position embeddings, an LM head tied to the token embedding."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from contract.decoder_metadata import DecoderMetadata
from contract.metadata import config_name
from contract.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from export.attention import MultiHeadAttention, cache_mask, resolve_head_dim, resolve_kv_heads
from export.model import MLP

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (key, value), each (B, kv, P, hs)


@dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = VOCAB_SIZE  # 256 byte values + 4 special ids (contract/tokenizer.py)
    d_model: int = 128
    heads: int = 4
    kv_heads: int | None = None  # None: heads (MHA); 1: MQA; a divisor of heads in between: GQA
    head_dim: int | None = None  # None: d_model // heads
    layers: int = 2
    ff_dim: int | None = None  # None: 4 * d_model
    max_len: int = 256  # context length: prompt and generated tokens together
    dropout: float = 0.0
    task: str = ""  # the corpus it was trained on, "" if untrained
    name_prefix: str = "lm"

    def __post_init__(self) -> None:
        resolve_head_dim(self.d_model, self.heads, self.head_dim)  # raises a ValueError naming the numbers
        resolve_kv_heads(self.heads, self.kv_heads)  # the same, when kv_heads does not divide heads
        for key in ("vocab_size", "layers", "max_len"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {key}={value!r}")
        if self.vocab_size <= max(BOS_ID, EOS_ID, PAD_ID):
            raise ValueError(f"vocab_size={self.vocab_size} leaves no room for the special ids 0-3 and a token")
        if self.max_len < 2:
            raise ValueError(f"max_len (the context length) must be >= 2, got max_len={self.max_len}")
        if self.ff_dim is not None and (
            isinstance(self.ff_dim, bool) or not isinstance(self.ff_dim, int) or self.ff_dim < 1
        ):
            raise ValueError(f"ff_dim must be an integer >= 1 (or None for 4 * d_model), got ff_dim={self.ff_dim!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={self.dropout!r}")

    @property
    def resolved_head_dim(self) -> int:
        return resolve_head_dim(self.d_model, self.heads, self.head_dim)

    @property
    def resolved_kv_heads(self) -> int:
        return resolve_kv_heads(self.heads, self.kv_heads)

    @property
    def resolved_ff_dim(self) -> int:
        return self.ff_dim if self.ff_dim is not None else 4 * self.d_model

    @property
    def name(self) -> str:
        """`lm-h4-kv1-d64` (with `-hd32` when head_dim is not d_model / heads)."""
        return config_name(
            self.heads, self.d_model, self.resolved_head_dim, prefix=self.name_prefix, kv_heads=self.resolved_kv_heads
        )

    def metadata(self, exporter: dict[str, str] | None = None) -> DecoderMetadata:
        return DecoderMetadata(
            name=self.name,
            heads=self.heads,
            kv_heads=self.resolved_kv_heads,
            head_dim=self.resolved_head_dim,
            d_model=self.d_model,
            layers=self.layers,
            vocab_size=self.vocab_size,
            max_len=self.max_len,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            pad_id=PAD_ID,
            tokenizer="byte-v1" if self.vocab_size == VOCAB_SIZE else "ids",
            ff_dim=self.resolved_ff_dim,
            task=self.task,
            exporter=dict(exporter or {}),
        )


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """position_ids (B, S) of a left-padded batch, as Hugging Face computes them: cumsum(mask) - 1, 0 at padding."""
    return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, S)


class DecoderBlock(nn.Module):
    """Pre-LN decoder block: x + attn(ln(x)) over the cache, then x + mlp(ln(x))."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = MultiHeadAttention(
            config.d_model,
            config.heads,
            config.resolved_head_dim,
            dropout=config.dropout,
            causal=True,
            kv_heads=config.resolved_kv_heads,
        )
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x, mask, past_key, past_value):
        a, key, value = self.attn.forward_cached(self.ln_1(x), mask, past_key, past_value)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, key, value


class DecoderLM(nn.Module):
    """input_ids (B, T), attention_mask (B, P + T) 1 = token, position_ids (B, T), past (per layer (key, value),
    (B, kv, P, hs); None: P = 0) -> logits (B, T, vocab) and the present cache (B, kv, P + T, hs) per layer."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([DecoderBlock(config) for _ in range(config.layers)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied, as in GPT-2 and nanoGPT
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def empty_cache(self, batch: int) -> KVCache:
        """A cache of length 0 (prefill): per layer (key, value), each (B, kv, 0, hs)."""
        c = self.config
        shape = (batch, c.resolved_kv_heads, 0, c.resolved_head_dim)
        return tuple((torch.zeros(shape), torch.zeros(shape)) for _ in range(c.layers))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past: KVCache | None = None,
    ) -> tuple[torch.Tensor, KVCache]:
        B, T = input_ids.shape
        past = self.empty_cache(B) if past is None else past
        # (B, 1, T, P+T), True = attend; the mask itself where the export's kernel reads it (export/cache_attention.py)
        in_place = self.blocks[0].attn.cache_kernel is not None
        mask = attention_mask if in_place else cache_mask(attention_mask, T)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(position_ids))  # (B, T, d_model)
        present = []
        for block, (past_key, past_value) in zip(self.blocks, past, strict=True):
            x, key, value = block(x, mask, past_key, past_value)  # key, value: (B, kv, P+T, hs)
            present.append((key, value))
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        return logits, tuple(present)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # the tied head counted once


class FlatCache(nn.Module):
    """Export wrapper: the cache as flat tensors in the graph's order (past_key_values.0.key, .0.value, 1.key, ...),
    the outputs as logits then present.0.key, present.0.value, ..."""

    def __init__(self, model: DecoderLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, position_ids, past: tuple[torch.Tensor, ...]):
        pairs = tuple((past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2))
        logits, present = self.model(input_ids, attention_mask, position_ids, pairs)
        return (logits, *[t for pair in present for t in pair])
