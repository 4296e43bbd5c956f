"""Test support: the real Prometheus of benchmarks/harness/prometheus.py, or a skip (a failure in CI) without the
binary."""

from __future__ import annotations

import os
import shutil

import pytest

from benchmarks.harness import prometheus
from benchmarks.harness.prometheus import PROMETHEUS_YML

__all__ = ["PROMETHEUS_YML", "PrometheusServer", "require_prometheus"]


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
