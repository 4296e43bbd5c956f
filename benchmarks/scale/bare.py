"""Bare ONNX Runtime in this process on the run's backend, the reference of the served figures: a scan picks the
batch-1 p50's thread count and the batched rate's layout and batch size, then those are sides of the rounds."""

from __future__ import annotations

from pathlib import Path

from benchmarks.serving.bare import batched_rate, p50_ms
from benchmarks.serving.rounds import Side
from service.runtime import load_runtime

BATCHES = {"cpu": (8, 16, 32, 64), "gpu": (64, 256)}


def layouts(backend: str, cores: int) -> dict[str, tuple[int, int]]:
    """label -> (ORT threads per session, sessions side by side): on the CPU every core in one session, or a
    one-thread session per core (what N serving processes run under load); on the GPU one or two sessions."""
    if backend == "gpu":
        return {"1 session": (1, 1), "2 sessions": (1, 2)}
    out = {f"{cores} threads": (cores, 1)}
    if cores > 1:
        out[f"{cores} x 1 thread"] = (1, cores)
    return out


def runtimes(models_dir: Path, name: str, backend: str, layout: tuple[int, int]) -> list:
    threads, sessions = layout
    return [load_runtime(models_dir, name, backend, threads) for _ in range(sessions)]


def scan(models_dir: Path, name: str, backend: str, cores: int, seconds: float) -> dict:
    """The batch-1 p50 on one thread and on every core (`p50_threads`: the better), and the batched rate of each
    layout at each of BATCHES (`best_layout`, `best_batch`: the best); 1.5 x `seconds` in all."""
    out: dict = {}
    tried = (1, cores) if backend == "cpu" and cores > 1 else (1,)
    for threads in tried:
        out[f"p50_ms_t{threads}"] = p50_ms(load_runtime(models_dir, name, backend, threads), seconds / 4)
    out["p50_threads"] = min(tried, key=lambda t: out[f"p50_ms_t{t}"])
    found = {}
    for label, layout in layouts(backend, cores).items():
        sessions = runtimes(models_dir, name, backend, layout)
        for batch in BATCHES[backend]:
            found[(label, batch)] = out[f"rate_b{batch} ({label})"] = batched_rate(sessions, batch, seconds / 8)
    out["best_layout"], out["best_batch"] = max(found, key=found.__getitem__)
    return out


def sides(models_dir: Path, name: str, backend: str, cores: int, found: dict, prefix: str) -> dict[str, Side]:
    """`{prefix} c=1` (batch-1 p50 on the scan's thread count) and `{prefix} loaded` (the scan's best batched rate,
    measured again each round for as long as a level is: the scan's maximum is its luckiest sample)."""
    single = load_runtime(models_dir, name, backend, found["p50_threads"])
    best = runtimes(models_dir, name, backend, layouts(backend, cores)[found["best_layout"]])
    return {
        f"{prefix} c=1": (lambda seconds: {"p50_ms": p50_ms(single, seconds)}, None),
        f"{prefix} loaded": (lambda seconds: {"best_rate": batched_rate(best, found["best_batch"], seconds)}, None),
    }
