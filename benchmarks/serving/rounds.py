"""The serving benchmark's rounds: each figure a side (a measurement for some seconds, and the server it measures),
every side measured once a round with every other server paused, and figures paired round by round."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from benchmarks.harness.processes import python_threads, thread_cpu
from benchmarks.serving.requests import request_bodies
from loadtest import grpc_client
from loadtest.http_client import LoadResult, load, post_bytes
from service.engine import ORT_THREADS

WARMUP_S = 0.5  # before every served measurement, not counted: connections, first batches, caches after a pause


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
