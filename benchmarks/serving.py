"""`python -m benchmarks.serving`: the service against bare ONNX Runtime and a plain FastAPI + ORT server, in one run.

Small model (d_model 128, h 4, 2 layers) and default (d_model 512, h 8, 4 layers), 32 tokens per request: c=1 p50
and c=32 throughput of each placement, the five default models served together, RSS and time to ready, the default
model's int8 variant against it (in process and served, file sizes, the five in both precisions), then the ratios
of the bar. Every server runs as a user starts it (`mha-serving serve` in a subprocess). Not a test: numbers
are noisy on shared cores; compare within a run. No torch (missing models are exported by a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import operator
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

from benchmarks.harness.polling import wait_for_http
from benchmarks.harness.processes import cpu_seconds, paused, py_spy, python_threads, thread_cpu
from benchmarks.harness.server import ServerProcess
from benchmarks.stage_profile import stage_shares, table
from contract.binary_tensors import HEADER_NAME
from contract.metadata import MODEL_FILE, config_name
from loadtest import grpc_client
from loadtest.http_client import LoadResult, load, post_bytes
from service.engine import ORT_THREADS
from service.local.ports import free_port
from service.runtime import SPINNING, load_runtime

MODELS = {"small": (128, 4, 2), "default": (512, 8, 4)}  # d_model, heads, layers
FIVE_HEADS = (1, 2, 4, 8, 16)  # the default head set (`make run`): d_model 512, 4 layers
TOKENS = 32


def ensure_model(
    models_dir: Path, heads: int, d_model: int, layers: int, max_len: int = 128, prefix: str = "mha"
) -> str:
    name = config_name(heads, d_model, prefix=prefix)
    if not (models_dir / name / MODEL_FILE).is_file():
        cmd = [sys.executable, "-m", "service.cli", "export", "--heads", str(heads), "--d-model", str(d_model)]
        cmd += ["--layers", str(layers), "--max-len", str(max_len), "--name-prefix", prefix, "--out", str(models_dir)]
        print(f"exporting {name}: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True)
    return name


def ensure_variant(models_dir: Path, name: str, precision: str = "int8") -> str:
    """The `precision` variant of model `name`, made by `mha-serving quantize` (its gate included) if missing."""
    variant = f"{name}-{precision}"
    if not (models_dir / variant / MODEL_FILE).is_file():
        cmd = [sys.executable, "-m", "service.cli", "quantize", "--model", str(models_dir / name)]
        print(f"making {variant}: {' '.join(cmd[2:])} --precision {precision}", flush=True)
        subprocess.run([*cmd, "--precision", precision], check=True)
    return variant


def request_ids(n: int, batch: int = 1, seed: int = 0, tokens: int = TOKENS) -> list[np.ndarray]:
    """n different (batch, tokens) token-id arrays: the same requests in every protocol."""
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 260, size=(batch, tokens)) for _ in range(n)]  # each (B, T)


def request_bodies(n: int, batch: int = 1, seed: int = 0, tokens: int = TOKENS) -> list[bytes]:
    """n different v2 JSON bodies of `batch` rows x `tokens` token ids."""
    bodies = []
    for ids in request_ids(n, batch, seed, tokens):
        tensor = {"name": "input_ids", "datatype": "INT64", "shape": list(ids.shape), "data": ids.ravel().tolist()}
        bodies.append(json.dumps({"inputs": [tensor]}).encode())
    return bodies


def binary_requests(path: str, n: int, batch: int = 1, tokens: int = TOKENS) -> list[bytes]:
    """The same requests in the binary tensor data extension, logits asked back binary (tritonclient's defaults)."""
    out = []
    for ids in request_ids(n, batch, tokens=tokens):
        raw = ids.astype("<i8").tobytes()
        tensor = {"name": "input_ids", "datatype": "INT64", "shape": list(ids.shape)}
        tensor["parameters"] = {"binary_data_size": len(raw)}
        header = json.dumps({"inputs": [tensor], "parameters": {"binary_data_output": True}}).encode()
        out.append(post_bytes(path, header + raw, {HEADER_NAME: str(len(header))}))
    return out


# The in-process layouts the bar's batched rate is the best of: label -> (ORT threads per session, sessions running
# side by side). Two one-thread runs side by side are what the service runs under load on 2 cores.
BARE_LAYOUTS = {"2 threads": (2, 1), "2 x 1 thread": (1, 2)}
BARE_BATCHES = (8, 16, 32, 64)
WARMUP_S = 0.5  # before every served measurement, not counted: connections, first batches, caches after a pause


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


def p50_ms(runtime, seconds: float) -> float:
    """Median latency of back-to-back batch-1 runs of TOKENS tokens for `seconds` (at least 20, after 20 more)."""
    ids = np.random.default_rng(1).integers(4, 260, size=(1, TOKENS))  # (1, T)
    mask = np.ones_like(ids)
    for _ in range(20):
        runtime.run(ids, mask)
    times = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 20:
        start = time.perf_counter()
        runtime.run(ids, mask)
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3)


