"""benchmarks.prefill_chunk end to end on a tiny decoder: one service per prefill_chunk value, each serving its
streams and its long prompts side by side in every round, every stream token counted. The real run is `python -m
benchmarks.prefill_chunk` on a quiet machine."""

from __future__ import annotations

import json

import pytest

from benchmarks import prefill_chunk
from tests.conftest import export_tiny_decoder

pytestmark = [pytest.mark.serve, pytest.mark.slow]
STREAMS, TOKENS, CHUNKS = 2, 8, (4, 64)


def test_each_chunk_value_serves_its_streams_and_long_prompts_and_reports_the_streams_stalls(tmp_path, capsys):
    export_tiny_decoder(tmp_path, kv_heads=4, max_len=64, seed=3)
    path = tmp_path / "chunks.json"
    argv = ["--models", str(tmp_path), "--d-model", "32", "--heads", "4", "--kv-heads", "4", "--layers", "2"]
    argv += ["--max-len", "64", "--chunks", ",".join(map(str, CHUNKS)), "--streams", str(STREAMS)]
    argv += ["--stream-tokens", str(TOKENS), "--arrivals", "1", "--long-prompt", "40", "--rounds", "1"]
    assert prefill_chunk.main([*argv, "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    chunks = json.loads(path.read_text())["chunks"]
    assert sorted(chunks) == sorted(map(str, CHUNKS))
    for chunk, got in chunks.items():
        assert got["errors"] == 0 and got["stream_tokens"] == STREAMS * TOKENS, chunk
        assert got["long_requests"] >= 1 and got["stream_itl_max_ms"] >= got["stream_itl_p99_ms"] > 0, chunk
        assert f"| {chunk} | {got['stream_itl_p50_ms']:.1f} |" in printed


def test_a_long_prompt_past_the_context_is_one_usage_error(capsys):
    with pytest.raises(SystemExit) as stopped:
        prefill_chunk.parse_args(["--max-len", "128", "--long-prompt", "200"])
    assert stopped.value.code == 2 and "must fit the context (128)" in capsys.readouterr().err
