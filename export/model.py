"""The Transformer encoder classifier built from our attention layer, and its one configuration dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from contract.metadata import ModelMetadata, config_name
from contract.tokenizer import VOCAB_SIZE
from export.attention import MultiHeadAttention, resolve_head_dim


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int = VOCAB_SIZE  # 256 byte values + 4 special ids (contract/tokenizer.py)
    d_model: int = 512
    heads: int = 8
    head_dim: int | None = None  # None: d_model // heads
    layers: int = 4
    ff_dim: int | None = None  # None: 4 * d_model
    max_len: int = 128
    num_classes: int = 2
    labels: tuple[str, ...] = ("negative", "positive")
    dropout: float = 0.0
    causal: bool = False
    task: str = ""  # the built-in task it was trained on, "" if untrained
    name_prefix: str = "mha"
    layer_heads: tuple[int, ...] | None = None  # None: every layer has `heads`; else one count per layer (pruned)
    removed_heads: tuple[tuple[int, ...], ...] = ()  # per layer, the original indices of the heads pruned away
    pruned_from: str = ""  # the name of the model it was pruned from; "": not pruned

    def __post_init__(self) -> None:
        resolve_head_dim(self.d_model, self.heads, self.head_dim)  # raises a ValueError naming the numbers
        for key in ("vocab_size", "layers", "max_len", "num_classes"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {key}={value!r}")
        if self.ff_dim is not None and (
            isinstance(self.ff_dim, bool) or not isinstance(self.ff_dim, int) or self.ff_dim < 1
        ):
            raise ValueError(f"ff_dim must be an integer >= 1 (or None for 4 * d_model), got ff_dim={self.ff_dim!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got dropout={self.dropout!r}")
        if len(self.labels) != self.num_classes:
            raise ValueError(f"{len(self.labels)} labels given for num_classes={self.num_classes}")
        if self.layer_heads is not None and (
            len(self.layer_heads) != self.layers
            or any(isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.layer_heads)
            or max(self.layer_heads) != self.heads
        ):
            raise ValueError(
                f"layer_heads={self.layer_heads!r} needs one count >= 1 per layer (layers={self.layers}), "
                f"the largest equal to heads={self.heads}"
            )

    def heads_of(self, layer: int) -> int:
        """The number of heads of layer `layer` (pruned layers may have fewer than `heads`)."""
        return self.heads if self.layer_heads is None else self.layer_heads[layer]

    @property
    def resolved_head_dim(self) -> int:
        return resolve_head_dim(self.d_model, self.heads, self.head_dim)

    @property
    def resolved_ff_dim(self) -> int:
        return self.ff_dim if self.ff_dim is not None else 4 * self.d_model

    @property
    def name(self) -> str:
        """`mha-h8-d128`; a pruned model adds the heads kept per layer to its source's name: `mha-h8-d128-keep6-5`."""
        if self.pruned_from:
            return f"{self.pruned_from}-keep" + "-".join(str(self.heads_of(i)) for i in range(self.layers))
        return config_name(self.heads, self.d_model, self.resolved_head_dim, prefix=self.name_prefix)

    def metadata(self, exporter: dict[str, str] | None = None) -> ModelMetadata:
        return ModelMetadata(
            name=self.name,
            heads=self.heads,
            head_dim=self.resolved_head_dim,
            d_model=self.d_model,
            layers=self.layers,
            vocab_size=self.vocab_size,
            max_len=self.max_len,
            num_classes=self.num_classes,
            labels=tuple(self.labels),
            tokenizer="byte-v1" if self.vocab_size == VOCAB_SIZE else "ids",
            ff_dim=self.resolved_ff_dim,
            task=self.task,
            exporter=dict(exporter or {}),
            layer_heads=tuple(self.layer_heads or ()),
            removed_heads=tuple(tuple(layer) for layer in self.removed_heads),
            pruned_from=self.pruned_from,
        )


class MLP(nn.Module):
    """The feed-forward half of a block, for any config with d_model, resolved_ff_dim and dropout (the encoder's and
    the decoder's)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.resolved_ff_dim)
        self.proj = nn.Linear(config.resolved_ff_dim, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(nn.functional.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN encoder block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: EncoderConfig, layer: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = MultiHeadAttention(
            config.d_model,
            config.heads_of(layer),
            config.resolved_head_dim,
            dropout=config.dropout,
            causal=config.causal,
        )
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x, mask, need_weights: bool = False):
        a, weights = self.attn(self.ln_1(x), mask, need_weights=need_weights)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return x, weights


class EncoderClassifier(nn.Module):
    """input_ids (B, T) int64, attention_mask (B, T) int64 (1 = token) -> logits (B, num_classes) float32."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config, i) for i in range(config.layers)])
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.num_classes)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        logits, _ = self.forward_with_attention(input_ids, attention_mask, need_weights=False)
        return logits

    def forward_with_attention(self, input_ids, attention_mask, need_weights: bool = True):
        """logits (B, C) and, when need_weights, per-layer weights stacked as (B, layers, h, T, T)."""
        if need_weights and self.config.layer_heads is not None and len(set(self.config.layer_heads)) > 1:
            raise ValueError(f"{self.config.name}: layers with different head counts have no stacked weights")
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos)[None])  # (B, T, d_model)
        all_weights = []
        for block in self.blocks:
            x, weights = block(x, attention_mask, need_weights=need_weights)
            all_weights.append(weights)
        x = self.ln_f(x)
        m = attention_mask.to(x.dtype)[:, :, None]  # (B, T, 1)
        pooled = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)  # (B, d_model): masked mean
        logits = self.head(pooled)  # (B, C)
        stacked = torch.stack(all_weights, dim=1) if need_weights else None  # (B, layers, h, T, T)
        return logits, stacked

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class AttentionOutputs(nn.Module):
    """Export wrapper: the same model with a second output, `attention_weights` (B, layers, h, T, T)."""

    def __init__(self, model: EncoderClassifier) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        return self.model.forward_with_attention(input_ids, attention_mask, need_weights=True)
