"""`python -m benchmarks.cluster_faults`: faults of a real two-node Ray cluster under steady load (issue 28, item 3).

A head and a worker node on this machine (benchmarks/harness/cluster.py, as the cluster test starts them), deployed
with `serve deploy` of deploy/serve_config.yaml adapted to two small models: model A co-located in the ingress, model B
in its own deployment, two replicas of each deployment, one on each node; Serve's proxy on the head. A load client in a
process of its own (benchmarks/cluster_faults_load.py) sends an open loop of predicts over both models to the proxy
throughout. Then, each after `--settle` s of steady load and observed for `--observe` s: SIGKILL of one replica of
B, of Serve's controller, of the head's proxy, and of the whole worker node (then a replacement node joins). After
each, the run waits until nothing stays broken. Per fault: requests in flight at it, failed at a first attempt, lost
after the client's retries, when the full rate was back, latency; and the bar's verdict
(benchmarks/cluster_faults_analysis.py). report.md, report.json and requests.csv in runs/cluster-faults/<date-time>/;
exit status 1 when a bar line fails. Loopback only. No torch (missing models are exported by a subprocess).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path

import httpx
import yaml

from benchmarks.bar import Line, verdict_table
from benchmarks.cluster_faults_analysis import (
    BACK_WITHIN_S,
    FULL_SHARE,
    HOLD_BINS,
    PROMPT_S,
    FaultSpan,
    analyse,
    fault_lines,
    read_records,
    steady_line,
    table,
)
from benchmarks.cluster_faults_load import RETRYABLE, LoadPlan, run_client
from benchmarks.harness.cluster import LocalCluster, Node, head_only_config
from benchmarks.harness.polling import predicts_ok, until
from contract.metadata import MODEL_FILE

APP = "mha"  # the application's name in deploy/serve_config.yaml
INGRESS = "ingress"  # service.config.INGRESS_NAME (not imported: service.config would bring pydantic's import time)
REPLICAS = 2  # of the ingress and of B: one per node
CPU_TEMPLATE, GPU_TEMPLATE = "mha-h1-d512", "mha-h8-d512"  # real head configurations whose settings A and B take
FAULTS = ("replica", "controller", "proxy", "node")
WARMUP_S = 5.0  # of load before the first fault's steady window: connections opened, every replica warm
SMALL = re.compile(r"mha-h(\d+)-d(\d+)")  # a model name the benchmarks export on demand (2 layers, 128 tokens)
MACHINE = (
    f"both Ray nodes, the load client (a process of its own) and this driver share this machine's {os.cpu_count()} CPUs"
)


class FaultRunError(RuntimeError):
    """The run cannot go on: the cluster did not start, a fault could not be injected, the client died."""


# ---- the models and the application ----
def ensure_models(models_dir: Path, names: list[str]) -> None:
    """Export each missing `mha-hH-dD` model as benchmarks/serving.py's small one (2 layers, 128 tokens), through
    `mha-serving export` in a subprocess (torch stays out of this process)."""
    for name in names:
        if (models_dir / name / MODEL_FILE).is_file():
            continue
        match = SMALL.fullmatch(name)
        if match is None:
            raise FaultRunError(f"no {name} in {models_dir}, and only mha-hH-dD names are exported on demand")
        heads, d_model = match.groups()
        cmd = [sys.executable, "-m", "service.cli", "export", "--heads", heads, "--d-model", d_model]
        cmd += ["--layers", "2", "--max-len", "128", "--out", str(models_dir)]
        print(f"exporting {name}: {' '.join(cmd[2:])}", flush=True)
        if subprocess.call(cmd) != 0 or not (models_dir / name / MODEL_FILE).is_file():
            raise FaultRunError(f"could not export {name} into {models_dir}")


def faults_config(models_dir: Path, model_a: str, model_b: str, http_port: int, grpc_port: int) -> dict:
    """deploy/serve_config.yaml on this machine: A takes a real CPU head configuration's settings (co-located in the
    ingress), B a real GPU one's in its own deployment (backend auto: no CUDA here); the ingress and B at REPLICAS
    fixed replicas each (no autoscaling: a target to be back at), B's replicas asking for a whole logical GPU each;
    the proxies on the head (as the cluster test)."""
    config = head_only_config(http_port, grpc_port)
    (app,) = config["applications"]
    args = app["args"]
    templates = args["overrides"]
    args["models_dir"] = str(models_dir.resolve())
    args["models"] = [model_a, model_b]
    ingress = {k: v for k, v in args["ingress"].items() if k != "autoscaling"}
    args["ingress"] = {**ingress, "num_replicas": REPLICAS}
    b = {**templates[GPU_TEMPLATE], "backend": "auto", "num_replicas": REPLICAS, "num_gpus": 1}
    args["overrides"] = {model_a: templates[CPU_TEMPLATE], model_b: b}
    return config


def node_resources(config: dict) -> tuple[float, float]:
    """(CPUs, GPUs) each node advertises: one ingress replica and one replica of B exactly. Two ingress replicas
    do not fit on one node (CPUs), nor two of B (one logical GPU): Ray must put one of each on each node."""
    args = config["applications"][0]["args"]
    ingress, b = args["ingress"], args["overrides"][args["models"][1]]
    assert b["placement"] == "deployment" and args["overrides"][args["models"][0]]["placement"] == "colocated"
    assert ingress["num_cpus"] > b["num_cpus"] / 2 and b["num_gpus"] == 1, "the placement relies on these"
    return ingress["num_cpus"] + b["num_cpus"], b["num_gpus"]


def targets(config: dict) -> dict[str, int]:
    args = config["applications"][0]["args"]
    return {
        INGRESS: args["ingress"]["num_replicas"],
        args["models"][1]: args["overrides"][args["models"][1]]["num_replicas"],
    }


# ---- what is broken ----
def problems(cluster: LocalCluster, models: list[str], want: dict[str, int], dead: set[int]) -> list[str]:
    """What is not as it should be: the application RUNNING, each deployment HEALTHY with its target of RUNNING
    replicas on as many nodes, one controller and one proxy (HEALTHY), every model answering 200 through the proxy,
    and none of these in a process that was killed (`dead`: Serve may still list it before it notices)."""
    try:
        details = cluster.serve_details()
        controllers, proxies = cluster.actors("ServeController"), cluster.actors("ProxyActor")
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        return [f"Ray's dashboard: {exc!r}"]
    found = []
    app = (details.get("applications") or {}).get(APP)
    if app is None:
        found.append(f"no application {APP!r}")
    else:
        if app["status"] != "RUNNING":
            found.append(f"application {app['status']}")
        for name, target in want.items():
            d = app["deployments"].get(name)
            if d is None:
                found.append(f"no deployment {name}")
                continue
            running = [r for r in d["replicas"] if r["state"] == "RUNNING"]
            nodes = {r["node_id"] for r in running}
            if d["status"] != "HEALTHY":
                found.append(f"{name} {d['status']}")
            if len(running) != target or len(nodes) != target:
                found.append(f"{name}: {len(running)} replicas RUNNING on {len(nodes)} nodes (target {target})")
            if any(r.get("pid") in dead for r in running):
                found.append(f"{name}: a killed replica still listed RUNNING")
    for kind, alive in (("ServeController", controllers), ("ProxyActor", proxies)):
        if len(alive) != 1 or alive[0]["pid"] in dead:
            found.append(f"{kind}: {[a['pid'] for a in alive]} alive")
    unhealthy = {
        node[:8]: p["status"] for node, p in (details.get("proxies") or {}).items() if p["status"] != "HEALTHY"
    }
    if unhealthy:
        found.append(f"proxies {unhealthy}")
    found += [f"{m} does not answer 200" for m in models if not predicts_ok(cluster.http_port, m)]
    return found


def wait_healthy(
    cluster: LocalCluster, models: list[str], want: dict[str, int], dead: set[int], since: float, timeout_s: float
) -> tuple[float | None, tuple[str, ...]]:
    """Seconds from `since` until `problems` found none, checked every second for `timeout_s`; (None, what was
    still broken) past it."""
    deadline, left = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline:
        try:
            left = problems(cluster, models, want, dead)
        except Exception as exc:  # an answer of an unexpected shape (a restarting controller's): not there yet
            left = [f"reading Serve's state: {exc!r}"]
        if not left:
            return time.monotonic() - since, ()
        time.sleep(1.0)
    return None, tuple(left)


# ---- the faults ----
def ours(cluster: LocalCluster, pid: int, what: str) -> int:
    if not cluster.owns(pid):
        raise FaultRunError(f"{what} runs in pid {pid}, not one of this run's Ray processes: not killing it")
    return pid


def head_id(cluster: LocalCluster) -> str:
    (head,) = [n["node_id"] for n in cluster.alive_nodes() if n["is_head_node"]]
    return head


def replica_victim(cluster: LocalCluster, deployment: str) -> tuple[int, str]:
    """B's replica on the worker node: (pid, words)."""
    head = head_id(cluster)
    (replica,) = [r for r in cluster.replicas(APP)[deployment] if r["node_id"] != head]
    pid = ours(cluster, replica["pid"], f"replica {replica['replica_id']}")
    return pid, f"SIGKILL to the process of {deployment}'s replica on the worker node (pid {pid})"


