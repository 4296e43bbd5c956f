"""A level's server: `mha-serving serve --processes N --backend B` serving the model, as a user starts it, ready once
every serving process answers on the shared port; and its two sides of the rounds, c=1 and loaded, each a window of
the load-client processes with the server's CPU (and the GPU's busy share) sampled over the same window."""

from __future__ import annotations

import http.client
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness.polling import until
from benchmarks.harness.server import ServerProcess
from benchmarks.scale.clients import ClientPool
from benchmarks.scale.figures import merged
from benchmarks.scale.levels import Level
from benchmarks.scale.sample import CpuWindow, GpuSampler, serving_processes
from benchmarks.serving.requests import request_bodies
from benchmarks.serving.rounds import WARMUP_S, Side
from benchmarks.serving.stages import recorded_shares, start_recording
from loadtest.http_client import load, post_bytes
from service.ingress import SERVED_BY

PROFILE_RATE = 100  # py-spy samples a second of one serving process (--profile): a light touch on the figures
START_TIMEOUT_S = 300  # N processes each loading the model (on the GPU, each its own CUDA context)


def serve_level(
    models_dir: Path, name: str, backend: str, processes: int, settings: dict[str, str] | None = None
) -> ServerProcess:
    """The level's server (not yet entered): the model co-located in each of `processes` serving processes, with
    its variant's model `settings`."""
    config = {
        "models_dir": str(models_dir.resolve()),
        "models": [name],
        "backend": backend,
        "deployment": {**(settings or {}), "placement": "colocated"},
    }
    args = ["--processes", str(processes), "--backend", backend]
    return ServerProcess(config, extra_args=args, timeout_s=START_TIMEOUT_S)


def start_all(servers: list[ServerProcess]) -> list[ServerProcess]:
    """Every server started at once (each its own Ray: starting them in turn would take minutes on 2 cores); if one
    fails, the others stopped and its error raised (ServerProcess printed its log)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(server.__enter__) for server in servers]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        stop_all([s for s, f in zip(servers, futures, strict=True) if f.exception() is None])
        raise errors[0]
    return servers


def stop_all(servers: list[ServerProcess]) -> None:
    """Every server stopped at once (SIGTERM, each drains and stops its Ray)."""
    with ThreadPoolExecutor(max(1, len(servers))) as pool:
        list(pool.map(lambda server: server.__exit__(), servers))


def answered_by(port: int) -> str:
    """The serving process that answers GET /v2/health/ready on a fresh connection ("" if none is named)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v2/health/ready")
        answer = conn.getresponse()
        answer.read()
        return answer.getheader(SERVED_BY) or ""
    finally:
        conn.close()


def every_process_answering(port: int, processes: int, timeout_s: float = 120) -> set[str]:
    """The serving processes seen answering on `port`, once `processes` of them have (each binds the shared port
    once its models are loaded; the kernel picks one per connection)."""
    seen: set[str] = set()

    def check() -> bool:
        seen.update(answered_by(port) for _ in range(4 * processes))
        return len(seen - {""}) >= processes

    until(f"{processes} serving processes answering on port {port}", check, timeout_s, every_s=0.5)
    return seen - {""}


def started(server: ServerProcess, level: Level, name: str) -> dict:
    """A level's server just ready: time to ready, the tree's PSS, its serving processes, each warmed up."""
    out = {"ready_s": server.ready_s, "pss_mib": server.rss_mib()["Pss"]}
    out["answering"] = sorted(every_process_answering(server.port, level.processes))
    out["serving_pids"] = serving_processes(server.processes())
    requests = [post_bytes(f"/v2/models/{name}/infer", b) for b in request_bodies(16)]
    load(server.port, requests, max(4, 4 * level.processes), 1.0)  # fresh connections: every process warmed
    return out


def window(pool: ClientPool, server: ServerProcess, gpu: GpuSampler, args, name: str, connections: int, seconds: float):
    """One window of load on `server`: the clients' merged figures, the server's and machine's CPU over it (the
    serving processes' per request answered, by kind of thread: `thread_us`), the GPU's mean busy share (with a
    sampler: nan if it took no sample); with --profile, one serving process's CPU by stage (`stages`, py-spy)."""
    port = server.port if args.protocol == "http" else server.grpc_port
    cpu = CpuWindow(server.processes())
    commands, start, deadline = pool.window(args.protocol, port, name, args.body, connections, seconds, WARMUP_S)
    pool.send(commands)
    time.sleep(max(0.0, start - time.monotonic()))
    cpu.begin()
    spy = start_recording(cpu.serving[0], seconds, PROFILE_RATE) if args.profile and connections > 1 else None
    time.sleep(max(0.0, deadline - time.monotonic()))
    out = cpu.end()
    out.update(merged(pool.collect(len(commands), deadline), seconds))
    if spy is not None:
        out["stages"] = recorded_shares(*spy, cpu.thread_cpu_s(cpu.serving[0]))
    answered = out["rate"] * seconds  # the serving processes' CPU per request answered, by kind of thread
    out["thread_us"] = {kind: 1e6 * cpu_s / answered for kind, cpu_s in out.pop("thread_cpu_s").items() if answered}
    if gpu.present:
        busy = gpu.busy_pct(start, deadline)
        out["gpu_busy_pct"] = math.nan if busy is None else busy
    return out


def level_sides(
    pool: ClientPool, server: ServerProcess, gpu: GpuSampler, args, level: Level, name: str
) -> dict[str, Side]:
    """`{label} c=1` (one connection from one client: its p50) and `{label} loaded` (`--concurrency` connections
    from each of the `--clients` processes: rate, latency, answers per process, CPU, GPU)."""

    def single(seconds: float) -> dict:
        got = window(pool, server, gpu, args, name, 1, seconds)
        out = {"c1_p50_ms": got["p50_ms"], "c1_p99_ms": got["p99_ms"], "errors": got["errors"]}
        return {**out, "c1_failure": got["failure"]}

    def loaded(seconds: float) -> dict:
        return window(pool, server, gpu, args, name, args.concurrency, seconds)

    return {f"{level.label} c=1": (single, server), f"{level.label} loaded": (loaded, server)}
