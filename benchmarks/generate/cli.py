"""`python -m benchmarks.generate`: on one ONNX decoder, in alternating rounds, the generation throughput and latency
of (s) the service (`mha-serving serve`, streamed OpenAI completions), (a) a bare in-process greedy loop on a fixed
batch, (b) ONNX Runtime GenAI with one generator per request on threads, and (c) a plain FastAPI + ORT streaming
server generating each request alone; at each concurrency and prompt length. Prints a Markdown table with the
service's ratios to the others and the issue's bar (issue 59 item 2); --json writes every figure.

    python -m benchmarks.generate [--concurrency 1,4,16,32 --prompt-tokens 32,256 --output-tokens 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np

from benchmarks.generate import client, loops
from benchmarks.generate.plain_server import PlainGenerateServer
from benchmarks.generate.report import SYSTEMS, bars, label, rows, run, table
from benchmarks.harness.server import ServerProcess
from benchmarks.serving.rounds import Side, rounds
from contract.decoder_metadata import DecoderMetadata
from contract.metadata import MODEL_FILE, config_name
from service.generate.session import load_decoder
from service.generate.settings import kv_cache_mb_for

FULL = {"rounds": 3, "concurrency": [1, 4, 16, 32], "prompt_tokens": [32, 256], "output_tokens": 64, "requests": 2}
QUICK = {"rounds": 1, "concurrency": [1, 2], "prompt_tokens": [8], "output_tokens": 8, "requests": 1}
CHOICES = [s for s in SYSTEMS if s != "before"]  # `before` comes with --versus
WARMUP_TOKENS = 4  # every system's sessions, threads and connections used once at each level before the rounds


def _ints(value: str) -> list[int]:
    return [int(x) for x in value.split(",")]


def add_decoder_options(p: argparse.ArgumentParser) -> None:
    """The benchmarked decoder's folder and sizes (`ensure_decoder` exports it untrained if missing)."""
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the decoder lives")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512, help="the decoder's context (exported with it if missing)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.generate", description=__doc__.splitlines()[0])
    add_decoder_options(p)
    p.add_argument("--rounds", type=int, help=f"default {FULL['rounds']}")
    p.add_argument("--concurrency", type=_ints, help="comma-separated (default 1,4,16,32)")
    p.add_argument("--prompt-tokens", type=_ints, help="comma-separated prompt lengths (default 32,256)")
    p.add_argument("--output-tokens", type=int, help=f"per request, up to 256 (default {FULL['output_tokens']})")
    p.add_argument("--requests", type=int, help=f"per client (or batch) per measurement (default {FULL['requests']})")
    p.add_argument("--threads", type=int, default=2, help="ORT intra-op threads of the service, loop and plain server")
    p.add_argument("--backend", choices=("cpu", "gpu"), default="cpu", help="the service's, loop's and plain server's")
    p.add_argument("--systems", type=lambda v: v.split(","), default=CHOICES, help=",".join(CHOICES))
    p.add_argument("--versus", type=Path, help="another checkout: its service measured too (`before`), same config")
    p.add_argument(
        "--versus-models",
        type=Path,
        help="the models folder of --versus's service (default --models): the same decoder as that checkout exports it",
    )
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--quick", action="store_true", help="tiny defaults, for tests: c=1,2, 8 + 8 tokens, 1 round")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if unknown := set(args.systems) - set(CHOICES):
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {','.join(CHOICES)}")
    if not 1 <= args.output_tokens <= 256 or args.rounds < 1 or args.requests < 1 or min(args.concurrency) < 1:
        p.error("--output-tokens must be 1 to 256, --rounds, --requests and --concurrency at least 1")
    if max(args.prompt_tokens) + args.output_tokens > args.max_len:
        p.error(f"the longest prompt plus --output-tokens exceeds the decoder's context ({args.max_len})")
    return args


