"""benchmarks.served_decoders end to end on two tiny decoders (MHA and MQA) served by one service: every requested
token of every decoder comes back in every round, the sequences a KV budget holds follow from each decoder's own KV
bytes a token, and the ratios are the run's own round-by-round figures. The real runs are `python -m
benchmarks.served_decoders kv-heads` and `... int8` on a quiet machine."""

from __future__ import annotations

import json
import math
import mmap
import statistics

import pytest

from benchmarks import served_decoders
from service.generate.session import load_decoder
from service.generate.settings import MIB
from tests.conftest import export_tiny_decoder

pytestmark = [pytest.mark.serve, pytest.mark.slow]
C, PROMPT, NEW, ROUNDS, KV_MB = 2, 8, 4, 2, 0.25


def test_each_decoder_is_served_in_every_round_and_its_kv_budget_is_priced_by_its_own_kv_heads(tmp_path, capsys):
    names = []
    for kv_heads in (4, 1):
        export_tiny_decoder(tmp_path, kv_heads=kv_heads, max_len=64, seed=kv_heads)
        names.append(f"lm-h4-kv{kv_heads}-d32")
    path = tmp_path / "decoders.json"
    argv = ["--names", ",".join(names), "--models", str(tmp_path), "--concurrency", str(C), "--requests", "1"]
    argv += ["--prompt-tokens", str(PROMPT), "--output-tokens", str(NEW), "--rounds", str(ROUNDS)]
    assert served_decoders.main([*argv, "--kv-cache-mb", str(KV_MB), "--json", str(path)]) == 0
    printed = capsys.readouterr().out
    decoders = json.loads(path.read_text())["decoders"]
    first = decoders[names[0]]["rounds"]
    for name in names:
        got = decoders[name]
        meta = load_decoder(tmp_path, name, "cpu", 1).meta
        assert got["kv_heads"] == meta.kv_heads and got["kv_bytes_per_token"] == meta.kv_bytes_per_token
        # the cache written in place: one copy, each sequence's final length in whole pages of a head's tokens
        assert meta.cache_in_place
        block = mmap.PAGESIZE // math.gcd(mmap.PAGESIZE, meta.head_dim * 4)
        tokens = int(KV_MB * MIB // meta.kv_bytes_per_token)
        assert got["sequences_in_budget"] == tokens // (-(-(PROMPT + NEW) // block) * block)
        assert got["errors"] == 0 and got["quality"] == "untrained"
        assert [r["tokens"] for r in got["rounds"]] == [C * NEW] * ROUNDS
        per_round = [r["tokens_s"] / f["tokens_s"] for r, f in zip(got["rounds"], first, strict=True)]
        assert got["over_first"] == pytest.approx(statistics.median(per_round))
        assert f"| {name} | {meta.kv_heads} | {meta.kv_bytes_per_token:,} |" in printed
    assert decoders[names[1]]["sequences_in_budget"] >= 4 * decoders[names[0]]["sequences_in_budget"] - 1


def test_a_set_and_names_together_or_neither_is_one_usage_error(capsys):
    for argv in ([], ["kv-heads", "--names", "a"]):
        with pytest.raises(SystemExit) as stopped:
            served_decoders.parse_args(argv)
        assert stopped.value.code == 2
        assert "name a set (kv-heads or int8) or give --names" in capsys.readouterr().err


def test_with_lm_eval_the_table_puts_each_decoders_scores_beside_its_serving_figures():
    settings = {"concurrency": 2, "prompt_tokens": 8, "output_tokens": 4, "kv_cache_mb": 1, "rounds": 1}
    served = {"tokens_s": 10, "ttft_p50_ms": 1, "tpot_p50_ms": 1, "itl_p50_ms": 1, "over_first": 1, "errors": 0}
    about = {"kv_heads": 1, "kv_bytes_per_token": 64, "sequences_in_budget": 3, "quality": "val loss 1.000"}
    scored = {"docs_lm_perplexity.bits_per_byte": 2.4101, "docs_lm_choice.acc": 0.2727}
    decoders = {"a": about | served | {"lm_eval": scored}, "b": about | served}
    lines = served_decoders.table({"settings": settings | {"names": ["a", "b"], "lm_eval": True}, "decoders": decoders})
    rows = {
        line.split(" | ")[0].strip("| "): line
        for line in lines.splitlines()
        if line.startswith("| a") or line.startswith("| b")
    }
    assert (
        "bits/byte (lm-eval)" in lines and rows["a"].endswith("| 2.410 | 0.273 |") and rows["b"].endswith("| - | - |")
    )
