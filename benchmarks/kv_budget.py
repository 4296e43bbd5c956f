"""The KV budget against the memory the serving process really holds: a fresh `mha-serving serve` per round with one
decoder (d_model 512, h 8, kv 8, 4 layers, context 320) and `generate.kv_cache_mb`; one streamed request of 256 prompt
+ 64 output tokens beside 31 of 8 + 16, all at once (the padded batch's worst case); the ingress replica's RSS sampled
every 5 ms against its idle level, and the engine's `mha_kv_cache_bytes` gauge scraped meanwhile.

    python -m benchmarks.kv_budget [--rounds 3] [--kv-cache-mb 64] [--models runs/bench-models]

The bar (issue 63): RSS growth <= 1.25 x the budget + 24 MiB, kv_cache_bytes <= the budget.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.generate import client
from benchmarks.generate.cli import add_decoder_options, ensure_decoder
from benchmarks.harness.processes import memory_kib
from benchmarks.harness.server import ServerProcess

MIB = 2**20
LONG, SHORT = (256, 64), (8, 16)  # prompt, output tokens
SHORTS = 31
SAMPLE_S = 0.005
GAUGE = re.compile(rb"^ray_mha_kv_cache_bytes\{[^}]*\} ([0-9.e+]+)$", re.M)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_budget", description=__doc__.splitlines()[0])
    add_decoder_options(p)
    p.set_defaults(max_len=320)
    p.add_argument("--rounds", type=int, default=3, help="each on a fresh server")
    p.add_argument("--kv-cache-mb", type=float, default=64.0)
    p.add_argument("--versus", type=Path, help="another checkout's service measured instead (the tree before)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.kv_cache_mb <= 0 or args.max_len < sum(LONG):
        p.error(f"--rounds >= 1, --kv-cache-mb > 0 and --max-len >= {sum(LONG)}")
    return args


class Sampler:
    """The peak of a process's RSS and of the kv_cache_bytes gauge while it runs (a thread of its own)."""

    def __init__(self, pid: int, metrics_port: int) -> None:
        self._pid, self._metrics = pid, f"http://127.0.0.1:{metrics_port}/metrics"
        self.rss_kib = self.gauge = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._rss), threading.Thread(target=self._gauge)]

    def __enter__(self) -> Sampler:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(3.0)  # the gauge of the last steps: set every second, exported by Ray a moment later
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _rss(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.rss_kib = max(self.rss_kib, memory_kib(self._pid, "Rss"))

    def _gauge(self) -> None:
        while not self._stop.wait(0.25):
            with urllib.request.urlopen(self._metrics, timeout=5) as answer:
                values = [float(v) for v in GAUGE.findall(answer.read())]
            self.gauge = max([self.gauge, *values])


def one_round(args: argparse.Namespace, name: str) -> dict:
    config = {"models_dir": str(args.models.resolve()), "models": [name], "backend": "cpu"}
    config["generate"] = {"kv_cache_mb": args.kv_cache_mb}
    rng = np.random.default_rng(63)
    long = client.completion_body(name, rng.integers(32, 127, LONG[0]), LONG[1])
    short = [client.completion_body(name, rng.integers(32, 127, SHORT[0]), SHORT[1]) for _ in range(SHORTS)]
    with ServerProcess(config, tree=args.versus) as server:
        pid = server.replica_pid("ingress")
        time.sleep(2.0)  # settled after start
        idle = memory_kib(pid, "Rss")
        with Sampler(pid, server.metrics_port) as sampler:
            start = time.perf_counter()
            timed = asyncio.run(_all(server.port, [long, *short]))
            seconds = time.perf_counter() - start
    errors = [t.error for t in timed if t.error]
    return {
        "growth_mib": (sampler.rss_kib - idle) / 1024,
        "gauge_mib": sampler.gauge / MIB,
        "seconds": seconds,
        "errors": len(errors),
    }


async def _all(port: int, bodies: list[bytes]) -> list[client.Timed]:
    done = await asyncio.gather(*(client.closed_loop(port, [body]) for body in bodies))
    return [t for mine in done for t in mine]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # the gauge exported every second
    name = ensure_decoder(args)
    bar = 1.25 * args.kv_cache_mb + 24
    workload = f"1 x {LONG[0]}+{LONG[1]} beside {SHORTS} x {SHORT[0]}+{SHORT[1]} tokens"
    print(f"{name}: {workload}, kv_cache_mb {args.kv_cache_mb:g}")
    print("| round | RSS growth MiB | max kv_cache_bytes MiB | seconds | errors |\n| --- | --- | --- | --- | --- |")
    results = []
    for i in range(args.rounds):
        r = one_round(args, name)
        results.append(r)
        print(f"| {i + 1} | {r['growth_mib']:.0f} | {r['gauge_mib']:.1f} | {r['seconds']:.2f} | {r['errors']} |")
    growth = [r["growth_mib"] for r in results]
    print(
        f"RSS growth median {statistics.median(growth):.0f} MiB (range {min(growth):.0f}-{max(growth):.0f}) against "
        f"the bar {bar:.0f} MiB (1.25 x {args.kv_cache_mb:g} + 24); kv_cache_bytes at most "
        f"{max(r['gauge_mib'] for r in results):.1f} MiB against {args.kv_cache_mb:g}"
    )
    return 0 if max(growth) <= bar and all(r["errors"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