def actor_victim(cluster: LocalCluster, class_name: str, words: str) -> tuple[int, str]:
    """The one alive actor of `class_name` on the head: (pid, words)."""
    head = head_id(cluster)
    alive = [a for a in cluster.actors(class_name) if a["node_id"] == head]
    if len(alive) != 1:
        raise FaultRunError(f"{len(alive)} alive {class_name} actors on the head, not one")
    pid = ours(cluster, alive[0]["pid"], class_name)
    return pid, f"SIGKILL to {words} (pid {pid})"


def pause(seconds: float, client: multiprocessing.Process) -> None:
    """Sleep, making sure the load client is still there."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not client.is_alive():
            raise FaultRunError(f"the load client exited (status {client.exitcode})")
        time.sleep(min(0.5, left))


class Run:
    """The cluster's state through the run and the timeline of what was done to it."""

    def __init__(self, cluster: LocalCluster, config: dict, args: argparse.Namespace) -> None:
        self.cluster, self.config, self.args = cluster, config, args
        self.models = list(config["applications"][0]["args"]["models"])
        self.want = targets(config)
        self.cpus, self.gpus = node_resources(config)
        self.workers = 0
        self.spans: list[dict] = []  # one per fault: start, at, observe_end, quiet_until (node), recovered, problems
        self.after: tuple[float, float] | None = None
        self.interrupted = ""

    def start_worker(self) -> Node:
        self.workers += 1
        return self.cluster.start(f"worker-{self.workers}", self.cpus, self.gpus)

    def start(self) -> None:
        cluster, timeout_s = self.cluster, self.args.step_timeout
        print(f"two nodes of {self.cpus:g} CPUs and {self.gpus:g} logical GPU each...", flush=True)
        cluster.start("head", self.cpus, self.gpus, head=True)
        until("the head's dashboard", cluster.alive_nodes, timeout_s)
        self.start_worker()
        until("two alive nodes", lambda: len(cluster.alive_nodes()) == 2, timeout_s)
        print("serve deploy...", flush=True)
        deployed = cluster.deploy(self.config)
        if deployed.returncode != 0:
            raise FaultRunError(f"serve deploy failed: {deployed.stdout + deployed.stderr}")
        took, left = wait_healthy(cluster, self.models, self.want, set(), time.monotonic(), timeout_s)
        if took is None:
            raise FaultRunError(f"the application did not come up, one replica of each deployment per node: {left}")
        print(f"deployed; every check passed after {took:.0f} s: {self.placement()}", flush=True)

    def placement(self) -> str:
        head = head_id(self.cluster)
        where = {
            name: sorted("head" if r["node_id"] == head else "worker" for r in replicas)
            for name, replicas in self.cluster.replicas(APP).items()
        }
        return ", ".join(f"{name} on {' and '.join(nodes)}" for name, nodes in where.items())

    def inject(self, fault: str) -> tuple[float, set[int], str]:
        """The fault, now: (its instant, the pids it killed, what it was)."""
        cluster = self.cluster
        if fault == "node":
            (worker,) = [n for n in cluster.nodes if n.name.startswith("worker") and n.proc.poll() is None]
            dead = cluster.processes(worker)
            at = cluster.kill(worker)
            return at, dead, f"SIGKILL to every process of node {worker.name} (its raylet and workers: a pod lost)"
        victims = {
            "replica": lambda: replica_victim(cluster, self.models[1]),
            "controller": lambda: actor_victim(cluster, "ServeController", "Serve's controller"),
            "proxy": lambda: actor_victim(cluster, "ProxyActor", "the head's Serve proxy (HTTP and gRPC)"),
        }
        pid, what = until(f"the {fault} to kill", victims[fault], 30)
        at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return at, {pid}, what

    def fault(self, fault: str, client: multiprocessing.Process) -> bool:
        """One fault: steady load, the fault, observed, then the wait for nothing broken; whether it recovered."""
        args = self.args
        start = time.monotonic()
        print(f"[{fault}] {args.settle:g} s of steady load...", flush=True)
        pause(args.settle, client)
        at, dead, what = self.inject(fault)
        print(f"[{fault}] {what}", flush=True)
        quiet_until = None
        if fault == "node":  # the survivors alone for the observe window, then a new node (a new pod) joins
            pause(at + args.observe - time.monotonic(), client)
            quiet_until = time.monotonic()
            replacement = self.start_worker()
            print(f"[{fault}] {replacement.name} started", flush=True)
        recovered, left = wait_healthy(self.cluster, self.models, self.want, dead, at, args.recover_timeout)
        pause(at + args.observe - time.monotonic(), client)
        observe_end = time.monotonic()
        passed = f"every check passed {recovered:.1f} s after the fault" if recovered is not None else ""
        print(f"[{fault}] {passed or f'still broken: {left}'}", flush=True)
        self.spans.append(
            {"name": fault, "what": what, "start": start, "at": at, "observe_end": min(observe_end, at + args.observe)}
            | {"quiet_until": quiet_until, "recovered_s": recovered, "problems": left}
        )
        return recovered is not None

    def spans_with_ends(self, end: float) -> list[FaultSpan]:
        """The faults' spans, each ending where the next one's (or the steady window after the last) starts."""
        starts = [s["start"] for s in self.spans[1:]] + [self.after[0] if self.after else end]
        return [
            FaultSpan(
                name=s["name"],
                what=s["what"],
                start=s["start"],
                at=s["at"],
                observe_end=s["observe_end"],
                quiet_until=s["quiet_until"] if s["quiet_until"] is not None else stop,
                end=stop,
                recovered_s=s["recovered_s"],
                problems=tuple(s["problems"]),
            )
            for s, stop in zip(self.spans, starts, strict=True)
        ]


