"""A real multi-node Ray cluster on this machine, started as KubeRay starts its pods (`ray start --block` per node,
each with its own temp dir and ports, every node on 127.0.0.1) and deployed to as KubeRay does (`serve deploy` of
deploy/serve_config.yaml through the dashboard). Only processes a cluster started are signalled, found by PID: its
nodes' process trees, what names their temp dirs and what carries their marker. Loopback only. No torch, no Ray
imported (Ray runs in the processes it starts).
"""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from benchmarks.harness.processes import descendants, pids_mentioning, pids_with_env, signal_all
from benchmarks.harness.sockets import tcp_sockets
from service.haproxy_nosplice import BINARY_PATH_VAR
from service.http.limits import PROXY_LIMITS_ENV
from service.limits import MAX_BODY_BYTES
from service.local.ports import free_port
from service.local.ray_env import CLUSTER_RAY_ENV, GRPC_PROXY_LIMIT_VAR, HAPROXY_PROGRAM

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent  # the venv's `ray` and `serve`, unactivated
SERVE_CONFIG = ROOT / "deploy" / "serve_config.yaml"
# Set to the node's temp dir in every process a node starts: Ray hands its environment down to the workers, whose
# command lines (renamed after their actors) no longer name the temp dir.
NODE_MARKER = "MHA_LOCAL_CLUSTER_NODE"
SERVE_PORT_SPAN = 100  # each of a cluster's ranges for the replicas' own servers (Serve tries the next if taken)


def way_in(extra_env: dict[str, str]) -> str:
    """The actor class of a node's way in on a cluster started with `extra_env` over the pods' settings: the manager
    of HAProxy where Serve's HAProxy ingress stays on (the pods' setting: any value but 1 turns it off), else Serve's
    proxy."""
    on = {**CLUSTER_RAY_ENV, **extra_env}.get("RAY_SERVE_ENABLE_HA_PROXY") == "1"
    return "HAProxyManager" if on else "ProxyActor"


@dataclass
class Node:
    """One `ray start --block` process (its Ray processes are its descendants) and its own temp dir."""

    name: str
    proc: subprocess.Popen
    temp_dir: Path


