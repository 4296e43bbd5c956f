"""`python -m benchmarks.served_decoders`: decoders served side by side by one service, in alternating rounds (one
decoder measured at a time): closed loops of c streamed OpenAI completions of P-token prompts and N output tokens.
Per decoder: its kv heads, KV bytes a token, the sequences of P + N tokens its KV budget holds (the service's
`generate.kv_cache_mb`, the same for all), its quality (validation loss from training.json; a variant's perplexity
against its fp32 source, from its gate), output tokens/s, TTFT, TPOT and ITL p50, and tokens/s over the first
decoder's (medians of the rounds' own ratios). Two sets are ready-made (issue 59, items 4 and 5):

    python -m benchmarks.served_decoders kv-heads   # lm-h8-kv{8,4,2,1}-d512 trained on docs-lm with one budget
    python -m benchmarks.served_decoders int8       # the trained lm-h8-kv8-d512 and its int8 variant

Missing decoders are trained (`mha-serving train`, TRAINING's budget) or quantized (`mha-serving quantize`) first.
`--names a,b --models DIR` serves any decoders already exported there. `--lm-eval` then scores each through the same
service with lm-evaluation-harness (benchmarks/served_quality.py: the docs-lm perplexity and multiple-choice tasks),
so quality and cost sit on one table from one running service.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks import served_quality
from benchmarks.generate import client
from benchmarks.generate.cli import prompts
from benchmarks.generate.report import markdown, run
from benchmarks.harness.server import ServerProcess
from benchmarks.serving.rounds import Side, paired, rounds
from contract.decoder_metadata import DecoderMetadata
from contract.metadata import MODEL_FILE, TRAINING_FILE
from service.generate.session import load_decoder
from service.generate.settings import GenerationSettings

# One budget for every kv_heads: 240 AdamW steps of 8 windows of 320 tokens (a 256-token prompt and 64 new tokens fit
# the context). About 10 minutes a decoder on 2 cores.
TRAINING = {"heads": 8, "d_model": 512, "layers": 4, "max_len": 320, "steps": 240, "batch_size": 8, "lr": 1e-3}
SETS = {
    "kv-heads": [f"lm-h8-kv{kv}-d512" for kv in (8, 4, 2, 1)],
    "int8": ["lm-h8-kv8-d512", "lm-h8-kv8-d512-int8"],
}
WARMUP_TOKENS = 4
QUALITY_TASKS = "docs_lm_perplexity,docs_lm_choice"  # --lm-eval's: the continuation's exact match says little here


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.served_decoders", description=__doc__.splitlines()[0])
    p.add_argument("set", nargs="?", choices=sorted(SETS), help="a ready-made set of decoders (or --names)")
    p.add_argument("--names", type=lambda v: v.split(","), help="comma-separated decoder folders in --models")
    p.add_argument("--models", type=Path, default=Path("runs/kv-heads/models"), help="where the decoders live")
    p.add_argument("--concurrency", type=int, default=32, help="closed-loop clients (default %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="(default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=64, help="(default %(default)s)")
    p.add_argument("--requests", type=int, default=2, help="per client per measurement (default %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="(default %(default)s)")
    p.add_argument("--kv-cache-mb", type=float, default=GenerationSettings.kv_cache_mb, help="the service's KV budget")
    p.add_argument("--threads", type=int, default=2, help="the service's ORT intra-op threads (default %(default)s)")
    p.add_argument("--lm-eval", action="store_true", help="then score each decoder through the service (lm-eval)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    if (args.set is None) == (args.names is None):
        p.error("name a set (kv-heads or int8) or give --names, not both")
    args.names = args.names or SETS[args.set]
    if min(args.concurrency, args.prompt_tokens, args.output_tokens, args.requests, args.rounds) < 1:
        p.error("--concurrency, --prompt-tokens, --output-tokens, --requests and --rounds must be at least 1")
    return args


def ensure(models: Path, name: str) -> None:
    """`name` in `models`: trained with TRAINING's budget (an lm-h8-kv*-d512) or quantized from its fp32 source
    (a `-int8` name) when missing; anything else must be there already."""
    if (models / name / MODEL_FILE).is_file():
        return
    cli = [sys.executable, "-m", "service.cli"]
    if name.endswith("-int8"):
        ensure(models, name.removesuffix("-int8"))
        cmd = [*cli, "quantize", "--model", str(models / name.removesuffix("-int8"))]
    elif name in SETS["kv-heads"]:
        kv = name.split("-kv")[1].split("-")[0]
        cmd = [*cli, "train", "--task", "docs-lm", "--kv-heads", kv, "--out", str(models)]
        cmd += [arg for key, value in TRAINING.items() for arg in (f"--{key.replace('_', '-')}", str(value))]
    else:
        raise SystemExit(f"served_decoders: {models / name} has no {MODEL_FILE}; export it first")
    print(f"making {name}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True)


def quality(folder: Path, meta: DecoderMetadata) -> str:
    """A variant's gate (its perplexity over its fp32 source's), or an fp32 decoder's validation loss."""
    gate = meta.quantization.get("gate") if meta.quantized_from else None
    if isinstance(gate, dict) and gate.get("fp32_perplexity"):
        return f"perplexity x{gate['perplexity'] / gate['fp32_perplexity']:.3f} of fp32's"
    path = folder / TRAINING_FILE
    if meta.precision == "fp32" and path.is_file():
        return f"val loss {json.loads(path.read_text())['val_loss']:.3f}"
    return "untrained" if not meta.task else "-"


