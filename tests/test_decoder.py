"""The decoder: key/value heads in the attention layer (MHA as before, GQA, MQA), the KV cache against no cache,
left padding, and the configuration's name and errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from export.attention import MultiHeadAttention, attention_mask, cache_mask
from export.decoder import DecoderConfig, DecoderLM, positions_from_mask

D_MODEL = 32
HEAD_PAIRS = [(4, 4), (4, 2), (4, 1), (8, 2)]


def _inputs(batch: int = 3, seq: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, D_MODEL, generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(batch):
        mask[row, seq - row :] = 0
    return x, mask


def _seed_formulation(layer: MultiHeadAttention, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The layer's forward as it was before key/value heads: one [q; k; v] projection split in three equal parts."""
    B, T, _ = x.shape
    q, k, v = layer.qkv(x).split(layer.inner_dim, dim=2)
    q, k, v = (t.view(B, T, layer.h, layer.head_dim).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(mask, T, layer.causal, x.device))
    return layer.out(y.transpose(1, 2).reshape(B, T, layer.inner_dim))


@pytest.mark.parametrize("h", [1, 2, 4, 8])
@pytest.mark.parametrize("causal", [False, True])
def test_kv_heads_equal_to_heads_is_the_seed_formulation_exactly(h, causal):
    torch.manual_seed(h)
    plain = MultiHeadAttention(D_MODEL, h, causal=causal).eval()
    explicit = MultiHeadAttention(D_MODEL, h, causal=causal, kv_heads=h).eval()
    explicit.load_state_dict(plain.state_dict())  # the same parameters, the same shapes: checkpoints load as before
    assert plain.qkv.weight.shape == (3 * D_MODEL, D_MODEL)
    x, mask = _inputs()
    with torch.no_grad():
        want = _seed_formulation(plain, x, mask)
        assert torch.equal(plain(x, mask)[0], want)
        assert torch.equal(explicit(x, mask)[0], want)


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_grouped_heads_equal_full_heads_whose_keys_and_values_are_copied_per_group(h, kv):
    torch.manual_seed(0)
    grouped = MultiHeadAttention(D_MODEL, h, kv_heads=kv, causal=True).eval()
    full = MultiHeadAttention(D_MODEL, h, causal=True).eval()
    hs, group = grouped.head_dim, h // kv
    with torch.no_grad():
        q, k, v = grouped.qkv.weight.split([h * hs, kv * hs, kv * hs])  # (h hs, D), 2 x (kv hs, D)
        k, v = (t.view(kv, hs, D_MODEL).repeat_interleave(group, dim=0).reshape(h * hs, D_MODEL) for t in (k, v))
        full.qkv.weight.copy_(torch.cat([q, k, v]))
        qb, kb, vb = grouped.qkv.bias.split([h * hs, kv * hs, kv * hs])
        kb, vb = (t.view(kv, hs).repeat_interleave(group, dim=0).reshape(-1) for t in (kb, vb))
        full.qkv.bias.copy_(torch.cat([qb, kb, vb]))
        full.out.load_state_dict(grouped.out.state_dict())
        x, mask = _inputs()
        torch.testing.assert_close(grouped(x, mask)[0], full(x, mask)[0], atol=1e-6, rtol=1e-5)
        B, T, _ = x.shape
        past_grouped, past_full = torch.zeros(B, kv, 0, hs), torch.zeros(B, h, 0, hs)  # the decoder's path: SDPA's GQA
        out_grouped, key, _ = grouped.forward_cached(x, cache_mask(mask, T), past_grouped, past_grouped)
        out_full, full_key, _ = full.forward_cached(x, cache_mask(mask, T), past_full, past_full)
        torch.testing.assert_close(out_grouped, out_full, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(key.repeat_interleave(group, dim=1), full_key)


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_the_cache_holds_kv_heads_and_the_projection_is_h_plus_two_kv_heads_wide(h, kv):
    layer = MultiHeadAttention(D_MODEL, h, kv_heads=kv, causal=True).eval()
    hs = D_MODEL // h
    assert layer.qkv.weight.shape == ((h + 2 * kv) * hs, D_MODEL)
    x, mask = _inputs(batch=2, seq=5)
    past = torch.randn(2, kv, 3, hs)
    full_mask = torch.cat([torch.ones(2, 3, dtype=torch.int64), mask], dim=1)  # (B, P + T)
    out, key, value = layer.forward_cached(x, cache_mask(full_mask, 5), past, past)
    assert out.shape == x.shape
    assert key.shape == value.shape == (2, kv, 8, hs)


@pytest.mark.parametrize(("h", "kv"), [(4, 3), (6, 4), (8, 5), (1, 2)])
def test_kv_heads_that_do_not_divide_heads_is_a_value_error_naming_both(h, kv):
    with pytest.raises(ValueError) as err:
        MultiHeadAttention(D_MODEL if D_MODEL % h == 0 else h * 4, h, kv_heads=kv)
    assert f"kv_heads={kv}" in str(err.value) and f"h={h}" in str(err.value)
    with pytest.raises(ValueError, match=f"kv_heads={kv}"):
        DecoderConfig(d_model=h * 8, heads=h, kv_heads=kv)


@pytest.mark.parametrize("kv", [0, -1, True, 2.0])
def test_kv_heads_below_one_or_not_an_integer_is_refused(kv):
    with pytest.raises(ValueError, match="kv_heads must be an integer >= 1"):
        MultiHeadAttention(D_MODEL, 4, kv_heads=kv)


def test_pruning_a_grouped_layer_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="kv_heads == h"):
        MultiHeadAttention(D_MODEL, 4, kv_heads=2).keep_heads([0, 1])


