"""What is broken in the cluster: Serve's application, deployments, controller and proxies against their targets, every
model answering through the proxy, nothing listed that was killed; and the wait until nothing is."""

from __future__ import annotations

import time

import httpx

from benchmarks.cluster_faults.application import APP
from benchmarks.harness.cluster import LocalCluster
from benchmarks.harness.polling import predicts_ok


def problems(cluster: LocalCluster, models: list[str], want: dict[str, int], dead: set[int]) -> list[str]:
    """What is not as it should be: the application RUNNING, each deployment HEALTHY with its target of RUNNING
    replicas on as many nodes, one controller and one proxy (HEALTHY), every model answering 200 through the proxy,
    and none of these in a process that was killed (`dead`: Serve may still list it before it notices)."""
    try:
        details = cluster.serve_details()
        controllers, proxies = cluster.actors("ServeController"), cluster.actors(cluster.proxy_class)
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
    for kind, alive in (("ServeController", controllers), (cluster.proxy_class, proxies)):
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
