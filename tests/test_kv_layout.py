"""The KV layout benchmark's agreement check at a tiny size: concatenation (Attention-23 with past, or separate
Concat nodes) and the in-place buffer (TensorScatter + Attention-24, lengths by nonpad_kv_seqlen or by mask) give the
same attention output and leave the same cache. The timings run by hand (`python -m benchmarks.kv_layout`)."""

from __future__ import annotations

import pytest

from benchmarks.kv_layout import LENGTHS, Case, agreement


@pytest.mark.parametrize("kv_heads", [8, 1])
def test_in_place_buffer_agrees_with_concat(kv_heads):
    check = agreement(Case(batch=2, window=5, capacity=64, kv_heads=kv_heads))
    assert set(check.y) == set(check.cache) == {"concat nodes", *LENGTHS}
    for variant, diff in check.y.items():
        assert diff <= 1e-5, f"{variant}: max |y - y_concat| = {diff}"
    for variant, diff in check.cache.items():
        assert diff <= 1e-5, f"{variant}: max |cache[:, :, :W + 1] - present| = {diff}"
