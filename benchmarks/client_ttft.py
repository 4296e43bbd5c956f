"""Time to first token as a client sees it against the server's own histogram: a fresh `mha-serving serve` with one
decoder (by default `make run`'s: h 4, kv 1, d_model 64, 2 layers), closed loops of streamed completions from a
raw-socket client (benchmarks/generate/client.py) at each concurrency, and the server's
`mha_time_to_first_token_seconds` observed meanwhile (the p50 interpolated in its buckets, as PromQL does).

    python -m benchmarks.client_ttft [--concurrency 1,8] [--requests 48] [--versus TREE]

The bar (issue 63): the client's TTFT p50 <= 1.3 x the server's + 2 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.generate import client
from benchmarks.generate.cli import add_decoder_options, ensure_decoder
from benchmarks.harness.server import ServerProcess
from loadtest.server_metrics import bucket_quantile, delta, fetch, parse_histogram

TTFT = "ray_mha_time_to_first_token_seconds"
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 64


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.client_ttft", description=__doc__.splitlines()[0])
    add_decoder_options(p)
    p.set_defaults(heads=4, kv_heads=1, d_model=64, layers=2, max_len=256)
    p.add_argument("--concurrency", type=lambda v: [int(c) for c in v.split(",")], default=[1, 8])
    p.add_argument("--requests", type=int, default=48, help="per concurrency level")
    p.add_argument("--versus", type=Path, help="another checkout's service measured instead (the tree before)")
    args = p.parse_args(argv)
    if args.requests < 1 or min(args.concurrency) < 1:
        p.error("--requests and --concurrency at least 1")
    return args


def server_p50_ms(metrics: httpx.Client, url: str, name: str, before, expected: int) -> float:
    """The p50 of the TTFTs observed since `before`, once the `expected` requests are exported (within 15 s)."""
    deadline = time.monotonic() + 15
    while True:
        buckets = delta(before, parse_histogram(fetch(metrics, url), TTFT), name)
        if buckets.get(float("inf"), 0) >= expected or time.monotonic() > deadline:
            return bucket_quantile(buckets, 0.5) * 1000
        time.sleep(0.5)


def level(port: int, url: str, name: str, c: int, requests: int, metrics: httpx.Client) -> dict:
    rng = np.random.default_rng(c)
    bodies = [[client.completion_body(name, rng.integers(32, 127, PROMPT_TOKENS), OUTPUT_TOKENS)] * (requests // c)]
    bodies = bodies * c
    before = parse_histogram(fetch(metrics, url), TTFT)
    timed = [t for mine in asyncio.run(_loops(port, bodies)) for t in mine]
    ttft = [(t.token_times[0] - t.sent) * 1000 for t in timed if t.token_times and not t.error]
    server = server_p50_ms(metrics, url, name, before, len(timed))
    return {"c": c, "client_ms": statistics.median(ttft), "server_ms": server, "errors": len(timed) - len(ttft)}


async def _loops(port: int, bodies: list[list[bytes]]):
    return await asyncio.gather(*(client.closed_loop(port, mine) for mine in bodies))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # the histogram exported every second
    name = ensure_decoder(args)
    config = {"models_dir": str(args.models.resolve()), "models": [name], "backend": "cpu"}
    results = []
    with ServerProcess(config, tree=args.versus) as server, httpx.Client(timeout=10) as metrics:
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        level(server.port, url, name, 1, 4, metrics)  # warm
        for c in args.concurrency:
            results.append(level(server.port, url, name, c, args.requests, metrics))
    print(f"{name}: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens, {args.requests} requests a level")
    print("| c | client TTFT p50 ms | server TTFT p50 ms | client / server | bar: 1.3 x server + 2 ms | errors |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    met = True
    for r in results:
        bar = 1.3 * r["server_ms"] + 2
        met &= r["client_ms"] <= bar and not r["errors"]
        ratio = r["client_ms"] / r["server_ms"]
        print(f"| {r['c']} | {r['client_ms']:.2f} | {r['server_ms']:.2f} | {ratio:.2f} | {bar:.2f} | {r['errors']} |")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