def drive(run: Run, plan: LoadPlan) -> tuple[float, float]:
    """The load client started, every fault in turn, a steady window after the last; (load start, load end)."""
    args = run.args
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    client = context.Process(target=run_client, args=(plan, stop), name="cluster-faults-client", daemon=True)
    client.start()
    try:
        print(f"load: {plan.rate:g} requests/s over {', '.join(plan.models)}; {WARMUP_S:g} s of warm-up", flush=True)
        pause(plan.t0 + WARMUP_S - time.monotonic(), client)
        for fault in args.faults:
            if not run.fault(fault, client):
                run.interrupted = f"the cluster did not recover from the {fault} fault: later faults not run"
                break
        else:
            after = time.monotonic()
            print(f"[after] {args.settle:g} s of steady load...", flush=True)
            pause(args.settle, client)
            run.after = (after, time.monotonic())
    except KeyboardInterrupt:
        run.interrupted = "interrupted (Ctrl-C)"
    except (FaultRunError, TimeoutError) as exc:
        run.interrupted = str(exc)
    except Exception as exc:  # a bug or an unexpected answer: what was measured so far is still reported
        traceback.print_exc()
        run.interrupted = f"unexpected error: {exc!r}"
    finally:
        end = time.monotonic()
        stop.set()
        # every request ends within its attempts' timeouts and backoffs
        client.join((args.retries + 1) * (args.timeout + 1) + 30)
        if client.is_alive():
            client.terminate()
    return plan.t0, end