def _tiny(h: int, kv: int, seed: int = 0) -> DecoderLM:
    torch.manual_seed(seed)
    model = DecoderLM(DecoderConfig(d_model=D_MODEL, heads=h, kv_heads=kv, layers=2, max_len=40)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # init std 0.02 makes every logit nearly equal; spread them so greedy choices mean something
    return model


@pytest.mark.parametrize(("h", "kv"), HEAD_PAIRS)
def test_decoding_with_the_cache_gives_the_logits_of_the_whole_sequence(h, kv):
    model = _tiny(h, kv)
    ids = torch.randint(4, 260, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 12, dtype=torch.int64)
    with torch.no_grad():
        whole, _ = model(ids, mask, positions_from_mask(mask))  # (B, 12, V)
        logits, past = model(ids[:, :5], mask[:, :5], positions_from_mask(mask[:, :5]))  # prefill 5
        steps = [logits]
        for t in range(5, 12):
            step, past = model(ids[:, t : t + 1], mask[:, : t + 1], positions_from_mask(mask[:, : t + 1])[:, t:], past)
            steps.append(step)
    assert past[0][0].shape == (2, kv, 12, D_MODEL // h)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(("h", "kv"), [(4, 1), (4, 4)])
def test_a_left_padded_row_gives_the_logits_of_its_prompt_alone(h, kv):
    model = _tiny(h, kv)
    prompts = [[1, 40, 41, 42], [1, 50, 51, 52, 53, 54, 55, 56, 57]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = positions_from_mask(mask)
    assert positions[0].tolist() == [0] * 6 + [1, 2, 3]  # cumsum - 1, clipped at 0 on the padding
    with torch.no_grad():
        batched, _ = model(ids, mask, positions)
        for row, prompt in enumerate(prompts):
            alone = torch.tensor([prompt])
            want, _ = model(alone, torch.ones_like(alone), positions_from_mask(torch.ones_like(alone)))
            torch.testing.assert_close(batched[row, width - len(prompt) :], want[0], atol=1e-4, rtol=1e-5)
        assert torch.isfinite(batched).all()  # padding queries see themselves: no empty softmax row, no NaN


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(heads=4, kv_heads=1, d_model=64), "lm-h4-kv1-d64"),
        (dict(heads=8, kv_heads=2, d_model=512), "lm-h8-kv2-d512"),
        (dict(heads=4, d_model=64), "lm-h4-kv4-d64"),
        (dict(heads=3, kv_heads=1, d_model=64, head_dim=32), "lm-h3-kv1-d64-hd32"),
    ],
)
def test_the_name_carries_query_and_key_value_heads(kwargs, name):
    config = DecoderConfig(**kwargs)
    assert config.name == name
    assert config.metadata().name == name


def test_the_lm_head_is_tied_to_the_token_embedding():
    model = _tiny(4, 2)
    assert model.lm_head.weight is model.tok_emb.weight
    logits, present = model(torch.tensor([[1, 5, 6]]), torch.ones(1, 3, dtype=torch.int64), torch.arange(3)[None])
    assert logits.shape == (1, 3, 260)
    assert len(present) == 2