def describe(args: argparse.Namespace, name: str) -> dict:
    meta = load_decoder(args.models, name, "cpu", 1).meta
    held = GenerationSettings(kv_cache_mb=args.kv_cache_mb).rows_held(meta, args.prompt_tokens + args.output_tokens)
    return {
        "kv_heads": meta.kv_heads,
        "kv_bytes_per_token": meta.kv_bytes_per_token,
        "sequences_in_budget": held,
        "quality": quality(args.models / name, meta),
        "vocab_size": meta.vocab_size,
        "context": meta.max_len,
    }


def sides(server: ServerProcess, names: list[str], batch: np.ndarray, new: int, requests: int) -> dict[str, Side]:
    """Each decoder a side of the rounds: `requests` completions of each row of `batch` (c, P), c loops at once."""
    return {
        name: (lambda _seconds, name=name: client.served(server.port, name, batch, new, requests), server)
        for name in names
    }


def measure(args: argparse.Namespace) -> dict:
    for name in args.names:
        ensure(args.models, name)
    about = {name: describe(args, name) for name in args.names}
    given = prompts(min(a["vocab_size"] for a in about.values()), [args.prompt_tokens], args.concurrency)
    batch = given[args.prompt_tokens]  # (c, P)
    generate = {"threads": args.threads, "kv_cache_mb": args.kv_cache_mb}
    config = {"models_dir": str(args.models.resolve()), "models": args.names, "generate": generate}
    with ServerProcess(config) as server:
        print(f"warm-up, then {args.rounds} rounds of {', '.join(args.names)}...", flush=True)
        rounds(sides(server, args.names, batch, WARMUP_TOKENS, args.requests), 1, 0.0)
        got = rounds(sides(server, args.names, batch, args.output_tokens, args.requests), args.rounds, 0.0)
        for name in args.names if args.lm_eval else ():
            print(f"lm-eval through the service: {name}...", flush=True)
            url, folder = f"http://127.0.0.1:{server.port}", args.models.resolve() / name
            results = served_quality.evaluate(url, name, folder, about[name]["context"], QUALITY_TASKS)
            got[name]["lm_eval"] = served_quality.scores(results)
    first = args.names[0]
    for name in args.names:
        ratios = paired(got[name], got[first], "tokens_s", "tokens_s", lambda a, b: a / b if b > 0 else math.nan)
        got[name]["over_first"] = statistics.median(ratios)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"settings": settings, "decoders": {n: {**about[n], **got[n]} for n in args.names}}


def table(result: dict) -> str:
    s = result["settings"]
    heading = (
        f"c={s['concurrency']}, {s['prompt_tokens']}-token prompts, {s['output_tokens']} output tokens, KV budget "
        f"{s['kv_cache_mb']:g} MiB, {s['rounds']} rounds (medians)"
    )
    headers = ["decoder", "kv heads", "KV bytes/token", "sequences in budget", "quality", "output tokens/s"]
    headers += ["TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms", f"tokens/s / {s['names'][0]}", "errors"]
    scored = s.get("lm_eval", False)
    headers += ["bits/byte (lm-eval)", "choice acc (lm-eval)"] if scored else []
    rows = []
    for name, d in result["decoders"].items():
        about = [str(d["kv_heads"]), f"{d['kv_bytes_per_token']:,}", str(d["sequences_in_budget"]), d["quality"]]
        served = [f"{d['tokens_s']:.0f}", f"{d['ttft_p50_ms']:.1f}", f"{d['tpot_p50_ms']:.2f}"]
        row = [name, *about, *served, f"{d['itl_p50_ms']:.2f}", f"{d['over_first']:.2f}", str(d["errors"])]
        if scored:
            got = d.get("lm_eval", {})
            bpb, acc = got.get("docs_lm_perplexity.bits_per_byte"), got.get("docs_lm_choice.acc")
            row += [f"{bpb:.3f}" if bpb is not None else "-", f"{acc:.3f}" if acc is not None else "-"]
        rows.append(row)
    return markdown(heading, headers, rows)


def main(argv: list[str] | None = None) -> int:
    return run(argv, parse_args, measure, table)


if __name__ == "__main__":
    sys.exit(main())
