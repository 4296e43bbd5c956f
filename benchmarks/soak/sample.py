"""The soak run's server-side sample: per kind of process in the server's tree (the driver, Ray's GCS and raylet, the
ingress replica, ...) its memory, open descriptors and threads from /proc, the tree's CPU, and one scrape of Ray's
metrics export (its size, series and time). Loopback only. No torch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.harness.exposition import scrape, series_count
from benchmarks.harness.processes import (
    command_line,
    cpu_seconds,
    descendants,
    fd_count,
    rollup_kib,
    thread_count,
)

# Every process of the tree falls in one kind: the first whose test its command line passes, else "other" (Ray's
# runtime-env agent, log monitor, autoscaler monitor, workers that come and go).
KINDS = ("driver", "gcs", "raylet", "ingress", "replicas", "controller", "dashboard", "other")
_MARKS = (
    ("gcs", "gcs_server"),
    ("raylet", "/raylet/raylet"),
    ("ingress", "ServeReplica:"),  # the ingress's replica; other deployments' replicas are told apart below
    ("controller", "ServeController"),
    ("dashboard", "DashboardAgent"),  # it serves the metrics export
    ("dashboard", "dashboard/dashboard.py"),
)
PER_KIND = ("rss_mib", "pss_mib", "fds", "threads", "processes")


def process_kind(cmdline: str, is_root: bool) -> str:
    """Which of KINDS a process of the server's tree is, from its command line (`is_root`: the `serve` process)."""
    if is_root:
        return "driver"
    for kind, mark in _MARKS:
        if mark in cmdline:
            if kind == "ingress" and cmdline.split(":")[-1].strip() != "ingress":
                return "replicas"
            return kind
    return "other"


@dataclass(frozen=True)
class Process:
    kind: str
    rss_kib: int
    pss_kib: int
    fds: int
    threads: int
    cpu_s: float


def read_process(pid: int, kind: str) -> Process | None:
    """One process's figures from /proc; None once it has gone."""
    try:
        rss, pss = rollup_kib(Path(f"/proc/{pid}/smaps_rollup").read_text())
        return Process(kind, rss, pss, fd_count(pid), thread_count(pid), cpu_seconds(pid))
    except (OSError, ValueError):
        return None


def scrape_figures(url: str, timeout_s: float = 30) -> dict[str, float]:
    """One GET of the metrics export: its size in bytes, series and seconds (nan each when it failed)."""
    try:
        text, seconds = scrape(url, timeout_s)
    except (httpx.HTTPError, OSError):
        return {"metrics_bytes": float("nan"), "metrics_series": float("nan"), "metrics_scrape_s": float("nan")}
    return {"metrics_bytes": len(text.encode()), "metrics_series": series_count(text), "metrics_scrape_s": seconds}


class TreeSampler:
    """Samples the process tree under `root`: per kind its memory, descriptors, threads and process count, and the
    CPU share of the tree and of the load client since the previous sample."""

    def __init__(self, root: int, client: int, metrics_url: str) -> None:
        self.root, self.client, self.metrics_url = root, client, metrics_url
        self._kinds: dict[int, str] = {}  # pid -> kind: a worker renames itself once, so looked at until it is known
        self._cpu: dict[int, float] = {}  # pid -> CPU seconds at the previous sample
        for pid in descendants(root):
            with contextlib.suppress(OSError, IndexError, ValueError):
                self._cpu[pid] = cpu_seconds(pid)
        self._client_cpu = self._read_client_cpu()
        self._at = time.monotonic()

    def _kind(self, pid: int) -> str:
        kind = self._kinds.get(pid)
        if kind is None or kind == "other":
            kind = self._kinds[pid] = process_kind(command_line(pid), pid == self.root)
        return kind

    def _read_client_cpu(self) -> float:
        with contextlib.suppress(OSError):
            return cpu_seconds(self.client)
        return float("nan")

    def thread_names(self) -> dict[str, Counter]:
        """Per kind, how many of its threads carry each name (/proc/PID/task/TID/comm): which pool grew, when a
        kind's thread count did."""
        names: dict[str, Counter] = {k: Counter() for k in KINDS}
        for pid in descendants(self.root):
            kind = self._kind(pid)
            with contextlib.suppress(OSError):  # gone meanwhile
                for task in Path(f"/proc/{pid}/task").iterdir():
                    with contextlib.suppress(OSError):
                        names[kind][(task / "comm").read_text().strip()] += 1
        return names

    def sample(self) -> dict[str, float]:
        """One row: totals, per-kind figures (`<kind>_<figure>`), CPU shares in % of one core, the machine's load
        average, the metrics scrape."""
        now = time.monotonic()
        elapsed = max(now - self._at, 1e-9)
        row: dict[str, float] = {f"{k}_{f}": 0 for k in KINDS for f in PER_KIND}
        cpu, server_cpu = {}, 0.0
        for pid in descendants(self.root):
            p = read_process(pid, self._kind(pid))
            if p is None:
                continue
            for figure, value in (("rss_mib", p.rss_kib / 1024), ("pss_mib", p.pss_kib / 1024)):
                row[f"{p.kind}_{figure}"] += value
            row[f"{p.kind}_fds"] += p.fds
            row[f"{p.kind}_threads"] += p.threads
            row[f"{p.kind}_processes"] += 1
            cpu[pid] = p.cpu_s
            server_cpu += p.cpu_s - self._cpu.get(pid, 0.0)  # a process new since the last sample: all of its CPU
        client_cpu = self._read_client_cpu()
        row["rss_mib"] = sum(row[f"{k}_rss_mib"] for k in KINDS)
        row["pss_mib"] = sum(row[f"{k}_pss_mib"] for k in KINDS)
        row["processes"] = sum(row[f"{k}_processes"] for k in KINDS)
        row["server_cpu_pct"] = 100 * server_cpu / elapsed
        row["client_cpu_pct"] = 100 * (client_cpu - self._client_cpu) / elapsed
        row["load_avg_1m"] = os.getloadavg()[0]  # the machine's: what else competed for its cores
        self._cpu, self._client_cpu, self._at = cpu, client_cpu, now
        row.update(scrape_figures(self.metrics_url))
        return row
