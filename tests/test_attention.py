"""The attention layer: shapes, errors, weights, SDPA versus the manual path, parity with nn.MultiheadAttention."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from export.attention import MultiHeadAttention

HEADS = [1, 2, 4, 8]
D_MODEL = 32


def _inputs(batch: int = 3, seq: int = 6, d_model: int = D_MODEL, seed: int = 0):
    """x (B, T, d_model) and a key padding mask (B, T), 1 = token: row i keeps seq - i tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, d_model, generator=g)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    for row in range(batch):
        mask[row, seq - row :] = 0
    return x, mask


@pytest.mark.parametrize("h", HEADS)
def test_output_keeps_the_input_shape_and_weights_are_per_head(h):
    layer = MultiHeadAttention(D_MODEL, h).eval()
    x, mask = _inputs()
    out, weights = layer(x, mask)
    assert out.shape == x.shape
    assert weights is None
    out_w, weights = layer(x, mask, need_weights=True)
    assert weights.shape == (3, h, 6, 6)
    assert layer.head_dim == D_MODEL // h
    torch.testing.assert_close(out_w, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("h", "head_dim"), [(3, 8), (5, 16), (8, 2)])
def test_explicit_head_dim_lets_h_times_head_dim_differ_from_d_model(h, head_dim):
    layer = MultiHeadAttention(D_MODEL, h, head_dim=head_dim).eval()
    assert layer.qkv.weight.shape == (3 * h * head_dim, D_MODEL)
    assert layer.out.weight.shape == (D_MODEL, h * head_dim)
    x, mask = _inputs()
    out, weights = layer(x, mask, need_weights=True)
    assert out.shape == x.shape
    assert weights.shape == (3, h, 6, 6)


@pytest.mark.parametrize(("d_model", "h"), [(30, 4), (512, 3), (10, 20)])
def test_indivisible_d_model_is_a_value_error_naming_both_numbers_and_head_dim(d_model, h):
    with pytest.raises(ValueError) as err:
        MultiHeadAttention(d_model, h)
    message = str(err.value)
    assert f"d_model={d_model}" in message
    assert f"h={h}" in message
    assert "head_dim" in message


@pytest.mark.parametrize("h", [0, -1, 2.0, True])
def test_head_count_below_one_or_not_an_integer_is_rejected(h):
    with pytest.raises(ValueError, match="heads"):
        MultiHeadAttention(D_MODEL, h)


@pytest.mark.parametrize("h", HEADS)
def test_weights_rows_sum_to_one_over_unmasked_keys_and_zero_on_padding(h):
    layer = MultiHeadAttention(D_MODEL, h).eval()
    x, mask = _inputs()
    _, weights = layer(x, mask, need_weights=True)  # (B, h, T, T)
    keys = mask.bool()[:, None, None, :].expand_as(weights)  # (B, h, T, T)
    assert torch.all(weights[~keys] == 0)
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(3, h, 6))


@pytest.mark.parametrize("h", HEADS)
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_path_equals_the_manual_path(h, causal):
    layer = MultiHeadAttention(D_MODEL, h, causal=causal).eval()
    x, mask = _inputs(seed=h)
    fast, _ = layer(x, mask)
    manual, _ = layer(x, mask, need_weights=True)
    torch.testing.assert_close(fast, manual, atol=1e-5, rtol=1e-5)
    fast, _ = layer(x, None)
    manual, _ = layer(x, None, need_weights=True)
    torch.testing.assert_close(fast, manual, atol=1e-5, rtol=1e-5)