# ---- the report ----
def head_text(command: str, started: str, run: Run, plan: LoadPlan) -> str:
    args = run.args
    a, b = run.models
    text = [
        f"# Cluster faults under load, {started}",
        f"`{command}`; {MACHINE}.",
        f"Two Ray nodes on 127.0.0.1 (`ray start`, {run.cpus:g} CPUs and {run.gpus:g} logical GPU each), "
        f"`serve deploy` of deploy/serve_config.yaml with {a} co-located in the ingress (the settings of "
        f"{CPU_TEMPLATE}) and {b} in its own deployment (those of {GPU_TEMPLATE}, backend auto); {REPLICAS} fixed "
        f"replicas of the ingress and of {b}, one of each per node; Serve's proxy on the head only. Each pod's Ray "
        f"settings (PROXY_LIMITS_ENV, BOUNDED_METRICS_ENV), Ray's node health checks every 1 s (3 misses)"
        + (
            f"; extra: {', '.join(f'{k}={v}' for k, v in run.cluster.extra_env.items())}"
            if run.cluster.extra_env
            else ""
        )
        + ".",
        f"Load: an open loop of {plan.rate:g} simple-JSON predicts per second, the two models in turn, through the "
        f"proxy; each attempt times out after {plan.timeout_s:g} s; a request is retried up to {plan.retries} times "
        f"(backoff {plan.backoff_s:g} s, doubled each time) on {', '.join(sorted(RETRYABLE))}. Inference is "
        "idempotent: a retry is safe. First-attempt figures are what a client without retries sees, after-retries "
        "figures what a client with these retries sees.",
        f"Each fault: {args.settle:g} s of steady load, the fault, {args.observe:g} s observed, and the wait (up to "
        f"{args.recover_timeout:g} s) until every check passes. The worker node's replacement starts "
        f"{args.observe:g} s after its loss. A fault's span runs from its steady load to the next one's: every "
        "request sent in it counts.",
        f"Definitions: in flight at the fault = first attempts begun before it and not ended (all of them: which "
        f"were on what died is not known, so this bounds it from above). Full rate per second of scheduled send "
        f"times: >= {FULL_SHARE:.0%} of the requests due that second answered 200 at the first attempt within "
        f"{PROMPT_S:g} s; back = the first second from which every second to the span's end (or the replacement "
        f"node's start) is full, at least {HOLD_BINS} of them. Longest gap: no 200 ending at a first attempt, over "
        "the same span. Latency from the scheduled send, requests answered 200 after retries.",
    ]
    if run.interrupted:
        text.append(f"**Cut short: {run.interrupted}.**")
    return "\n\n".join(text)


