"""benchmarks.generation_engine on a tiny decoder: both modes measured at each concurrency, the ratio from the rounds'
own figures, the table and the JSON written."""

from __future__ import annotations

import json
import statistics

import torch

from benchmarks import generation_engine
from export import decoder_export
from export.decoder import DecoderConfig, DecoderLM


def test_a_tiny_run_measures_both_modes_at_each_concurrency_and_writes_its_figures(tmp_path, capsys):
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(d_model=32, heads=4, kv_heads=1, layers=1, max_len=64)).eval()
    decoder_export.export_decoder(model, model.config.metadata(), tmp_path)
    out = tmp_path / "engine.json"
    argv = ["--models", str(tmp_path), "--model", "lm-h4-kv1-d32", "--concurrency", "1,3", "--max-tokens", "6"]
    assert generation_engine.main([*argv, "--rounds", "2", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["backend"] == {"plain": "cpu", "bound": "cpu"}
    assert [r["concurrency"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert len(row["ratios"]) == 2 and row["plain_tokens_s"] > 0 and row["bound_tokens_s"] > 0
        assert row["bound_over_plain"] == statistics.median(row["ratios"])
    assert "| 3 |" in capsys.readouterr().out