def test_a_query_with_no_key_to_attend_gets_zero_weights_on_both_paths():
    layer = MultiHeadAttention(D_MODEL, 4).eval()
    x, mask = _inputs()
    mask[1] = 0  # a row that is all padding
    fast, _ = layer(x, mask)
    manual, weights = layer(x, mask, need_weights=True)
    assert torch.all(weights[1] == 0)
    assert torch.isfinite(manual).all()
    torch.testing.assert_close(fast, manual, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h", HEADS)
def test_equals_torch_multihead_attention_with_its_weights_copied_in(h):
    torch.manual_seed(h)
    reference = nn.MultiheadAttention(D_MODEL, h, batch_first=True).eval()
    with torch.no_grad():
        reference.in_proj_bias.normal_()  # torch initialises biases to zero: make them count
        reference.out_proj.bias.normal_()
    layer = MultiHeadAttention(D_MODEL, h).eval().load_from_torch(reference)
    x, mask = _inputs(batch=4, seq=7, seed=h)
    with torch.no_grad():
        want, want_weights = reference(
            x, x, x, key_padding_mask=~mask.bool(), need_weights=True, average_attn_weights=False
        )  # torch's convention: True = ignore this key
        got, got_weights = layer(x, mask, need_weights=True)
        fast, _ = layer(x, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_weights, want_weights, atol=1e-6, rtol=1e-5)


def test_from_torch_builds_an_equal_layer_and_mismatched_shapes_are_refused():
    torch.manual_seed(0)
    reference = nn.MultiheadAttention(D_MODEL, 4, batch_first=True).eval()
    layer = MultiHeadAttention.from_torch(reference).eval()
    x, mask = _inputs()
    with torch.no_grad():
        want, _ = reference(x, x, x, key_padding_mask=~mask.bool(), need_weights=True)
    torch.testing.assert_close(layer(x, mask)[0], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="num_heads=4"):
        MultiHeadAttention(D_MODEL, 2).load_from_torch(reference)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention(D_MODEL, 4).load_from_torch(nn.MultiheadAttention(D_MODEL, 4, add_bias_kv=True))


@pytest.mark.parametrize("h", HEADS)
def test_causal_mask_hides_later_tokens(h):
    layer = MultiHeadAttention(D_MODEL, h, causal=True).eval()
    x, _ = _inputs(batch=2, seq=8)
    changed = x.clone()
    changed[:, 5:] = torch.randn(2, 3, D_MODEL)
    with torch.no_grad():
        out, weights = layer(x, None, need_weights=True)
        out_changed, _ = layer(changed, None)
    torch.testing.assert_close(out_changed[:, :5], out[:, :5], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_changed[:, 5:], out[:, 5:])
    assert torch.all(weights.triu(diagonal=1) == 0)


@pytest.mark.parametrize(("h", "keep"), [(2, [1]), (4, [3, 0]), (8, [0, 2, 5, 6, 7])])
@pytest.mark.parametrize("causal", [False, True])
def test_a_layer_with_heads_kept_equals_the_full_layer_with_the_other_heads_gated_to_zero(h, keep, causal):
    torch.manual_seed(h)
    layer = MultiHeadAttention(D_MODEL, h, causal=causal).eval()
    nn.init.normal_(layer.qkv.bias)
    nn.init.normal_(layer.out.bias)
    smaller = layer.keep_heads(keep)
    assert (smaller.h, smaller.head_dim) == (len(keep), layer.head_dim)
    assert smaller.qkv.weight.shape == (3 * len(keep) * layer.head_dim, D_MODEL)
    assert smaller.out.weight.shape == (D_MODEL, len(keep) * layer.head_dim)
    x, mask = _inputs()
    layer.head_gate = torch.tensor([1.0 if i in keep else 0.0 for i in range(h)])
    with torch.no_grad():
        want, _ = layer(x, mask)
        got, _ = smaller(x, mask)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_a_per_example_gate_scales_each_rows_head_outputs_separately():
    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, 4).eval()
    x, mask = _inputs(batch=2)
    with torch.no_grad():
        layer.head_gate = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])  # (B, h)
        gated, _ = layer(x, mask)
        layer.head_gate = None
        full, _ = layer(x, mask)
    torch.testing.assert_close(gated[0], full[0])
    torch.testing.assert_close(gated[1], layer.out.bias.expand_as(gated[1]))  # every head off: the bias alone


@pytest.mark.parametrize("keep", [[], [0, 0], [4], [-1]])
def test_keeping_no_head_a_repeated_head_or_one_out_of_range_is_refused(keep):
    with pytest.raises(ValueError, match="distinct indices"):
        MultiHeadAttention(D_MODEL, 4).keep_heads(keep)
