"""A trained decoder's causal attention maps, per layer and query head, for a prompt: from its torch checkpoint (the
exported graph has no weights output), by the attention layer's readable path. Under GQA each query head has its own
map over the key/value head its group shares."""

from __future__ import annotations

from pathlib import Path

import torch

from contract.attention_map import AttentionMap, AttentionMapError
from contract.tokenizer import ByteTokenizer, SequenceTooLongError
from export.attention import cache_mask
from export.checkpoint import CheckpointError
from export.decoder import DecoderLM
from export.lm_checkpoint import load_decoder


@torch.no_grad()
def decoder_weights(model: DecoderLM, ids: list[int]) -> torch.Tensor:
    """Attention weights (layers, h, T, T) of one unpadded prompt: row = query token, column = key token."""
    T = len(ids)
    x_ids = torch.tensor([ids])  # (1, T)
    mask = cache_mask(torch.ones(1, T, dtype=torch.int64), T)  # (1, 1, T, T), causal
    x = model.tok_emb(x_ids) + model.pos_emb(torch.arange(T)[None])  # (1, T, d_model)
    weights = []
    for block, (past_key, past_value) in zip(model.blocks, model.empty_cache(1), strict=True):
        weights.append(block.attn.cached_weights(block.ln_1(x), mask)[0])  # (h, T, T)
        x, _, _ = block(x, mask, past_key, past_value)
    return torch.stack(weights)  # (layers, h, T, T)


def kv_head_of(model: DecoderLM, head: int) -> int:
    """The key/value head that query head `head` reads (its group's)."""
    c = model.config
    return head // (c.heads // c.resolved_kv_heads)


def decoder_attention_map(path: Path, text: str, layer: int | None = None) -> tuple[AttentionMap, DecoderLM]:
    """The maps of the decoder in `path` (a model folder or its checkpoint.pt) on `text` (BOS + its bytes), for one
    layer or every layer; AttentionMapError (one line) for a path, text, or layer it cannot take."""
    try:
        model = load_decoder(path).model
    except CheckpointError as exc:
        raise AttentionMapError(str(exc)) from exc
    meta = model.config.metadata()
    if layer is not None and not 0 <= layer < meta.layers:
        raise AttentionMapError(
            f"layer {layer} is out of range: {meta.name} has {meta.layers} layer(s): 0..{meta.layers - 1}"
        )
    tokenizer = ByteTokenizer(meta.max_len)
    try:
        ids = tokenizer.encode(text)
    except SequenceTooLongError as exc:
        raise AttentionMapError(str(exc)) from exc
    layers = tuple(range(meta.layers)) if layer is None else (layer,)
    weights = decoder_weights(model, ids)[list(layers)].numpy()  # (len(layers), h, T, T)
    return AttentionMap(meta, tuple(tokenizer.tokens(text)), layers, weights), model  # type: ignore[arg-type]
