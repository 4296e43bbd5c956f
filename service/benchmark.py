"""`python -m service.benchmark`: the service against bare ONNX Runtime (and a plain FastAPI + ORT server), in one run.

Small model (d_model 128, h 4, 2 layers) and default (d_model 512, h 8, 4 layers), 32 tokens per request; prints
single-request p50 and concurrency-32 throughput with their ratios. Not a test: numbers are noisy on shared cores.
No torch (models are exported by a `mha-serving export` subprocess when missing).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from export.metadata import MODEL_FILE, config_name
from service.bench_client import LoadResult, load, post_bytes
from service.config import AppConfig
from service.runtime import load_runtime

MODELS = {"small": (128, 4, 2), "default": (512, 8, 4)}  # d_model, heads, layers
TOKENS = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_models(models_dir: Path) -> dict[str, str]:
    names = {}
    for label, (d_model, heads, layers) in MODELS.items():
        name = names[label] = config_name(heads, d_model)
        if not (models_dir / name / MODEL_FILE).is_file():
            cmd = [sys.executable, "-m", "service.cli", "export", "--heads", str(heads), "--d-model", str(d_model)]
            cmd += ["--layers", str(layers), "--out", str(models_dir)]
            print(f"exporting {name}: {' '.join(cmd[2:])}", flush=True)
            subprocess.run(cmd, check=True)
    return names


def request_bodies(n: int, batch: int = 1, seed: int = 0) -> list[bytes]:
    """n different v2 JSON bodies of `batch` rows x TOKENS token ids."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(n):
        ids = rng.integers(4, 260, size=(batch, TOKENS))  # (B, T)
        tensor = {"name": "input_ids", "datatype": "INT64", "shape": [batch, TOKENS], "data": ids.ravel().tolist()}
        bodies.append(json.dumps({"inputs": [tensor]}).encode())
    return bodies


def bare_ort(models_dir: Path, name: str, seconds: float) -> dict[str, float]:
    """Batch-1 p50 (best of 1 and 2 threads) and the best batched throughput (2 threads), in this process."""
    rng = np.random.default_rng(1)
    out: dict[str, float] = {}
    for threads in (1, 2):
        rt = load_runtime(models_dir, name, "cpu", threads)
        ids = rng.integers(4, 260, size=(1, TOKENS))  # (1, T)
        mask = np.ones_like(ids)
        for _ in range(20):
            rt.run(ids, mask)
        times = []
        deadline = time.perf_counter() + seconds / 2
        while time.perf_counter() < deadline or len(times) < 20:
            start = time.perf_counter()
            rt.run(ids, mask)
            times.append(time.perf_counter() - start)
        out[f"p50_ms_t{threads}"] = float(np.median(times) * 1e3)
    out["p50_ms"] = min(out["p50_ms_t1"], out["p50_ms_t2"])
    rt = load_runtime(models_dir, name, "cpu", 2)
    for batch in (8, 16, 32, 64):
        ids = rng.integers(4, 260, size=(batch, TOKENS))  # (B, T)
        rt.run(ids, np.ones_like(ids))
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 4:
            rt.run(ids, np.ones_like(ids))
            count += batch
        out[f"rate_b{batch}"] = count / (time.perf_counter() - start)
    out["best_rate"] = max(v for k, v in out.items() if k.startswith("rate_b"))
    return out


def measure_http(port: int, path: str, seconds: float, concurrency: int) -> tuple[LoadResult, LoadResult]:
    requests = [post_bytes(path, b) for b in request_bodies(64)]
    load(port, requests, 4, 1.0)  # warm up
    single = load(port, requests, 1, seconds)
    loaded = load(port, requests, concurrency, seconds)
    return single, loaded


def wait_for_port(port: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout:g} s")


def plain_fastapi(models_dir: Path, name: str, args) -> tuple[LoadResult, LoadResult]:
    port = free_port()
    cmd = [sys.executable, "-m", "service.bench_baseline", "--models", str(models_dir), "--name", name]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--threads", "1"])
    try:
        wait_for_port(port)
        return measure_http(port, f"/v2/models/{name}/infer", args.seconds, args.concurrency)
    finally:
        proc.terminate()
        proc.wait(10)