def timeline_text(spans: list[FaultSpan], t0: float, after: tuple[float, float] | None, end: float) -> str:
    rows = [
        "| fault | what | steady from | fault at | observed to | span ends |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    rows += [
        f"| {s.name} | {s.what} | {s.start - t0:.1f} | {s.at - t0:.1f} | {s.observe_end - t0:.1f} | {s.end - t0:.1f} |"
        for s in spans
    ]
    tail = f"Steady after the faults: {after[0] - t0:.1f} to {after[1] - t0:.1f} s." if after else ""
    return "\n".join(rows) + f"\n\nSeconds from the load's start; the load ended at {end - t0:.1f} s. {tail}"


def report(run: Run, plan: LoadPlan, load: tuple[float, float], out: Path, command: str, started: str) -> bool:
    """report.md and report.json from requests.csv and the timeline; the table and verdict printed; whether every
    line passed."""
    records = read_records(plan.out) if plan.out.is_file() else []
    t0, end = load
    spans = run.spans_with_ends(end)
    results = [analyse(records, s) for s in spans]
    lines: list[Line] = []
    if spans:
        first = spans[0]
        lines.append(steady_line("steady before the faults", records, first.start, first.at))
    for result in results:
        lines += fault_lines(result)
    done = {s.name for s in spans}
    lines += [Line(f"{f}: not run", "", "every fault run", False) for f in run.args.faults if f not in done]
    if run.after:
        lines.append(steady_line("steady after the faults", records, *run.after))
    else:
        lines.append(Line("steady after the faults", "not reached", "every request answered, at the full rate", False))
    passed = bool(records) and all(x.ok for x in lines) and not run.interrupted
    text = "\n\n".join(
        [
            head_text(command, started, run, plan),
            f"## Verdict: {'pass' if passed else 'FAIL'}",
            verdict_table(lines),
            "## Per fault",
            table(results),
            "## Timeline",
            timeline_text(spans, t0, run.after, end),
        ]
    )
    (out / "report.md").write_text(text + "\n")
    result = {
        "started": started,
        "command": command,
        "machine": MACHINE,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(run.args).items()},
        "nodes": {"cpus": run.cpus, "gpus": run.gpus},
        "requests": len(records),
        "faults": [asdict(r) | {"span": asdict(s)} for r, s in zip(results, spans, strict=True)],
        "after": run.after,
        "lines": [asdict(x) for x in lines],
        "passed": passed,
        "interrupted": run.interrupted,
    }
    (out / "report.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\n{table(results)}\n\n{verdict_table(lines)}")
    return passed


def keep_logs(cluster: LocalCluster, out: Path) -> None:
    """The nodes' `ray start` output and Serve's logs (controller, proxy, replicas), into out/logs/."""
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    for log in cluster.root.glob("*.log"):
        shutil.copy(log, logs / log.name)
    for node in cluster.nodes:
        serve = node.temp_dir / "session_latest" / "logs" / "serve"
        if serve.is_dir():
            shutil.copytree(serve, logs / f"{node.name}-serve", dirs_exist_ok=True)


