"""Bounded metrics: the series of a replica that died leave Ray's metrics export while the live ones stay
(service/local/ray_env.py CLUSTER_RAY_ENV, on a real `mha-serving serve` whose model replica is SIGKILLed), what Ray
keeps about it for good never reaches a real Prometheus run from deploy/prometheus.yml, and the cluster's pods run
Ray with the same settings."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus import PrometheusServer

from benchmarks.harness.polling import until
from benchmarks.harness.server import ServerProcess
from benchmarks.metrics_churn import served_and_exported
from service.local.ray_env import CLUSTER_RAY_ENV

RAYSERVICE = Path(__file__).resolve().parents[1] / "deploy" / "k8s" / "base" / "rayservice.yaml"
CREATION_TASKS = re.compile(r'^ray_tasks\{[^}]*Name="SERVE_REPLICA::', re.M)  # Ray keeps these per replica, for good
MODEL = "mha-h2-d32"  # in its own deployment: its replica is a process of its own
WORKER_TIMEOUT_S = "5"  # Ray's RAY_WORKER_TIMEOUT_S (120 s by default): how long a silent worker's series are kept


def pods() -> list[dict]:
    cluster = yaml.safe_load(RAYSERVICE.read_text())["spec"]["rayClusterConfig"]
    return [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]


def test_every_cluster_pod_runs_ray_with_the_cluster_settings_bounded_metrics_among_them():
    for group in pods():
        (container,) = group["template"]["spec"]["containers"]
        env = {e["name"]: e["value"] for e in container["env"]}
        assert CLUSTER_RAY_ENV.items() <= env.items(), group.get("groupName", "head")


def series_of(text: str, replica: str) -> list[str]:
    """The export's samples labelled with Serve's `replica` tag `replica`."""
    return re.findall(rf'^\S+\{{[^}}]*[{{,]replica="{replica}"[^\n]*', text, re.M)


@pytest.mark.serve
@pytest.mark.slow
def test_a_killed_replica_leaves_the_export_live_ones_stay_and_prometheus_drops_what_ray_keeps(
    tiny_models_dir, monkeypatch
):
    monkeypatch.setenv("RAY_WORKER_TIMEOUT_S", WORKER_TIMEOUT_S)
    monkeypatch.setenv("RAY_metrics_report_interval_ms", "1000")  # as the session's Ray (tests/serving.py)
    config = {"models_dir": str(tiny_models_dir), "models": [MODEL], "backend": "cpu"}
    config["overrides"] = {MODEL: {"placement": "deployment"}}
    with ServerProcess(config) as server, PrometheusServer(f"127.0.0.1:{server.metrics_port}", "1s") as prom:

        def export() -> str:
            r = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=60)
            assert r.status_code == 200, r.text[:500]
            return r.text

        dead = served_and_exported(server, MODEL, requests=3, seen=set())
        assert series_of(export(), dead)
        os.kill(server.replica_pid(MODEL), signal.SIGKILL)
        live = served_and_exported(server, MODEL, requests=3, seen={dead})

        def without_dead() -> str:
            text = export()
            return "" if series_of(text, dead) else text

        what = f"the series of the killed replica {dead} leaving the export"
        text = until(what, without_dead, 90, every_s=1, retried=())  # a failed scrape fails the test at once
        own = [line for line in series_of(text, live) if line.startswith("ray_mha_")]
        assert own, f"the live replica {live} has no ray_mha_* series left"
        assert re.search(r'^ray_mha_requests_total\{[^}]*deployment="ingress"', text, re.M), "the ingress's are gone"

        # what stays in the export for good (the dead replica's creation task, docs/operations.md) is not stored
        assert len(CREATION_TASKS.findall(text)) >= 2, "both replicas' creation tasks are in the export"
        prom.scraped_since(time.time())
        assert prom.query('count(ray_mha_requests_total{deployment="ingress"})') and prom.query("count(ray_tasks)")
        assert not prom.query('count_over_time(ray_tasks{Name=~"SERVE_REPLICA::.*"}[5m])')
        assert not prom.query("count_over_time(ray_serve_request_router_queue_len[5m])")
        assert prom.query("scrape_samples_post_metric_relabeling < scrape_samples_scraped"), "it dropped nothing"
