"""`python -m benchmarks.prefill_chunk`: what `generate.prefill_chunk` buys. One decoder served by one service per
value, in alternating rounds; on each, at once: `--streams` closed loops of short prompts (32 tokens) with long
outputs, and `--arrivals` closed loops of long prompts (`--long-prompt` tokens) with a few output tokens each, whose
prefills interrupt the streams. Per value: the streams' inter-token latency p50, p99 and largest (how long a running
stream waits while a prompt runs), the long prompts' time to first token, and every token's throughput.

    python -m benchmarks.prefill_chunk [--chunks 64,128,256,512 --streams 16 --arrivals 2 --rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from benchmarks.generate import client
from benchmarks.generate.cli import add_decoder_options, ensure_decoder, prompts
from benchmarks.generate.figures import figures
from benchmarks.generate.report import markdown, run
from benchmarks.harness.server import ServerProcess
from benchmarks.serving.rounds import Side, rounds
from service.generate.session import load_decoder

SHORT_PROMPT = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_chunk", description=__doc__.splitlines()[0])
    add_decoder_options(p)
    p.add_argument("--chunks", type=lambda v: [int(x) for x in v.split(",")], default=[64, 128, 256, 512])
    p.add_argument("--streams", type=int, default=16, help="closed loops of short prompts, long outputs")
    p.add_argument("--stream-tokens", type=int, default=128, help="each stream's output tokens")
    p.add_argument("--arrivals", type=int, default=2, help="closed loops of long prompts")
    p.add_argument("--long-prompt", type=int, default=448, help="their prompt tokens")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    if min(args.chunks) < 1 or min(args.streams, args.stream_tokens, args.arrivals, args.rounds) < 1:
        p.error("--chunks, --streams, --stream-tokens, --arrivals and --rounds must be at least 1")
    if args.long_prompt + 8 > args.max_len or SHORT_PROMPT + args.stream_tokens > args.max_len:
        p.error(f"--long-prompt + 8 and {SHORT_PROMPT} + --stream-tokens must fit the context ({args.max_len})")
    return args


async def _both(port: int, streams: list[list[bytes]], arrivals: list[list[bytes]]) -> tuple[dict, dict]:
    """The streams, and the arrivals' loops sending long prompts until the streams end; each group's figures."""
    start = time.perf_counter()
    done = asyncio.Event()

    async def arriving(body: bytes) -> list:
        out = []
        while not done.is_set():
            out += await client.closed_loop(port, [body])
        return out

    later = [asyncio.ensure_future(arriving(bodies[0])) for bodies in arrivals]
    streamed = await asyncio.gather(*(client.closed_loop(port, bodies) for bodies in streams))
    seconds = time.perf_counter() - start
    done.set()
    arrived = await asyncio.gather(*later)
    return figures([t for s in streamed for t in s], seconds), figures([t for a in arrived for t in a], seconds)


def side(args: argparse.Namespace, server: ServerProcess, name: str, given: dict, new: int) -> Side:
    streams = [[client.completion_body(name, row, new)] for row in given[SHORT_PROMPT]]
    arrivals = [[client.completion_body(name, row, 8)] for row in given[args.long_prompt][: args.arrivals]]

    def measure(_seconds: float) -> dict:
        stream, arrival = asyncio.run(_both(server.port, streams, arrivals))
        out = {f"stream_{k}": v for k, v in stream.items()} | {f"long_{k}": v for k, v in arrival.items()}
        out["tokens_s"] = stream["tokens_s"] + arrival["tokens_s"]
        out["errors"] = stream["errors"] + arrival["errors"]
        return out

    return measure, server


def measure(args: argparse.Namespace) -> dict:
    name = ensure_decoder(args)
    meta = load_decoder(args.models, name, "cpu", 1).meta
    given = prompts(meta.vocab_size, [SHORT_PROMPT, args.long_prompt], max(args.streams, args.arrivals))
    given[SHORT_PROMPT] = given[SHORT_PROMPT][: args.streams]
    base = {"models_dir": str(args.models.resolve()), "models": [name]}
    with contextlib.ExitStack() as stack:
        servers = {}
        for c in args.chunks:
            config = {**base, "generate": {"threads": args.threads, "prefill_chunk": c}}
            servers[c] = stack.enter_context(ServerProcess(config))
        print(f"warm-up, then {args.rounds} rounds of prefill_chunk {args.chunks}...", flush=True)
        rounds({c: side(args, s, name, given, 4) for c, s in servers.items()}, 1, 0.0)
        got = rounds({c: side(args, s, name, given, args.stream_tokens) for c, s in servers.items()}, args.rounds, 0)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {"model": name, "settings": settings, "chunks": {str(c): got[c] for c in args.chunks}}


def table(result: dict) -> str:
    s = result["settings"]
    heading = (
        f"{result['model']}: {s['streams']} streams of {SHORT_PROMPT}-token prompts and {s['stream_tokens']} tokens "
        f"beside {s['arrivals']} closed loops of {s['long_prompt']}-token prompts, {s['rounds']} rounds (medians)"
    )
    headers = ["prefill_chunk", "stream ITL p50 ms", "stream ITL p99 ms", "stream ITL max ms", "stream TTFT p50 ms"]
    headers += ["long prompt TTFT p50 ms", "long prompts", "tokens/s", "errors"]
    keys = ["stream_itl_p50_ms", "stream_itl_p99_ms", "stream_itl_max_ms", "stream_ttft_p50_ms", "long_ttft_p50_ms"]
    rows = [
        [chunk, *(f"{d[k]:.1f}" for k in keys), f"{d['long_requests']:.0f}", f"{d['tokens_s']:.0f}", str(d["errors"])]
        for chunk, d in result["chunks"].items()
    ]
    return markdown(heading, headers, rows)


def main(argv: list[str] | None = None) -> int:
    return run(argv, parse_args, measure, table)


if __name__ == "__main__":
    sys.exit(main())
