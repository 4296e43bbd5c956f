"""Test support: the real Prometheus of benchmarks/harness/prometheus.py, or a skip (a failure in CI) without the
binary; the metric names the Grafana dashboard's queries read; a metric's total in an exposition's text."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.harness import prometheus
from benchmarks.harness.prometheus import PROMETHEUS_YML

__all__ = ["GENERATION_ROW", "PROMETHEUS_YML", "PrometheusServer", "dashboard_metric_names", "require_prometheus"]

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "mha-serving.json"
GENERATION_ROW = "Generation"  # the dashboard's row of decoder panels: tests/test_generation_metrics.py checks them


def require_prometheus() -> str:
    """The prometheus binary; in CI (where .ci/run installs it) its absence is a failure, elsewhere a skip."""
    binary = shutil.which("prometheus")
    if binary is None:
        message = "the `prometheus` binary is not installed (apt-get install prometheus; .ci/run does this)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return binary


class PrometheusServer(prometheus.PrometheusServer):
    def __init__(self, target: str, scrape_interval: str = "2s") -> None:
        super().__init__(target, scrape_interval, binary=require_prometheus())


def dashboard_metric_names(row: str | None = None) -> set[str]:
    """Every metric a dashboard query names, without the histogram suffixes; with `row`, those of the panels
    under the row whose title starts so (GENERATION_ROW: the decoders' panels), else those above every row."""
    dashboard = json.loads(DASHBOARD.read_text())
    under, panels = None, []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            under = panel["title"]
        elif (under is None and row is None) or (under is not None and row is not None and under.startswith(row)):
            panels.append(panel)
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    if row is None:
        exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    names = set()
    for expr in exprs:
        for name in re.findall(r"\bray_mha_[a-z0-9_]+", expr):
            names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def series_total(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in a Prometheus exposition `text` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total
