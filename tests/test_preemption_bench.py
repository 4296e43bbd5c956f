"""benchmarks.preemption on a tiny decoder written in place: streams past what reserving their final length runs,
preempted and recomputed, every text the one it gets alone, and the JSON and the bar's line say so."""

from __future__ import annotations

import json

import pytest
from conftest import export_tiny_decoder

from benchmarks import preemption

pytestmark = pytest.mark.slow  # two runs of twelve streams: 20 s on 2 cores


def test_the_preemption_benchmark_runs_more_streams_than_reservation_with_the_same_texts(tmp_path, capsys):
    export_tiny_decoder(tmp_path, kv_heads=1, max_len=256, seed=5, d_model=64)  # head_dim 16: 64-token pages
    out = tmp_path / "preemption.json"
    argv = ["--models", str(tmp_path), "--heads", "4", "--kv-heads", "1", "--d-model", "64", "--max-len", "256"]
    argv += ["--streams", "12", "--prompt-tokens", "20", "--output-tokens", "150", "--kv-cache-tokens", "768"]
    assert preemption.main([*argv, "--threads", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["reservation_runs"] == 768 // 192  # 170 tokens: 3 pages of a head's 64 tokens
    assert got["same_text"] == 12 and got["preemptions"] > 0 and got["most_running"] >= 6
    assert "the bar (every text the same, >= 1.5 x reservation, preemptions > 0): met" in capsys.readouterr().out