@dataclass
class LocalCluster:
    root: Path
    nodes: list[Node] = field(default_factory=list)
    gcs_port: int = field(default_factory=free_port)
    dashboard_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    # HAProxy's own metrics and stats ports: fixed by default (9101, 8404), so two clusters on one machine would clash
    haproxy_ports: tuple[int, int] = field(default_factory=lambda: (free_port(), free_port()))
    # Serve's fixed ranges too: the replicas' own HTTP and gRPC servers from 30000 and 40000, the head's fallback
    # proxy on 8500 and 9500. Two clusters' HAProxies would forward to each other's replicas.
    serve_ports: tuple[int, int, int, int] = field(default_factory=lambda: tuple(free_port() for _ in range(4)))
    extra_env: dict[str, str] = field(default_factory=dict)  # for every node, last: wins over the settings below

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            **PROXY_LIMITS_ENV,  # as the image sets it
            # as the image sets it (IMAGE_HAPROXY_ENV): this install's program
            BINARY_PATH_VAR: str(Path(sys.executable).with_name(HAPROXY_PROGRAM)),
            **CLUSTER_RAY_ENV,  # as deploy/k8s/base/rayservice.yaml sets it on every pod
            GRPC_PROXY_LIMIT_VAR: str(MAX_BODY_BYTES),  # as the pods set it: deploy/serve_config.yaml's body limit
            "RAY_AUTH_MODE": "disabled",  # trusted local setup on 127.0.0.1 (Ray 2.60 defaults to token auth)
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_health_check_period_ms": "1000",  # notice a killed node in seconds, not tens of seconds
            "RAY_health_check_failure_threshold": "3",
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(self.haproxy_ports[0]),
            "RAY_SERVE_HAPROXY_STATS_PORT": str(self.haproxy_ports[1]),
            **self._serve_ports_env(),
            **self.extra_env,
        }

    def _serve_ports_env(self) -> dict[str, str]:
        http, grpc, fallback_http, fallback_grpc = self.serve_ports
        return {
            "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(http),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(http + SERVE_PORT_SPAN),
            "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": str(grpc),
            "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": str(grpc + SERVE_PORT_SPAN),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc),
        }

    @property
    def proxy_class(self) -> str:
        """The actor class of a node's way in: the manager of HAProxy where Serve's HAProxy ingress is on (the pods'
        setting), else Serve's proxy."""
        return way_in(self.extra_env)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def start(self, name: str, cpus: float, gpus: float, head: bool = False) -> Node:
        temp_dir = Path(tempfile.mkdtemp(prefix=f"{name[:3]}", dir=self.root))
        ports = {
            "--node-manager-port": free_port(),
            "--object-manager-port": free_port(),
            "--metrics-export-port": free_port(),
            "--dashboard-agent-listen-port": free_port(),
            "--dashboard-agent-grpc-port": free_port(),
            "--runtime-env-agent-port": free_port(),
        }
        args = [str(BIN / "ray"), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
        args += [f"--num-cpus={math.ceil(cpus)}", f"--num-gpus={math.ceil(gpus)}", "--object-store-memory=100000000"]
        args += [f"--temp-dir={temp_dir}", *(f"{flag}={port}" for flag, port in ports.items())]
        if head:
            args += ["--head", f"--port={self.gcs_port}", f"--ray-client-server-port={free_port()}"]
            # `serve deploy` (like KubeRay) submits through the dashboard's REST API: loopback only
            args += [
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={self.dashboard_port}",
            ]
        else:
            args += [f"--address=127.0.0.1:{self.gcs_port}"]
        env = {**self.env, NODE_MARKER: str(temp_dir)}
        if not os.access(program := env[BINARY_PATH_VAR], os.X_OK):  # Serve would fail HAProxy's start on every node
            raise RuntimeError(f"{program} is not installed: `make venv` installs it (pyproject.toml's scripts)")
        log = (self.root / f"{name}.log").open("ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        node = Node(name, proc, temp_dir)
        self.nodes.append(node)
        return node

    def start_alive(
        self, name: str, cpus: float, gpus: float, head: bool = False, attempts: int = 3, timeout_s: float = 240.0
    ) -> Node:
        """`start`, then wait until the node is alive. A `ray start` that exits first (its raylet gave up, e.g. on
        its dashboard agent slow to start on busy cores) is cleaned up and started again, as Kubernetes restarts a
        pod's container, up to `attempts` times; its log keeps every attempt."""
        before = 0 if head else len(self.alive_nodes())
        for _ in range(attempts):
            node = self.start(name, cpus, gpus, head)
            deadline = time.monotonic() + timeout_s
            while node.proc.poll() is None:
                if self._alive_count() > before:
                    return node
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {name} not alive after {timeout_s:g} s; see {self.root / name}.log")
                time.sleep(1)
            self.kill(node, grace_s=5)  # what the failed start left behind
            self.nodes.remove(node)
        raise RuntimeError(f"`ray start` of node {name} exited {attempts} times; see {self.root / name}.log")

    def _alive_count(self) -> int:
        try:
            return len(self.alive_nodes())
        except httpx.HTTPError:  # the head's dashboard not up yet
            return 0

    def kill(self, node: Node, sig: int = signal.SIGKILL, grace_s: float = 20) -> float:
        """Every process of this node (`processes`), like a pod that disappears; SIGKILL for what is left after
        `grace_s`. Returns the monotonic time the signals went out."""
        pids = self.processes(node)
        sent = time.monotonic()
        signal_all(sorted(pids), sig)
        try:
            node.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            signal_all(descendants(node.proc.pid), signal.SIGKILL)
            node.proc.wait(timeout=10)
        return sent

    def stop(self) -> None:
        for node in reversed(self.nodes):
            if node.proc.poll() is None:
                self.kill(node, signal.SIGTERM, grace_s=3)  # `ray start --block` took 20 s to give up on its GCS
        time.sleep(1)
        leftovers = {p for n in self.nodes for p in self.processes(n)}
        signal_all(sorted(leftovers), signal.SIGKILL)

    def processes(self, node: Node) -> set[int]:
        """Every process of `node`: its tree, what names its temp dir, what carries its marker."""
        tree = descendants(node.proc.pid) if node.proc.poll() is None else []
        return {*tree, *pids_mentioning(str(node.temp_dir)), *pids_with_env(NODE_MARKER, str(node.temp_dir))}

    def owns(self, pid: int) -> bool:
        """Whether `pid` is one of this cluster's processes: one it may signal."""
        return any(pid in self.processes(node) for node in self.nodes)

    def listener(self, port: int) -> int | None:
        """The pid of this cluster's process listening on `port` (the lowest, where several share it), or None."""
        pids = sorted({p for node in self.nodes for p in self.processes(node)})
        return min((s.pid for s in tcp_sockets(pids) if s.listening and s.port == port), default=None)

    def deploy(self, config: dict, timeout_s: float = 120) -> subprocess.CompletedProcess:
        """`serve deploy` of `config` (written next to the nodes' logs) through the head's dashboard."""
        config_file = self.root / "serve_config.yaml"
        config_file.write_text(yaml.safe_dump(config))
        return subprocess.run(
            [str(BIN / "serve"), "deploy", str(config_file), "--address", self.dashboard],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def get(self, path: str, params: list[tuple[str, str]] | None = None) -> dict:
        response = httpx.get(f"{self.dashboard}{path}", params=params, timeout=10)
        response.raise_for_status()
        return response.json()

    def alive_nodes(self) -> list[dict]:
        nodes = self.get("/api/v0/nodes?limit=100")["data"]["result"]["result"]
        return [n for n in nodes if n["state"] == "ALIVE"]

    def serve_details(self) -> dict:
        """Serve's instance details (ray.serve.schema.ServeInstanceDetails): controller, proxies, applications."""
        return self.get("/api/serve/applications/")

    def replicas(self, app: str) -> dict[str, list[dict]]:
        deployments = self.serve_details()["applications"][app]["deployments"]
        return {name: [r for r in d["replicas"] if r["state"] == "RUNNING"] for name, d in deployments.items()}

    def actors(self, class_name: str) -> list[dict]:
        """The alive actors of `class_name` (ServeController, ProxyActor, ...), from Ray's state API: each with its
        `pid`, `node_id` and `actor_id`."""
        filters = [("class_name", class_name), ("state", "ALIVE")]
        params = [("limit", "1000")]
        for key, value in filters:
            params += [("filter_keys", key), ("filter_predicates", "="), ("filter_values", value)]
        return self.get("/api/v0/actors", params)["data"]["result"]["result"]


def head_only_config(http_port: int, grpc_port: int) -> dict:
    """deploy/serve_config.yaml with what every cluster on one machine must change: the HTTP and gRPC proxies on the
    head only (two nodes on one host cannot both listen on one port), on loopback and on these ports."""
    config = copy.deepcopy(yaml.safe_load(SERVE_CONFIG.read_text()))
    config["proxy_location"] = "HeadOnly"
    config["http_options"] = {**config["http_options"], "host": "127.0.0.1", "port": http_port}
    config["grpc_options"] = {**config["grpc_options"], "port": grpc_port}
    return config
