"""benchmarks.generate end to end on a tiny decoder (`--quick`): the service, the service of `--versus` (this same
checkout), the bare loop, ONNX Runtime GenAI and the plain server each generate every requested token at c=1 and
c=2, the ratios are the medians of the run's own round-by-round figures, the bar's lines are printed with a verdict
computed from the values, and the JSON is written.
The real runs are `python -m benchmarks.generate` on a quiet machine."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.generate import cli, loops
from benchmarks.generate.report import SYSTEMS as NAMES
from benchmarks.harness.server import takes_grpc_port
from export import decoder_export
from export.decoder import DecoderConfig, DecoderLM
from service.generate.session import load_decoder

SYSTEMS = ("served", "before", "bare", "genai", "plain")  # before: --versus this same checkout
LEVELS, PROMPT, NEW, ROUNDS = (1, 2), 8, 8, 2


@pytest.mark.slow
@pytest.mark.serve
def test_every_system_generates_every_token_at_each_concurrency_and_the_report_is_the_runs_own(tmp_path, capsys):
    pytest.importorskip("onnxruntime_genai")
    torch.manual_seed(0)
    model = DecoderLM(DecoderConfig(d_model=32, heads=4, kv_heads=4, layers=2, max_len=256)).eval()
    decoder_export.export_decoder(model, model.config.metadata(), tmp_path)
    path = tmp_path / "generate.json"
    argv = ["--models", str(tmp_path), "--d-model", "32", "--heads", "4", "--kv-heads", "4", "--layers", "2"]
    argv += ["--versus", str(Path(__file__).resolve().parents[1])]
    assert cli.main([*argv, "--max-len", "256", "--quick", "--rounds", str(ROUNDS), "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(path.read_text())
    figures = result["figures"]
    for c in LEVELS:
        for system in SYSTEMS:
            got = figures[f"{system} p={PROMPT} c={c}"]
            assert got["errors"] == 0 and got["tokens"] == c * NEW, (system, c, got)
            assert len(got["rounds"]) == ROUNDS and got["tokens_s"] > 0 and got["ttft_p50_ms"] > 0, (system, c)
            assert f"| {PROMPT} | {c} | {NAMES[system]} |" in printed
    for row in result["rows"]:
        served = figures[f"served p={PROMPT} c={row['concurrency']}"]["rounds"]
        for system in ("before", "bare", "genai", "plain"):
            other = figures[f"{system} p={PROMPT} c={row['concurrency']}"]["rounds"]
            per_round = [s["tokens_s"] / o["tokens_s"] for s, o in zip(served, other, strict=True)]
            assert row["ratios"][system] == pytest.approx(statistics.median(per_round))
    alone = figures[f"served p={PROMPT} c=1"]["rounds"]
    scaled = [s["tokens_s"] / a["tokens_s"] for s, a in zip(served, alone, strict=True)]
    assert result["rows"][-1]["served_over_c1"] == pytest.approx(statistics.median(scaled))
    assert len(result["bars"]) == 4
    for bar in result["bars"]:
        assert not math.isnan(bar["value"]) and not math.isnan(bar["limit"])
        assert bar["met"] == (bar["value"] >= bar["limit"] if bar["op"] == ">=" else bar["value"] <= bar["limit"])
        assert f"- {bar['bar']}: " in printed and printed.count(bar["bar"]) == 1
        line = next(x for x in printed.splitlines() if x.startswith(f"- {bar['bar']}: "))
        assert line.endswith(": met" if bar["met"] else ": not met")
    bare_step = figures[f"bare p={PROMPT} c=1"]["tpot_p50_ms"]
    assert result["bars"][2]["limit"] == pytest.approx(1.25 * bare_step + 0.3)


@pytest.mark.slow
def test_the_bare_loop_with_its_cache_bound_to_the_session_makes_the_plain_loops_tokens(tmp_path):
    torch.manual_seed(1)
    model = DecoderLM(DecoderConfig(d_model=32, heads=4, kv_heads=2, layers=2, max_len=64)).eval()
    decoder_export.export_decoder(model, model.config.metadata(), tmp_path)
    runtime = load_decoder(tmp_path, "lm-h4-kv2-d32", "cpu", 1)
    prompts = np.random.default_rng(0).integers(32, 127, size=(3, 8))  # (B, T)
    plain = np.stack(list(loops.greedy_steps(runtime, prompts, 12, bound=False)))  # (new, B)
    bound = np.stack(list(loops.greedy_steps(runtime, prompts, 12, bound=True)))
    assert plain.shape == (12, 3) and (plain == bound).all()


def test_a_versus_checkout_serves_with_grpc_open_exactly_when_its_launcher_takes_the_flag(tmp_path):
    """Both sides of a comparison run the same servers: gRPC open on both, or on neither."""
    assert takes_grpc_port(None) and takes_grpc_port(Path(__file__).resolve().parents[1])
    (tmp_path / "service").mkdir()
    (tmp_path / "service" / "cli.py").write_text('parser.add_argument("--port")\n')
    assert not takes_grpc_port(tmp_path)
