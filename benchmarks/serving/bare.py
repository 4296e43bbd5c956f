"""Bare ONNX Runtime in the benchmark's own process, the reference the served figures are set against: which thread
count, session layout and batch size do best (the scan), and those measured as sides of the rounds."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.serving.requests import TOKENS
from benchmarks.serving.rounds import Side
from service.runtime import load_runtime

# The in-process layouts the bar's batched rate is the best of: label -> (ORT threads per session, sessions running
# side by side). Two one-thread runs side by side are what the service runs under load on 2 cores.
BARE_LAYOUTS = {"2 threads": (2, 1), "2 x 1 thread": (1, 2)}


BARE_BATCHES = (8, 16, 32, 64)


def bare_scan(models_dir: Path, name: str, seconds: float) -> dict:
    """Which bare figures the rounds measure: the batch-1 p50 on 1 and 2 threads (the better one: `p50_threads`),
    and the batched rate of each layout of BARE_LAYOUTS at batch sizes 8-64 (the best: `best_layout`,
    `best_batch`), each a short sample of seconds / 4."""
    out: dict = {}
    for threads in (1, 2):
        out[f"p50_ms_t{threads}"] = p50_ms(load_runtime(models_dir, name, "cpu", threads), seconds / 2)
    out["p50_threads"] = 1 if out["p50_ms_t1"] <= out["p50_ms_t2"] else 2
    out["p50_ms"] = out[f"p50_ms_t{out['p50_threads']}"]
    scan = {}
    for layout in BARE_LAYOUTS:
        runtimes = bare_runtimes(models_dir, name, layout)
        for batch in BARE_BATCHES:
            scan[(layout, batch)] = out[f"rate_b{batch} ({layout})"] = batched_rate(runtimes, batch, seconds / 4)
    # The scan's maximum is biased upwards by this machine's noise (the luckiest of eight short samples): the best
    # layout and batch size are measured again in every round, for as long as a served model is.
    out["best_layout"], out["best_batch"] = max(scan, key=scan.__getitem__)
    out["best_rate"] = scan[(out["best_layout"], out["best_batch"])]
    return out


def bare_runtimes(models_dir: Path, name: str, layout: str) -> list:
    """The sessions of one of BARE_LAYOUTS, freshly opened."""
    threads, sessions = BARE_LAYOUTS[layout]
    return [load_runtime(models_dir, name, "cpu", threads) for _ in range(sessions)]


def batched_rate(runtimes: list, batch: int, seconds: float) -> float:
    """Sequences per second of back-to-back runs of `batch` x TOKENS tokens, one loop per open runtime, the loops
    side by side on threads of their own (ORT releases the GIL while it runs)."""
    ids = np.random.default_rng(batch).integers(4, 260, size=(batch, TOKENS))  # (B, T)
    mask = np.ones_like(ids)
    for rt in runtimes:
        rt.run(ids, mask)
    counts = [0] * len(runtimes)
    start = time.perf_counter()

    def loop(k: int) -> None:
        while time.perf_counter() - start < seconds:
            runtimes[k].run(ids, mask)
            counts[k] += batch

    loops = [threading.Thread(target=loop, args=(k,)) for k in range(len(runtimes))]
    for thread in loops:
        thread.start()
    for thread in loops:
        thread.join()
    return sum(counts) / (time.perf_counter() - start)


def call_times(run, ids: np.ndarray, mask: np.ndarray, seconds: float, warmup: int = 20) -> list[float]:
    """Seconds per call of back-to-back `run(ids, mask)` for `seconds` (at least 20 calls, after `warmup` more)."""
    for _ in range(warmup):
        run(ids, mask)
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 20:
        start = time.perf_counter()
        run(ids, mask)
        times.append(time.perf_counter() - start)
    return times


def p50_ms(runtime, seconds: float) -> float:
    """Median latency of back-to-back batch-1 runs of TOKENS tokens for `seconds` (at least 20, after 20 more)."""
    ids = np.random.default_rng(1).integers(4, 260, size=(1, TOKENS))  # (1, T)
    return float(np.median(call_times(runtime.run, ids, np.ones_like(ids), seconds)) * 1e3)


def bare_sides(models_dir: Path, name: str, scan: dict, prefix: str) -> dict[str, Side]:
    """Bare ORT in this process as two sides of the rounds, on sessions opened once: the batch-1 p50 on the scan's
    better thread count (`{prefix} c=1`) and the scan's best batched rate (`{prefix} loaded`)."""
    single = load_runtime(models_dir, name, "cpu", scan["p50_threads"])
    runtimes = bare_runtimes(models_dir, name, scan["best_layout"])
    return {
        f"{prefix} c=1": (lambda seconds: {"p50_ms": p50_ms(single, seconds)}, None),
        f"{prefix} loaded": (lambda seconds: {"best_rate": batched_rate(runtimes, scan["best_batch"], seconds)}, None),
    }