def ensure_decoder(args: argparse.Namespace) -> str:
    """The decoder of these sizes in --models, exported by `mha-serving export --decoder` (untrained) if missing."""
    name = config_name(args.heads, args.d_model, prefix="lm", kv_heads=args.kv_heads)
    if not (args.models / name / MODEL_FILE).is_file():
        cmd = [sys.executable, "-m", "service.cli", "export", "--decoder", "--heads", str(args.heads)]
        cmd += ["--kv-heads", str(args.kv_heads), "--d-model", str(args.d_model), "--layers", str(args.layers)]
        cmd += ["--max-len", str(args.max_len), "--out", str(args.models)]
        print(f"exporting {name}: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True)
    return name


def serve_config(args: argparse.Namespace, name: str, meta: DecoderMetadata, models: Path | None = None) -> dict:
    """`mha-serving serve`'s defaults, with a KV budget that runs every client's prompt + output tokens at once
    and every client in one decoding step; `models`: another folder than --models."""
    final = max(args.prompt_tokens) + args.output_tokens
    generate = {"threads": args.threads, "max_running": max(32, max(args.concurrency))}
    generate["kv_cache_mb"] = max(128.0, kv_cache_mb_for(meta, max(args.concurrency), final) * 1.1)
    models_dir = str((models or args.models).resolve())
    return {"models_dir": models_dir, "models": [name], "backend": args.backend, "generate": generate}


def prompts(vocab_size: int, lengths: list[int], rows: int) -> dict[int, np.ndarray]:
    """Per length, `rows` random prompts of token ids (rows, T), the same for every system: printable bytes, which
    every byte-level vocabulary holds."""
    rng = np.random.default_rng(59)
    return {n: rng.integers(32, min(127, vocab_size), size=(rows, n), dtype=np.int64) for n in lengths}


def sides(args, systems: dict, given: dict[int, np.ndarray], new: int, levels: list[int]) -> dict:
    """Every measurement as a side of the rounds (benchmarks.serving.rounds): one per system, prompt length and
    concurrency, the systems of one level next to each other, so that the ratios compare neighbours."""
    out: dict[str, Side] = {}
    for length, all_rows in given.items():
        for c in levels:
            batch = all_rows[:c]  # (c, T)
            for system, (measure, server) in systems.items():
                fn = partial(measure, batch, new, args.requests)
                out[label(system, length, c)] = (lambda _seconds, fn=fn: fn(), server)
    return out


def measure(args: argparse.Namespace) -> dict:
    name = ensure_decoder(args)
    runtime = load_decoder(args.models, name, args.backend, args.threads)
    given = prompts(runtime.meta.vocab_size, args.prompt_tokens, max(args.concurrency))
    meta = runtime.meta
    with contextlib.ExitStack() as stack:
        systems: dict[str, tuple] = {}
        if "served" in args.systems:
            server = stack.enter_context(ServerProcess(serve_config(args, name, meta)))
            systems["served"] = (partial(client.served, server.port, name), server)
        if args.versus is not None:
            theirs = load_decoder(args.versus_models, name).meta if args.versus_models else meta
            config = serve_config(args, name, theirs, args.versus_models)
            before = stack.enter_context(ServerProcess(config, tree=args.versus.resolve()))
            systems["before"] = (partial(client.served, before.port, name), before)
        if "bare" in args.systems:
            systems["bare"] = (partial(loops.bare_loop, runtime), None)
        if "genai" in args.systems:
            model = loops.genai_model(str(args.models / name))
            systems["genai"] = (partial(loops.genai, model), None)
        if "plain" in args.systems:
            plain = stack.enter_context(PlainGenerateServer(args.models, name, args.backend, args.threads))
            systems["plain"] = (partial(client.served, plain.port, name), plain)
        print(f"warm-up, then {args.rounds} rounds of {', '.join(systems)}...", flush=True)
        rounds(sides(args, systems, given, WARMUP_TOKENS, [max(args.concurrency)]), 1, 0.0)
        got = rounds(sides(args, systems, given, args.output_tokens, args.concurrency), args.rounds, 0.0)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "model": name,
        "backend": runtime.backend,
        "genai_backend": "cpu (this onnxruntime-genai build runs on the CPU only)",
        "settings": settings,
        "rows": rows(got, args.prompt_tokens, args.concurrency),
        "bars": bars(got, args.prompt_tokens, args.concurrency),
        "figures": got,
    }


def main(argv: list[str] | None = None) -> int:
    return run(argv, parse_args, measure, table)
