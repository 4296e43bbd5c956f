"""Test support: one real Ray (2 CPUs) and Serve on 127.0.0.1 per session, and applications deployed into it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.local.ports import free_port

TEST_DEPLOYMENT = {"num_cpus": 0.25, "max_batch_size": 16}  # 2 logical CPUs hold every test app's replicas


@dataclass(frozen=True)
class Served:
    """A running application: where to reach it, and what it was built from."""

    base_url: str  # e.g. http://127.0.0.1:PORT/limited
    name: str
    models_dir: Path
    config: dict

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30, **kwargs)

    @property
    def grpc_url(self) -> str:
        """host:port of the ingress's gRPC server (the app's `ingress.grpc_port`)."""
        return f"127.0.0.1:{self.config['ingress']['grpc_port']}"


def start_ray_and_serve(metrics_port: int | None = None, grpc_port: int | None = None) -> int:
    """An embedded local Ray of its own (never another session's cluster) with Serve on a free port.

    Ray's metrics export (every replica's series on one /metrics URL) listens on `metrics_port` when given, Serve's
    gRPC proxy (the cluster's way in for gRPC) on `grpc_port`.
    """
    import ray
    from ray import serve

    from service.http.limits import PROXY_LIMITS_ENV
    from service.local.ray_env import LOCAL_RAY_ENV, RAY_ON_LOOPBACK, SERVE_RAY_ENV
    from service.rpc.servicers import SERVE_SERVICERS

    port = free_port()
    # Ray exports metrics every 10 s by default; 1 s keeps the metrics tests short (Ray's processes inherit it).
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    # Serve's controller reconciles every 0.1 s by default, a good part of what the session's idle applications cost;
    # the local launcher's interval leaves more of the 2 cores to the tests.
    control_loop = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S"
    os.environ.setdefault(control_loop, LOCAL_RAY_ENV[control_loop])
    # Requests come through Serve's proxy (with the image's proxy limits) and Ray runs Serve's settings of the pods
    # (their HAProxy ingress aside: benchmarks/harness/cluster.py starts it); Ray's ports on loopback.
    for key, value in {**PROXY_LIMITS_ENV, **SERVE_RAY_ENV, **RAY_ON_LOOPBACK}.items():
        os.environ.setdefault(key, value)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        configure_logging=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
    )
    grpc = None if grpc_port is None else {"port": grpc_port, "grpc_servicer_functions": SERVE_SERVICERS}
    serve.start(http_options={"host": "127.0.0.1", "port": port}, grpc_options=grpc)
    return port


def deploy(port: int, name: str, models_dir: Path, placement: str = "auto", **config) -> Served:
    """Deploy `build_app(config)` as application `name` under route prefix `/name` (or `/` for "main"); `deployment`
    settings are added to TEST_DEPLOYMENT, with every model's `placement` (auto: co-located on CPU)."""
    from ray import serve

    from service.app import build_app

    settings = {**TEST_DEPLOYMENT, "placement": placement, **config.pop("deployment", {})}
    args = {"models_dir": str(models_dir), "deployment": settings, **config}
    prefix = "/" if name == "main" else f"/{name}"
    logging = {"enable_access_log": False, "log_level": "WARNING"}
    serve.run(build_app(args), name=name, route_prefix=prefix, blocking=False, logging_config=logging)
    return Served(f"http://127.0.0.1:{port}{prefix.rstrip('/')}", name, models_dir, args)


@contextlib.contextmanager
def deployed(port: int, name: str, models_dir: Path, placement: str, **config) -> Iterator[Served]:
    """`deploy`, and the application deleted afterwards (a module's own application beside the session's)."""
    from ray import serve

    served = deploy(port, name, models_dir, placement=placement, **config)
    try:
        yield served
    finally:
        serve.delete(served.name)


def models_when_ready(served: Served, names: set[str], timeout_s: float = 60) -> dict[str, dict]:
    """`GET /v1/models` by model name, once every model of `names` is ready (or `timeout_s` has passed)."""
    import time

    deadline = time.monotonic() + timeout_s
    with served.client() as c:
        while True:
            models = {m["name"]: m for m in c.get("/v1/models").json()["models"]}
            if all(models.get(n, {}).get("ready") for n in names) or time.monotonic() > deadline:
                return models
            time.sleep(0.5)


def stop_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def broken_models_dir(root: Path, good: Path) -> Path:
    """A models folder with one good model (whose attention variant is corrupt) and three that cannot serve:
    missing, corrupt, inconsistent."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(good, root / good.name)
    (root / good.name / "model.attn.onnx").write_bytes(b"not a graph")  # the good model's attention variant: corrupt
    (root / "mha-missing").mkdir()  # no model.onnx
    (root / "mha-corrupt").mkdir()
    (root / "mha-corrupt" / "model.onnx").write_bytes(b"this is not an ONNX protobuf")
    shutil.copytree(good, root / "mha-h9-d32")  # metadata says mha-h2-d32: inconsistent with its folder
    return root


def bare_logits(models_dir: Path, name: str, ids, mask=None):
    """The reference: ONNX Runtime on the same file, no service code in between. (B, T) -> (B, C) float32."""
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(str(models_dir / name / "model.onnx"), providers=["CPUExecutionProvider"])
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.ones_like(ids) if mask is None else np.asarray(mask, dtype=np.int64)
    (logits,) = session.run(["logits"], {"input_ids": ids, "attention_mask": mask})
    return logits


def in_own_process(code: str, *args: str) -> object:
    """Run `code` (Python) in a process of its own; what it prints, as JSON. For the third-party gRPC clients
    (tritonclient.grpc, KServe's): their generated modules and ours define the same protocol buffer messages
    (`inference.*`), which one process's default descriptor pool takes only once."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def v2_tensor(name: str, data, datatype: str = "INT64", shape=None) -> dict:
    """A v2 JSON input tensor with flat row-major data (shape from the nested data unless given)."""
    import numpy as np

    array = np.asarray(data)
    return {
        "name": name,
        "datatype": datatype,
        "shape": list(array.shape) if shape is None else shape,
        "data": array.ravel().tolist(),
    }


@contextlib.contextmanager
def serve_command(args: list[str], log: Path, ready_s: float = 180) -> Iterator[str]:
    """`mha-serving serve ARGS` started as a user starts it (its output in `log`); yields its start-up summary once
    it is ready, then stops it with SIGTERM and checks that it exits cleanly."""
    with serve_process(args, log, ready_s) as (_, text):
        yield text


@contextlib.contextmanager
def serve_process(
    args: list[str],
    log: Path,
    ready_s: float = 180,
    env: dict[str, str] | None = None,
    hangup_after: str | None = None,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`serve_command`, yielding the process too (to signal it); `env`: added to the environment; `hangup_after`: a
    SIGHUP sent once this is in the log, before the server is ready."""
    cmd = [sys.executable, "-m", "service.cli", "serve", *args]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=environment)
    try:
        deadline = time.monotonic() + ready_s
        while "Ctrl-C to stop" not in (text := log.read_text()):
            assert proc.poll() is None, text
            assert time.monotonic() < deadline, f"not ready after {ready_s:.0f} s:\n" + text
            if hangup_after is not None and hangup_after in text:
                proc.send_signal(signal.SIGHUP)
                hangup_after = None
            time.sleep(0.1 if hangup_after else 0.5)
        yield proc, log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=90)
    assert code == 0, log.read_text()


def refs(node) -> Iterator[str]:
    """Every `$ref` in a JSON document (an OpenAPI document, say)."""
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


def resolved(document: dict, ref: str):
    """What a local `$ref` (`#/components/...`) points at in `document`; None where nothing is."""
    node = document
    for part in ref.removeprefix("#/").split("/"):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node
