"""The faults and the run through them: each fault's victim found among this run's own Ray processes and killed after
steady load, observed, then waited on until nothing is broken; the load client driven throughout."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import time
import traceback

from benchmarks.cluster_faults.analysis import FaultSpan
from benchmarks.cluster_faults.application import APP, INGRESS, node_resources, targets
from benchmarks.cluster_faults.health import wait_healthy
from benchmarks.cluster_faults.load import LoadPlan, run_client
from benchmarks.harness.cluster import LocalCluster, Node
from benchmarks.harness.polling import until

FAULTS = ("replica", "ingress", "controller", "proxy", "haproxy", "node")


WARMUP_S = 5.0  # of load before the first fault's steady window: connections opened, every replica warm


class FaultRunError(RuntimeError):
    """The run cannot go on: the cluster did not start, a fault could not be injected, the client died."""


def ours(cluster: LocalCluster, pid: int, what: str) -> int:
    if not cluster.owns(pid):
        raise FaultRunError(f"{what} runs in pid {pid}, not one of this run's Ray processes: not killing it")
    return pid


def head_id(cluster: LocalCluster) -> str:
    (head,) = [n["node_id"] for n in cluster.alive_nodes() if n["is_head_node"]]
    return head


def replica_victim(cluster: LocalCluster, deployment: str) -> tuple[int, str]:
    """The replica of `deployment` (B's or the ingress's) on the worker node: (pid, words)."""
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


def haproxy_victim(cluster: LocalCluster) -> tuple[int, str]:
    """The HAProxy process holding the head's HTTP port: (pid, words)."""
    pid = cluster.listener(cluster.http_port)
    if pid is None:
        raise FaultRunError(f"nothing of this run listens on the HTTP port {cluster.http_port}")
    return ours(cluster, pid, "HAProxy"), f"SIGKILL to the HAProxy process on the head (pid {pid})"


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
        """A new worker node, alive (its `ray start` started again if it exits first, as a pod's container)."""
        self.workers += 1
        return self.cluster.start_alive(
            f"worker-{self.workers}", self.cpus, self.gpus, timeout_s=self.args.step_timeout
        )

    def start(self) -> None:
        cluster, timeout_s = self.cluster, self.args.step_timeout
        print(f"two nodes of {self.cpus:g} CPUs and {self.gpus:g} logical GPU each...", flush=True)
        cluster.start_alive("head", self.cpus, self.gpus, head=True, timeout_s=timeout_s)
        self.start_worker()
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
            "ingress": lambda: replica_victim(cluster, INGRESS),
            "controller": lambda: actor_victim(cluster, "ServeController", "Serve's controller"),
            "proxy": lambda: actor_victim(cluster, cluster.proxy_class, f"the head's way in ({cluster.proxy_class})"),
            "haproxy": lambda: haproxy_victim(cluster),
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