# ---- the command line ----
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster_faults", description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=Path("runs/bench-models"), help="where the models live")
    p.add_argument(
        "--model-a", default="mha-h2-d128", help="co-located in the ingress (default: mha-h2-d128, exported if missing)"
    )
    p.add_argument(
        "--model-b",
        default="mha-h4-d128",
        help="in its own deployment, one replica per node (default: mha-h4-d128, exported if missing)",
    )
    p.add_argument("--rate", type=float, default=40.0, help="requests per second, open loop (default: 40)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per attempt (default: 10)")
    p.add_argument("--retries", type=int, default=5, help="retries of a request after its first attempt (default: 5)")
    p.add_argument(
        "--backoff", type=float, default=0.25, help="seconds before the first retry, doubled (default: 0.25)"
    )
    p.add_argument("--settle", type=float, default=10.0, help="seconds of steady load before each fault (default: 10)")
    p.add_argument("--observe", type=float, default=30.0, help="seconds observed after each fault (default: 30)")
    p.add_argument(
        "--recover-timeout", type=float, default=180.0, help="seconds to wait for nothing broken (default: 180)"
    )
    p.add_argument(
        "--step-timeout", type=float, default=240.0, help="seconds for the cluster to come up (default: 240)"
    )
    p.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"which, in this order (default: {','.join(FAULTS)})",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for every Ray node, repeatable (e.g. RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S=2)",
    )
    p.add_argument("--out", type=Path, help="where the report goes (default: runs/cluster-faults/<date-time>/)")
    args = p.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown or not args.faults:
        p.error(f"--faults: choose among {', '.join(FAULTS)}, got {args.faults}")
    if args.rate <= 0 or args.timeout <= 0 or args.retries < 0 or args.backoff < 0:
        p.error("--rate and --timeout must be above 0, --retries and --backoff at least 0")
    if args.settle < HOLD_BINS or args.observe < BACK_WITHIN_S + HOLD_BINS:
        p.error(f"--settle must be at least {HOLD_BINS} s and --observe at least {BACK_WITHIN_S + HOLD_BINS:g} s")
    if args.model_a == args.model_b:
        p.error("--model-a and --model-b must differ")
    if any("=" not in e for e in args.env):
        p.error("--env takes KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path("runs/cluster-faults") / f"{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        ensure_models(args.models, [args.model_a, args.model_b])
    except FaultRunError as exc:
        print(exc, file=sys.stderr)
        return 1
    command = " ".join(["python -m benchmarks.cluster_faults", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.now().isoformat(timespec="seconds")
    root = Path(tempfile.mkdtemp(prefix="rcf", dir="/tmp"))  # short: Ray's socket paths live under it
    cluster = LocalCluster(root, extra_env=dict(e.split("=", 1) for e in args.env))
    config = faults_config(args.models, args.model_a, args.model_b, cluster.http_port, cluster.grpc_port)
    (out / "serve_config.yaml").write_text(yaml.safe_dump(config))
    run = Run(cluster, config, args)
    plan = LoadPlan(
        url=f"http://127.0.0.1:{cluster.http_port}",
        models=tuple(run.models),
        rate=args.rate,
        timeout_s=args.timeout,
        retries=args.retries,
        backoff_s=args.backoff,
        t0=0.0,
        out=out / "requests.csv",
    )
    print(f"{MACHINE}; Ray's files under {root}", flush=True)
    load = (0.0, 0.0)
    try:
        run.start()
        plan = replace(plan, t0=time.monotonic() + 3.0)  # the client's process is started (spawned) meanwhile
        load = drive(run, plan)
    except (FaultRunError, TimeoutError) as exc:  # TimeoutError: a wait for the cluster (polling.until)
        run.interrupted = str(exc)
        print(f"cannot go on: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        run.interrupted = "interrupted (Ctrl-C)"
    finally:
        cluster.stop()
        try:
            keep_logs(cluster, out)
        except OSError as exc:
            print(f"could not keep Ray's logs: {exc}", file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
    if not run.spans:
        print(f"no fault was measured: {run.interrupted or 'the run ended early'}; logs in {out}/logs", file=sys.stderr)
        return 1
    passed = report(run, plan, load, out, command, started)
    print(f"\nwrote {out}/report.md, report.json, requests.csv and logs/")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
