"""The servers the serving benchmark measures: `mha-serving serve` as a user starts it, from this tree or another
checkout's (--versus), with the AppConfig a run asks for, each warmed up before its rounds."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.harness.server import ServerProcess
from benchmarks.serving.requests import request_bodies
from loadtest.http_client import load, post_bytes


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