def served(models_dir: Path, names: dict[str, str], args) -> dict[str, tuple[LoadResult, LoadResult]]:
    """The service as `mha-serving serve` starts it (direct ingress unless --proxy), measured over HTTP."""
    from service.launcher import LocalServe, shutdown, start_local

    settings: dict = {"num_cpus": 0.5, "max_batch_size": args.max_batch_size}
    settings.update(batch_wait_timeout_s=args.batch_wait, max_ongoing_requests=args.max_ongoing)
    # ORT threads as bare ORT measured best: 1 for the small model at batch 1, 2 (both cores) for the default one
    threads = {"small": args.threads or 1, "default": args.threads or 2}
    overrides = {name: {**settings, "intra_op_threads": threads[label]} for label, name in names.items()}
    config = AppConfig(
        models_dir=str(models_dir),
        models=sorted(names.values()),
        backend="cpu",
        deployment=settings,
        overrides=overrides,
    )
    opts = LocalServe(port=free_port(), metrics_port=None, direct=not args.proxy)
    try:
        start_local(config, opts)
        return {
            label: measure_http(opts.port, f"/v2/models/{name}/infer", args.seconds, args.concurrency)
            for label, name in names.items()
        }
    finally:
        shutdown()


def report(names, bare, plain, service, concurrency: int) -> dict:
    rows = []
    summary: dict = {}
    for label, name in names.items():
        single, loaded = service[label]
        b = bare[label]
        rows.append(
            f"{label:<8} {name:<12} bare ORT b1 p50 {b['p50_ms']:6.2f} ms | best batch {b['best_rate']:7.0f} seq/s | "
            f"service c=1 p50 {single.percentile_ms(50):6.2f} ms | c={concurrency} {loaded.rate:7.0f} req/s "
            f"(p50 {loaded.percentile_ms(50):.1f} ms, p99 {loaded.percentile_ms(99):.1f} ms, {loaded.errors} errors)"
        )
        summary[label] = {
            "bare_p50_ms": b["p50_ms"],
            "bare_best_rate": b["best_rate"],
            "service_c1_p50_ms": single.percentile_ms(50),
            "service_c32_rate": loaded.rate,
            "service_c32_errors": loaded.errors,
            "c1_p50_over_bare_ms": single.percentile_ms(50) - b["p50_ms"],
            "c32_rate_over_best_batched": loaded.rate / b["best_rate"],
        }
    if plain is not None:
        single, loaded = plain
        rows.append(
            f"plain FastAPI + ORT (small): c=1 p50 {single.percentile_ms(50):.2f} ms | c={concurrency} "
            f"{loaded.rate:.0f} req/s"
        )
        summary["plain_fastapi_small"] = {"c1_p50_ms": single.percentile_ms(50), "c32_rate": loaded.rate}
        summary["small"]["c32_rate_over_plain_fastapi"] = summary["small"]["service_c32_rate"] / loaded.rate
    print("\n".join(rows))
    s, d = summary["small"], summary["default"]
    print("\nratios (bar in brackets):")
    print(
        f"  default: c={concurrency} throughput / best in-process batched ORT = {d['c32_rate_over_best_batched']:.2f}"
        "  [>= 0.85]"
    )
    print(f"  small:   c=1 p50 - bare ORT p50 = {s['c1_p50_over_bare_ms']:+.2f} ms  [<= +2 ms]")
    if "c32_rate_over_plain_fastapi" in s:
        print(
            f"  small:   c={concurrency} throughput / plain FastAPI + ORT = {s['c32_rate_over_plain_fastapi']:.2f}"
            "  [>= 1.0]"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m service.benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the two models live")
    p.add_argument("--seconds", type=float, default=5.0, help="per measurement (default: 5)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--threads", type=int, help="ORT intra-op threads per replica (default: 1 small, 2 default)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--batch-wait", type=float, default=0.0, help="batch_wait_timeout_s (default: 0)")
    p.add_argument("--max-ongoing", type=int, default=64, help="max_ongoing_requests per replica")
    p.add_argument("--proxy", action="store_true", help="through Serve's proxy instead of direct ingress")
    p.add_argument("--skip-plain", action="store_true", help="skip the plain FastAPI + ORT reference server")
    p.add_argument("--json", type=Path, help="also write the summary here")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set before Ray starts (levers)")
    args = p.parse_args(argv)
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    names = ensure_models(args.models)
    print(f"measuring bare ORT ({TOKENS} tokens per sequence)...", flush=True)
    bare = {label: bare_ort(args.models, name, args.seconds) for label, name in names.items()}
    plain = None if args.skip_plain else plain_fastapi(args.models, names["small"], args)
    print("starting Ray Serve...", flush=True)
    service = served(args.models, names, args)
    summary = report(names, bare, plain, service, args.concurrency)
    summary["settings"] = {k: str(v) for k, v in vars(args).items()}
    summary["env"] = {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