def bare_sides(models_dir: Path, name: str, scan: dict, prefix: str) -> dict[str, Side]:
    """Bare ORT in this process as two sides of the rounds, on sessions opened once: the batch-1 p50 on the scan's
    better thread count (`{prefix} c=1`) and the scan's best batched rate (`{prefix} loaded`)."""
    single = load_runtime(models_dir, name, "cpu", scan["p50_threads"])
    runtimes = bare_runtimes(models_dir, name, scan["best_layout"])
    return {
        f"{prefix} c=1": (lambda seconds: {"p50_ms": p50_ms(single, seconds)}, None),
        f"{prefix} loaded": (lambda seconds: {"best_rate": batched_rate(runtimes, scan["best_batch"], seconds)}, None),
    }


def loaded_stages(port: int, name: str, seconds: float, concurrency: int, pid: int) -> dict:
    """Process `pid`'s CPU per request by stage (py-spy) while one model is served at c=`concurrency` for `seconds`;
    empty if py-spy failed (it says why on stderr)."""
    requests = [post_bytes(f"/v2/models/{name}/infer", b) for b in request_bodies(64)]
    load(port, requests, concurrency, WARMUP_S)
    raw = Path(tempfile.mkdtemp(prefix="mha-profile-")) / "py-spy.txt"
    cmd = [py_spy(), "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200", "-f", "raw", "-o", str(raw)]
    spy = subprocess.Popen([*cmd, "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    cpu_before = cpu_seconds(pid)
    loaded: LoadResult = load(port, requests, concurrency, seconds)
    cpu_ms = (cpu_seconds(pid) - cpu_before) * 1e3 / max(1, loaded.requests + loaded.errors)
    _, err = spy.communicate(timeout=60)
    if not raw.is_file():
        print(f"py-spy failed: {err.decode(errors='replace').strip()[-300:]}", file=sys.stderr)
        return {}
    return {"cpu_ms_per_request": cpu_ms, "shares": stage_shares(raw.read_text())}


Side = tuple[Callable[[float], dict], object]  # (measure for `seconds`, the server it measures, or None: in process)


Loader = Callable[[int, float], LoadResult]  # (concurrency, seconds) -> what ended in the window after WARMUP_S


def http_loader(port: int, requests: list[bytes]) -> Loader:
    return lambda concurrency, seconds: load(port, requests, concurrency, seconds, WARMUP_S)


def grpc_loader(url: str, messages: list) -> Loader:
    return lambda concurrency, seconds: grpc_client.load(url, messages, concurrency, seconds, WARMUP_S)


def load_sides(loader: Loader, concurrency: int, server, prefix: str, cpu_pid: int | None = None) -> dict[str, Side]:
    """A served model as two sides of the rounds: its c=1 p50 (`{prefix} c=1`) and its c=`concurrency` rate
    (`{prefix} loaded`), `loader(concurrency, seconds)` measuring each after WARMUP_S; with `cpu_pid`, also that
    process's CPU per request under load (its warm-up included), and how much of it its Python threads other than the
    models' run threads took, and its native threads."""

    def single(seconds: float) -> dict:
        result = loader(1, seconds)
        return {"c1_p50_ms": result.percentile_ms(50), "errors": result.errors}

    def loaded(seconds: float) -> dict:
        before = thread_cpu(cpu_pid) if cpu_pid is not None else {}
        result = loader(concurrency, seconds)
        p50, p99 = result.percentile_ms(50), result.percentile_ms(99)
        out = {"rate": result.rate, "loaded_p50_ms": p50, "loaded_p99_ms": p99, "errors": result.errors}
        if cpu_pid is not None:
            used = {tid: cpu - before.get(tid, 0.0) for tid, cpu in thread_cpu(cpu_pid).items()}
            per_request = 1e3 / max(1, result.requests)
            out["server_cpu_ms"] = sum(used.values()) * per_request
            if names := python_threads(cpu_pid):  # after the window: py-spy stops the process while it reads
                # Python threads other than the run threads: the event loop (protocol, handler), gRPC's poller. The
                # native ones, ORT's pool (a run with every thread) and gRPC's and Ray's own, cannot be told apart.
                runs = {t for t, name in names.items() if name.startswith(ORT_THREADS)}
                python = sum(c for t, c in used.items() if t in names and t not in runs)
                native = sum(c for t, c in used.items() if t not in names)
                out["server_cpu_python_ms"], out["server_cpu_native_ms"] = python * per_request, native * per_request
        return out

    return {f"{prefix} c=1": (single, server), f"{prefix} loaded": (loaded, server)}


def served_sides(port: int, name: str, concurrency: int, server, prefix: str) -> dict[str, Side]:
    """A served model's sides (`load_sides`) under v2 JSON requests over HTTP."""
    requests = [post_bytes(f"/v2/models/{name}/infer", b) for b in request_bodies(64)]
    return load_sides(http_loader(port, requests), concurrency, server, prefix)


def interleaved(parts: dict[str, dict[str, Side]]) -> dict[str, Side]:
    """Every part's c=1 side, then every part's loaded side: the figures the bar compares are measured one right
    after the other (seconds apart, on this machine's drift), in either order of a round."""
    sides = {}
    for kind in ("c=1", "loaded"):
        for prefix, part in parts.items():
            sides[f"{prefix} {kind}"] = part[f"{prefix} {kind}"]
    print(f"rounds of {', '.join(sides)}...", flush=True)
    return sides


def joined(got: dict[str, dict], prefix: str) -> dict:
    """The `{prefix} c=1` and `{prefix} loaded` sides' results as one: their medians, errors summed, and their
    rounds merged round by round."""
    c1, loaded = got[f"{prefix} c=1"], got[f"{prefix} loaded"]
    out = {**c1, **loaded, "errors": c1.get("errors", 0) + loaded.get("errors", 0)}
    out["rounds"] = [{**x, **y} for x, y in zip(c1["rounds"], loaded["rounds"], strict=True)]
    return out


def rounds(sides: dict[str, Side], n: int, seconds: float) -> dict[str, dict]:
    """Every side measured once per round, in turn (the order reversed every other round), with every server but
    the one measured paused: no server's idle background counts against another's figures or the bare ones, and
    the machine's drift over the minutes of a run cancels in figures compared round by round (`paired`). Each
    side's result: the medians of its figures over the rounds (errors summed), and the rounds themselves."""
    servers = {id(server): server for _, server in sides.values() if server is not None}
    samples: dict[str, list[dict]] = {label: [] for label in sides}
    for r in range(n):
        for label in list(sides) if r % 2 == 0 else reversed(list(sides)):
            fn, own = sides[label]
            with contextlib.ExitStack() as stack:
                for server in servers.values():
                    if server is not own:
                        stack.enter_context(server.paused())
                samples[label].append(fn(seconds))
    out = {}
    for label, taken in samples.items():
        keys = [k for k, v in taken[0].items() if isinstance(v, float)]
        out[label] = {k: float(np.median([t[k] for t in taken])) for k in keys}
        if "errors" in taken[0]:
            out[label]["errors"] = sum(t["errors"] for t in taken)
        out[label]["rounds"] = taken
    return out


def paired(a: dict, b: dict, key_a: str, key_b: str, op: Callable[[float, float], float]) -> list[float]:
    """op(a's figure, b's figure in the same round), round by round (both from one `rounds`)."""
    pairs = zip(a["rounds"], b["rounds"], strict=True)
    return [op(x[key_a], y[key_b]) for x, y in pairs if key_a in x and key_b in y]  # py-spy's figures may be missing


def serve_config(models_dir: Path, names: list[str], placement: str, args) -> dict:
    """The AppConfig: `mha-serving serve`'s defaults, the given placement, and only the options asked for."""
    deployment: dict = {"placement": placement}
    if placement == "deployment":
        deployment["num_cpus"] = 0.5  # two model replicas and the ingress fit the 2-core default Ray
    for key, value in (("intra_op_threads", args.threads), ("ort_spinning", args.spinning)):
        if value is not None:
            deployment[key] = value
    for item in args.deployment:
        key, _, value = item.partition("=")
        deployment[key] = yaml.safe_load(value)
    return {"models_dir": str(models_dir.resolve()), "models": names, "backend": "cpu", "deployment": deployment}


def serve(models_dir: Path, names: dict[str, str], placement: str, args, tree: Path | None = None) -> ServerProcess:
    """A `mha-serving serve` of these models (label -> name), as a user starts it (not yet entered); `tree`: from
    another checkout's code."""
    config = serve_config(models_dir, sorted(names.values()), placement, args)
    return ServerProcess(config, extra_args=["--proxy"] if args.proxy else [], tree=tree)


def started(server: ServerProcess, names: list[str]) -> dict:
    """A server just ready: its time to ready, RSS and processes (before any other server starts), each model
    warmed up (both of its sessions and every thread)."""
    out = {"ready_s": server.ready_s, "rss_mib": server.rss_mib(), "processes": server.process_count()}
    for name in names:
        load(server.port, [post_bytes(f"/v2/models/{name}/infer", b) for b in request_bodies(8)], 4, 1.0)
    return out


def profiled(server: ServerProcess, names: dict[str, str], args, run: dict, others: list) -> None:
    """--profile: each model measured once more with py-spy on the ingress (others paused); its stages into `run`."""
    pid = server.replica_pid("ingress")
    with contextlib.ExitStack() as stack:
        for other in others:
            stack.enter_context(other.paused())
        for label, name in names.items():
            if stages := loaded_stages(server.port, name, args.seconds, args.concurrency, pid):
                run[label]["stages"] = stages


class PlainServer:
    """The plain FastAPI + ORT server (benchmarks/baseline_server.py, no batching, one thread) in a subprocess."""

    def __init__(self, models_dir: Path, name: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "benchmarks.baseline_server", "--models", str(models_dir), "--name", name]
        self._proc = subprocess.Popen([*cmd, "--port", str(self.port), "--threads", "1"])

    def __enter__(self) -> PlainServer:
        try:
            wait_for_http(self.port, "/docs", 60, self._proc)
        except Exception:
            self.__exit__()
            raise
        return self

    def paused(self):
        return paused([self._proc.pid])

    def __exit__(self, *exc) -> None:
        self._proc.terminate()
        self._proc.wait(10)


BAR = {
    "small_c32_over_plain": 1.15,  # >=
    "default_c32_over_batched_ort": 0.9,  # >=
    "small_c1_over_bare_ms": 1.0,  # <=
    "default_c1_over_bare_ms": 1.5,  # <=
    "five_c1_p50_over_alone": 1.10,  # <=
    "five_c32_over_alone": 0.90,  # >=
    "five_pss_mib": 1536,  # <=
    "five_ready_s": 15.0,  # <=
    "int8_c32_over_fp32": 2.2,  # >=
    "int8_c1_p50_over_fp32": 0.6,  # <=
    "int8_file_over_fp32": 0.3,  # <=
    "five_int8_pss_over_fp32": 0.7,  # <=
    "grpc_c32_over_http_json": 0.95,  # >=
    # <= : less server CPU per request in binary, on the threads the protocol runs on (the model's runs, the same
    # either way and ~50 x larger, are left out: their noise hides the difference in the total)
    "large_binary_python_cpu_over_json": 1.0,
}
AT_MOST = {
    *("small_c1_over_bare_ms", "default_c1_over_bare_ms", "five_c1_p50_over_alone", "five_pss_mib", "five_ready_s"),
    *("int8_c1_p50_over_fp32", "int8_file_over_fp32", "five_int8_pss_over_fp32"),
    "large_binary_python_cpu_over_json",
}
PRECISION_RUN = "serve (default fp32 and int8)"
PROTOCOL_RUN = "serve (default model, three ways in)"


def per_round(bare: dict, plain: dict | None, runs: dict[str, dict]) -> dict[str, list[float]]:
    """The bar's figures round by round (`rounds`: both sides of each measured in the same round), from whichever
    scenarios ran; the bar takes their medians."""
    out: dict[str, list[float]] = {}
    colocated = runs.get("serve (colocated)")
    if colocated is not None:
        s, d = colocated["small"], colocated["default"]
        if plain is not None:
            out["small_c32_over_plain"] = paired(s, plain, "rate", "rate", operator.truediv)
        out["default_c32_over_batched_ort"] = paired(d, bare["default"], "rate", "best_rate", operator.truediv)
        out["small_c1_over_bare_ms"] = paired(s, bare["small"], "c1_p50_ms", "p50_ms", operator.sub)
        out["default_c1_over_bare_ms"] = paired(d, bare["default"], "c1_p50_ms", "p50_ms", operator.sub)
    versus = runs.get("versus (colocated)")
    if colocated is not None and versus is not None:
        for label in ("small", "default"):
            this, that = colocated[label], versus[label]
            out[f"versus_{label}_c32_ratio"] = paired(this, that, "rate", "rate", operator.truediv)
            out[f"versus_{label}_c1_ms"] = paired(this, that, "c1_p50_ms", "c1_p50_ms", operator.sub)
    alone, five = runs.get("serve (default model alone)"), runs.get("serve (five default models)")
    if alone is not None and five is not None:
        out["five_c1_p50_over_alone"] = paired(
            five["busy"], alone["default"], "c1_p50_ms", "c1_p50_ms", operator.truediv
        )
        out["five_c32_over_alone"] = paired(five["busy"], alone["default"], "rate", "rate", operator.truediv)
        out["five_pss_mib"] = [five["rss_mib"]["Pss"]]
        out["five_ready_s"] = [five["ready_s"]]
    if (both := runs.get(PRECISION_RUN)) is not None:
        fp32, int8 = both["fp32"], both["int8"]
        out["int8_c32_over_fp32"] = paired(int8, fp32, "rate", "rate", operator.truediv)
        out["int8_c1_p50_over_fp32"] = paired(int8, fp32, "c1_p50_ms", "c1_p50_ms", operator.truediv)
        bare_fp32, bare_int8 = both["bare fp32"], both["bare int8"]
        out["int8_bare_b1_p50_over_fp32"] = paired(bare_int8, bare_fp32, "p50_ms", "p50_ms", operator.truediv)
        out["int8_bare_batched_over_fp32"] = paired(bare_int8, bare_fp32, "best_rate", "best_rate", operator.truediv)
        out["int8_file_over_fp32"] = [both["file_bytes"]["int8"] / both["file_bytes"]["fp32"]]
    if (ways := runs.get(PROTOCOL_RUN)) is not None:
        json_, binary_, grpc_ = ways["http json"], ways["http binary"], ways["grpc"]
        out["grpc_c32_over_http_json"] = paired(grpc_, json_, "rate", "rate", operator.truediv)
        out["grpc_c1_minus_http_json_ms"] = paired(grpc_, json_, "c1_p50_ms", "c1_p50_ms", operator.sub)
        out["binary_c32_over_http_json"] = paired(binary_, json_, "rate", "rate", operator.truediv)
        python, native = "server_cpu_python_ms", "server_cpu_native_ms"
        out["grpc_python_cpu_minus_http_json_ms"] = paired(grpc_, json_, python, python, operator.sub)
        out["grpc_native_cpu_minus_http_json_ms"] = paired(grpc_, json_, native, native, operator.sub)
    direct, proxied = runs.get(GRPC_DIRECT_RUN), runs.get(GRPC_PROXY_RUN)
    if direct is not None and proxied is not None:
        grpc_, json_, in_replica = proxied["grpc"], proxied["http json"], direct["grpc"]
        out["proxy_grpc_c32_over_direct"] = paired(grpc_, in_replica, "rate", "rate", operator.truediv)
        out["proxy_grpc_c32_over_proxy_json"] = paired(grpc_, json_, "rate", "rate", operator.truediv)
        out["proxy_grpc_c1_minus_direct_ms"] = paired(grpc_, in_replica, "c1_p50_ms", "c1_p50_ms", operator.sub)
    if (large := runs.get(LARGE_RUN)) is not None:
        json_, binary_ = large["large json"], large["large binary"]
        out["large_binary_cpu_over_json"] = paired(binary_, json_, "server_cpu_ms", "server_cpu_ms", operator.truediv)
        python = "server_cpu_python_ms"
        out["large_binary_python_cpu_over_json"] = paired(binary_, json_, python, python, operator.truediv)
        out["large_binary_c1_over_json"] = paired(binary_, json_, "c1_p50_ms", "c1_p50_ms", operator.truediv)
    five_fp32, five_int8 = runs.get("serve (five default models, fp32)"), runs.get("serve (five default models, int8)")
    if five_fp32 is not None and five_int8 is not None:
        out["five_int8_pss_over_fp32"] = [five_int8["rss_mib"]["Pss"] / five_fp32["rss_mib"]["Pss"]]
    return {key: values for key, values in out.items() if values}  # a figure without rounds: py-spy could not


def report(bare: dict, plain: dict | None, runs: dict[str, dict], figures: dict[str, list[float]], args) -> None:
    concurrency = args.concurrency
    print(f"\n{'server':<34} {'model':<8} {'c=1 p50':>9} {f'c={concurrency}':>11} {'p99':>9}  errors")
    for label in ("small", "default"):
        b = bare[label]
        scan = b["scan"]
        how = f"medians of {len(b['rounds'])} rounds" if "rounds" in b else "the scan"
        line = f"{'bare ORT (b1 p50 / best batch)':<34} {label:<8} {b['p50_ms']:7.2f}ms {b['best_rate']:7.0f} seq/s"
        print(f"{line}  ({scan['p50_threads']} thread(s) / {scan['best_layout']}, batch {scan['best_batch']}; {how})")
    for label in ("fp32", "int8"):
        if (b := runs.get(PRECISION_RUN, {}).get(f"bare {label}")) is not None:
            line = f"{f'bare ORT, default {label}':<34} {'default':<8} {b['p50_ms']:7.2f}ms {b['best_rate']:7.0f} seq/s"
            print(f"{line}  ({b['scan']['best_layout']}, batch {b['scan']['best_batch']})")
    if (files := runs.get(PRECISION_RUN, {}).get("file_bytes")) is not None:
        print(
            f"model.onnx of the default model: fp32 {files['fp32'] / 2**20:.1f} MiB, "
            f"int8 {files['int8'] / 2**20:.1f} MiB"
        )
    if plain is not None:
        print(f"{'plain FastAPI + ORT':<34} {'small':<8} {plain['c1_p50_ms']:7.2f}ms {plain['rate']:7.0f} req/s")
    for run_name, run in runs.items():
        for label, m in run.items():
            if isinstance(m, dict) and "rate" in m:
                print(
                    f"{run_name:<34} {label:<8} {m['c1_p50_ms']:7.2f}ms {m['rate']:7.0f} req/s "
                    f"{m['loaded_p99_ms']:7.1f}ms  {m['errors']}"
                )
    print(f"(served and plain: medians of {args.rounds} rounds of {args.seconds:g} s per figure)")
    print(f"\n{'server':<34} {'ready':>7} {'processes':>9} {'RSS sum':>9} {'PSS sum':>9}")
    for run_name, run in runs.items():
        rss = run["rss_mib"]
        print(f"{run_name:<34} {run['ready_s']:6.1f}s {run['processes']:>9} {rss['Rss']:6.0f}MiB {rss['Pss']:6.0f}MiB")
    for run_name, run in runs.items():
        for label, m in run.items():
            if isinstance(m, dict) and "stages" in m:
                print(f"\n{run_name}, {label} model, c={concurrency}: ingress CPU per request by stage (py-spy)")
                print(table(m["stages"]["shares"], m["stages"]["cpu_ms_per_request"]))
    print("\nratios (bar in brackets; the median of the rounds, each round's figure after it):")
    for key, values in figures.items():
        value = float(np.median(values))
        if key not in BAR:
            what = "this tree against --versus" if key.startswith("versus_") else "no bar"
            print(f"  {key:<32} {value:9.2f}  ({what}) {' '.join(f'{v:.2f}' for v in values)}")
            continue
        sign = "<=" if key in AT_MOST else ">="
        ok = value <= BAR[key] if key in AT_MOST else value >= BAR[key]
        each = " ".join(f"{v:.2f}" for v in values) if len(values) > 1 else ""
        print(f"  {key:<32} {value:9.2f}  [{sign} {BAR[key]:g}] {'ok' if ok else 'NOT MET':<8} {each}")


def precisions(args, fp32: str, fp32_scan: dict, five: list[str]) -> dict[str, dict]:
    """The default model's int8 variant against it: in process and served by one server (the same rounds), their
    file sizes, then the five default models served in each precision (PSS and time to ready, one server at a time)."""
    print("int8 against fp32: the default model in process and served, then the five in each precision...", flush=True)
    int8 = ensure_variant(args.models, fp32)
    five_int8 = [ensure_variant(args.models, name) for name in five]
    int8_scan = bare_scan(args.models, int8, args.seconds)
    with serve(args.models, {"fp32": fp32, "int8": int8}, "colocated", args) as server:
        run = started(server, [fp32, int8])
        parts = {
            "bare fp32": bare_sides(args.models, fp32, fp32_scan, "bare fp32"),
            "bare int8": bare_sides(args.models, int8, int8_scan, "bare int8"),
            "fp32": served_sides(server.port, fp32, args.concurrency, server, "fp32"),
            "int8": served_sides(server.port, int8, args.concurrency, server, "int8"),
        }
        got = rounds(interleaved(parts), args.rounds, args.seconds)
    for label, scan in (("fp32", fp32_scan), ("int8", int8_scan)):
        run[label] = joined(got, label)
        run[f"bare {label}"] = {**joined(got, f"bare {label}"), "scan": scan}
    run["file_bytes"] = {
        label: (args.models / n / MODEL_FILE).stat().st_size for label, n in (("fp32", fp32), ("int8", int8))
    }
    out = {PRECISION_RUN: run}
    for label, names in (("fp32", five), ("int8", five_int8)):
        with serve(args.models, {n: n for n in names}, "colocated", args) as server:
            out[f"serve (five default models, {label})"] = started(server, [])
    return out


def protocols(args, name: str) -> dict[str, dict]:
    """The default model served once, measured in the same rounds through v2 JSON over HTTP, the binary tensor data
    extension over HTTP, and gRPC (raw input contents), the same requests each way."""
    print("the default model through HTTP JSON, HTTP binary and gRPC...", flush=True)
    with serve(args.models, {"default": name}, "colocated", args) as server:
        run = started(server, [name])
        path = f"/v2/models/{name}/infer"
        binary = binary_requests(path, 64)
        messages = [grpc_client.infer_message(name, ids) for ids in request_ids(64)]
        grpc_url = f"127.0.0.1:{server.grpc_port}"
        json_ = [post_bytes(path, b) for b in request_bodies(64)]
        loaders = {
            "http json": http_loader(server.port, json_),
            "http binary": http_loader(server.port, binary),
            "grpc": grpc_loader(grpc_url, messages),
        }
        pid = server.replica_pid("ingress")  # it runs the co-located model too: ORT's CPU is in its figure
        parts = {k: load_sides(f, args.concurrency, server, k, cpu_pid=pid) for k, f in loaders.items()}
        got = rounds(interleaved(parts), args.rounds, args.seconds)
    for label in parts:
        run[label] = joined(got, label)
    return {PROTOCOL_RUN: run}


GRPC_DIRECT_RUN, GRPC_PROXY_RUN = "serve (gRPC in the replica)", "serve (gRPC through Serve's proxy)"


def grpc_proxy(args, name: str) -> dict[str, dict]:
    """The default model served twice, measured in the same rounds: directly (the ingress replica's own HTTP and
    gRPC servers, the local default) and through Serve's HTTP and gRPC proxies (`--proxy`, the cluster's way in),
    each through v2 JSON over HTTP and gRPC (raw input contents), the same requests each way."""
    print("the default model through HTTP JSON and gRPC, directly and through Serve's proxies...", flush=True)
    config = serve_config(args.models, [name], "colocated", args)
    path = f"/v2/models/{name}/infer"
    json_ = [post_bytes(path, b) for b in request_bodies(64)]
    messages = [grpc_client.infer_message(name, ids) for ids in request_ids(64)]
    with ServerProcess(config) as direct, ServerProcess(config, extra_args=["--proxy"]) as proxied:
        runs = {GRPC_DIRECT_RUN: started(direct, [name]), GRPC_PROXY_RUN: started(proxied, [name])}
        parts, where = {}, {}  # "direct grpc" -> its sides; -> (its run, "grpc")
        for run_name, way, server in ((GRPC_DIRECT_RUN, "direct", direct), (GRPC_PROXY_RUN, "proxy", proxied)):
            url = f"127.0.0.1:{server.grpc_port}"  # with --proxy, Serve's gRPC proxy's port
            loaders = {
                "http json": http_loader(server.port, json_),
                "grpc": grpc_loader(url, messages),
            }
            for label, loader in loaders.items():
                parts[f"{way} {label}"] = load_sides(loader, args.concurrency, server, f"{way} {label}")
                where[f"{way} {label}"] = (run_name, label)
        got = rounds(interleaved(parts), args.rounds, args.seconds)
    for part, (run_name, label) in where.items():
        runs[run_name][label] = joined(got, part)
    return runs


LARGE = (64, 512)  # rows x tokens of the large requests: ~200 KB of JSON text against 256 KiB of int64
LARGE_RUN = "serve (64 x 512 ids per request)"
CPU_SPLIT = {"server_cpu_ms": "all", "server_cpu_python_ms": "python", "server_cpu_native_ms": "native"}
# Seconds per figure of the large requests, at least: a few requests a second, and /proc counts a thread's CPU in
# 10 ms ticks, so a figure needs tens of requests for the protocol's ~1 ms on the event loop to show.
LARGE_SECONDS = 10.0


def large_requests(args) -> dict[str, dict]:
    """Requests of 64 x 512 ids to a small model with max_len 512, as v2 JSON and as binary tensor data, in the same
    rounds of LARGE_SECONDS or more: latency at c=1, rate and the ingress replica's CPU per request at c=4."""
    print(f"{LARGE[0]} x {LARGE[1]} ids per request, v2 JSON against binary tensor data...", flush=True)
    name = ensure_model(args.models, 4, 128, 2, max_len=LARGE[1], prefix="long")
    with serve(args.models, {"long": name}, "colocated", args) as server:
        run = started(server, [name])
        path = f"/v2/models/{name}/infer"
        json_ = [post_bytes(path, b) for b in request_bodies(8, LARGE[0], tokens=LARGE[1])]
        binary = binary_requests(path, 8, *LARGE)
        pid = server.replica_pid("ingress")
        parts = {
            "large json": load_sides(http_loader(server.port, json_), 4, server, "large json", pid),
            "large binary": load_sides(http_loader(server.port, binary), 4, server, "large binary", pid),
        }
        got = rounds(interleaved(parts), args.rounds, max(args.seconds, LARGE_SECONDS))
    for label in parts:
        run[label] = joined(got, label)
    run["decode_ms"] = decode_costs(name, json_[0], binary[0])
    return {LARGE_RUN: run}


def decode_costs(name: str, json_request: bytes, binary_request: bytes, calls: int = 50) -> dict[str, float]:
    """The median milliseconds the server's own code takes (in this process) to turn one request body into checked
    rows, as v2 JSON and as binary tensor data: what the protocol itself costs, without ORT."""
    from contract.metadata import ModelMetadata
    from service.ingress import parse_body
    from service.protocol import binary, v2

    meta = ModelMetadata(name, 4, 32, 128, 2, 260, LARGE[1], 2, ("negative", "positive"))
    json_body = json_request.split(b"\r\n\r\n", 1)[1]
    head, binary_body = binary_request.split(b"\r\n\r\n", 1)
    length = next(
        line.split(b":")[1].strip().decode()
        for line in head.split(b"\r\n")
        if line.lower().startswith(binary.HEADER.encode())
    )

    def from_json() -> None:
        v2.decode(parse_body(json_body, v2.InferRequest), meta, LARGE[0])

    def from_binary() -> None:
        header, blob = binary.split(binary_body, length)
        request = parse_body(header, v2.InferRequest)
        binary.attach(request, blob)
        v2.decode(request, meta, LARGE[0])

    out = {}
    for label, decode in (("json", from_json), ("binary", from_binary)):
        decode()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            decode()
            times.append(time.perf_counter() - start)
        out[label] = float(np.median(times) * 1e3)
    return out


def protocol_cpu(runs: dict[str, dict]) -> None:
    """The ingress replica's CPU per request under load, each way in (the protocols scenario)."""
    for run_name, labels in (
        (PROTOCOL_RUN, ("http json", "http binary", "grpc")),
        (LARGE_RUN, ("large json", "large binary")),
    ):
        ways = runs.get(run_name)
        if ways is None:
            continue
        print(f"\n{run_name}: ingress replica CPU per request under load: all; its Python threads but the model's runs")
        print("  (the event loop: protocol and handler; gRPC's poller); its native threads (ORT's pool, gRPC's, Ray's)")
        for label in labels:
            for key, where in CPU_SPLIT.items():
                if key in ways[label]:
                    each = " ".join(f"{r[key]:.2f}" for r in ways[label]["rounds"] if key in r)
                    print(f"  {label:<12} {where:<6} {ways[label][key]:8.2f} ms  (rounds: {each})")
        if "decode_ms" in ways:
            costs = ways["decode_ms"]
            print(
                f"  decoding one request into rows (in process): JSON {costs['json']:.3f} ms, "
                f"binary {costs['binary']:.3f} ms"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument("--seconds", type=float, default=2.5, help="per figure per round (default: 2.5)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of every comparison (default: 5)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--threads", type=int, help="ORT intra-op threads per model (default: the server's)")
    p.add_argument("--spinning", choices=SPINNING, help="ORT intra-op threads' spinning (default: the server's)")
    p.add_argument("--proxy", action="store_true", help="through Serve's proxy instead of direct ingress")
    p.add_argument("--profile", action="store_true", help="py-spy the ingress under load: CPU per request by stage")
    p.add_argument(
        "--scenarios",
        type=lambda v: set(v.split(",")),
        default={"plain", "colocated", "deployment", "five", "int8", "protocols"},
        help="which servers to measure besides bare ORT (default: plain,colocated,deployment,five,int8,protocols; "
        "also grpc-proxy: gRPC and HTTP JSON in the replica against through Serve's proxies)",
    )
    p.add_argument(
        "--versus",
        type=Path,
        metavar="TREE",
        help="also serve colocated from another checkout (e.g. `git worktree add /tmp/before <commit>`), measured "
        "in the same rounds: this code's c=1 p50 and c=32 rate against that one's",
    )
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="set for the servers (levers)")
    p.add_argument(
        "--deployment",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model setting for every served model (AppConfig `deployment`), e.g. max_concurrent_batches=2",
    )
    args = p.parse_args(argv)
    if args.rounds < 1 or args.seconds <= 0:
        p.error("--rounds must be at least 1 and --seconds above 0")
    for item in args.env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    names = {label: ensure_model(args.models, h, d, layers) for label, (d, h, layers) in MODELS.items()}
    five = [ensure_model(args.models, h, 512, 4) for h in FIVE_HEADS]
    print(f"bare ORT ({TOKENS} tokens per sequence): which thread count, layout and batch size...", flush=True)
    scans = {label: bare_scan(args.models, name, args.seconds) for label, name in names.items()}
    bare = {
        label: {"scan": scan, "p50_ms": scan["p50_ms"], "best_rate": scan["best_rate"]} for label, scan in scans.items()
    }
    plain, runs = None, {}
    with contextlib.ExitStack() as stack:
        parts: dict[str, dict[str, Side]] = {}  # what each model's sides are, in the order pairs are compared
        if "colocated" in args.scenarios:
            print("mha-serving serve, placement colocated...", flush=True)
            colocated = stack.enter_context(serve(args.models, names, "colocated", args))
            runs["serve (colocated)"] = started(colocated, list(names.values()))
            for label, name in names.items():
                parts[f"bare {label}"] = bare_sides(args.models, name, scans[label], f"bare {label}")
                parts[f"serve {label}"] = served_sides(
                    colocated.port, name, args.concurrency, colocated, f"serve {label}"
                )
        if args.versus is not None and "colocated" in args.scenarios:
            print(f"mha-serving serve from {args.versus}, placement colocated...", flush=True)
            before = stack.enter_context(serve(args.models, names, "colocated", args, tree=args.versus))
            runs["versus (colocated)"] = started(before, list(names.values()))
            for label, name in names.items():
                parts[f"versus {label}"] = served_sides(before.port, name, args.concurrency, before, f"versus {label}")
        if "plain" in args.scenarios:
            print("plain FastAPI + ORT...", flush=True)
            baseline = stack.enter_context(PlainServer(args.models, names["small"]))
            parts["plain small"] = served_sides(
                baseline.port, names["small"], args.concurrency, baseline, "plain small"
            )
        if parts:
            order = (  # the pairs compared adjacent
                *("bare small", "serve small", "versus small", "plain small"),
                *("bare default", "serve default", "versus default"),
            )
            got = rounds(interleaved({k: parts[k] for k in order if k in parts}), args.rounds, args.seconds)
            plain = joined(got, "plain small") if "plain small" in parts else None
            if "colocated" in args.scenarios:
                for label in names:
                    bare[label].update(joined(got, f"bare {label}"))
                    runs["serve (colocated)"][label] = joined(got, f"serve {label}")
                    if f"versus {label}" in parts:
                        runs["versus (colocated)"][label] = joined(got, f"versus {label}")
                if args.profile:
                    others = [baseline] if plain else []
                    others += [before] if "versus (colocated)" in runs else []
                    profiled(colocated, names, args, runs["serve (colocated)"], others)
    if "deployment" in args.scenarios:
        print("mha-serving serve, placement deployment...", flush=True)
        with serve(args.models, names, "deployment", args) as server:
            run = runs["serve (deployment)"] = started(server, list(names.values()))
            parts = {label: served_sides(server.port, n, args.concurrency, server, label) for label, n in names.items()}
            got = rounds(interleaved(parts), args.rounds, args.seconds)
            run.update({label: joined(got, label) for label in names})
            if args.profile:
                profiled(server, names, args, run, [])
    if "five" in args.scenarios:
        print("mha-serving serve, the five default models, then the default model alone beside them...", flush=True)
        default = {"default": names["default"]}
        together = {"busy": names["default"], **{f"idle-{i}": n for i, n in enumerate(five) if n != names["default"]}}
        with serve(args.models, together, "colocated", args) as five_server:
            five_run = started(five_server, [names["default"]])  # PSS and ready before a second server starts
            with serve(args.models, default, "colocated", args) as alone_server:
                alone_run = started(alone_server, [names["default"]])
                parts = {
                    "alone": served_sides(alone_server.port, names["default"], args.concurrency, alone_server, "alone"),
                    "busy": served_sides(five_server.port, names["default"], args.concurrency, five_server, "busy"),
                }
                got = rounds(interleaved(parts), args.rounds, args.seconds)
        alone_run["default"], five_run["busy"] = joined(got, "alone"), joined(got, "busy")
        runs["serve (default model alone)"], runs["serve (five default models)"] = alone_run, five_run
    if "int8" in args.scenarios:
        runs.update(precisions(args, names["default"], scans["default"], five))
    if "protocols" in args.scenarios:
        runs.update(protocols(args, names["default"]))
        runs.update(large_requests(args))
    if "grpc-proxy" in args.scenarios:
        runs.update(grpc_proxy(args, names["default"]))
    figures = per_round(bare, plain, runs)
    report(bare, plain, runs, figures, args)
    protocol_cpu(runs)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {key: float(np.median(values)) for key, values in figures.items()}
        out = {
            "bare": bare,
            "plain": plain,
            "runs": runs,
            "ratios": summary,
            "per_round": figures,
            "settings": vars(args),
        }
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
