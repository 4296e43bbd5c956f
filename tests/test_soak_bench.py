"""The soak benchmark's own parts (benchmarks/soak/): how answers are classed and binned into intervals, how the
server's processes and /proc texts are read, how each bar line is judged; and one short run of the whole against the
tiny models. The hour itself is `python -m benchmarks.soak`."""

from __future__ import annotations

import csv
import ctypes
import math
import os
import threading
from collections import Counter

import numpy as np
import pytest

from benchmarks.harness.exposition import series_count
from benchmarks.harness.processes import rollup_kib, status_threads
from benchmarks.soak.load import Tally, classify, interval_of, intervals
from benchmarks.soak.report import client_row, codes, thread_names_text
from benchmarks.soak.sample import KINDS, TreeSampler, process_kind
from benchmarks.soak.verdict import slope_per_hour, verdict, windows


@pytest.mark.parametrize(
    ("kind", "outcome", "expected"),
    [
        ("valid", "200", "ok"),
        ("slow", "200", "ok"),
        ("valid", "503", "5xx"),
        ("invalid", "500", "5xx"),
        ("invalid", "400", "expected 4xx"),
        ("invalid", "404", "expected 4xx"),
        ("invalid", "200", "unexpected"),
        ("valid", "408", "unexpected"),
        ("valid", "timeout", "unanswered"),
        ("slow", "connection_closed", "unanswered"),
        ("disconnect", "sent", "disconnect"),
        ("disconnect", "connect_error", "disconnect"),
    ],
)
def test_an_answer_is_classed_by_what_it_means_for_the_verdict(kind, outcome, expected):
    assert classify(kind, outcome) == expected


def test_answers_fall_in_the_interval_that_ends_at_or_after_them_and_late_ones_in_the_last():
    assert intervals(30, 5) == 6 and intervals(32, 5) == 7
    t0, last = 100.0, 6
    assert [interval_of(t0 + s, t0, 5, last) for s in (0.001, 5.0, 5.001, 29.9, 30.0, 45.0)] == [1, 1, 2, 6, 6, 6]
    assert interval_of(t0 - 1, t0, 5, last) == 1  # an answer to a request sent just before t0


def test_an_intervals_row_counts_answers_by_class_and_code_and_latency_per_model():
    tally = Tally(
        latencies_ms={"a": [float(x) for x in range(1, 101)], "b": [1000.0]},
        outcomes=Counter(
            {("valid", "200"): 101, ("invalid", "400"): 3, ("valid", "503"): 1, ("disconnect", "sent"): 2}
        ),
        slow_ms=[1100.0],
    )
    row = client_row(tally, ["a", "b"], 10.0)
    assert (row["ok"], row["expected_4xx"], row["5xx"], row["disconnect"], row["sent"]) == (101, 3, 1, 2, 107)
    assert row["rate_ok"] == pytest.approx(10.1) and row["codes"] == "400=3 503=1"
    assert row["a_p50_ms"] == pytest.approx(50.5) and row["b_p99_ms"] == pytest.approx(1000.0)
    assert row["all_p99_ms"] > row["a_p99_ms"]
    assert codes(Counter({("slow", "timeout"): 1, ("valid", "200"): 5})) == "timeout=1"


@pytest.mark.parametrize(
    ("cmdline", "root", "kind"),
    [
        ("/venv/bin/python -m service.cli serve --config /tmp/x/serve.yaml --port 1", True, "driver"),
        ("/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray", False, "gcs"),
        (
            "/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/x",
            False,
            "raylet",
        ),
        ("ray::ServeReplica:mha:ingress", False, "ingress"),
        ("ray::ServeReplica:mha:mha-h8-d512", False, "replicas"),
        ("ray::ServeController", False, "controller"),
        ("ray::DashboardAgent", False, "dashboard"),
        (
            "/venv/bin/python /venv/lib/python3.11/site-packages/ray/dashboard/dashboard.py --host=127.0.0.1",
            False,
            "dashboard",
        ),
        ("ray::RuntimeEnvAgent", False, "other"),
        ("ray::IDLE", False, "other"),
    ],
)
def test_each_process_of_the_servers_tree_is_told_by_its_command_line(cmdline, root, kind):
    assert process_kind(cmdline, root) == kind


def test_proc_and_metrics_texts_are_read_for_threads_memory_and_series():
    assert status_threads("Name:\tpython\nState:\tS (sleeping)\nThreads:\t42\nSigQ:\t0/1\n") == 42
    with pytest.raises(ValueError, match="Threads"):
        status_threads("Name:\tpython\n")
    rollup = "55d0-7ffd ---p 00000000 00:00 0  [rollup]\nRss:              204800 kB\nPss:              102400 kB\n"
    assert rollup_kib(rollup + "Pss_Anon:  1 kB\n") == (204800, 102400)
    exposition = '# HELP x X.\n# TYPE x counter\nx{a="1"} 1.0\nx{a="2"} 2.0\n\ny_bucket{le="+Inf"} 3\n'
    assert series_count(exposition) == 3


def test_the_tree_sampler_reads_a_live_process_from_proc():
    sampler = TreeSampler(os.getpid(), os.getpid(), "http://127.0.0.1:9/metrics")  # port 9: nothing listens
    row = sampler.sample()
    assert row["driver_processes"] >= 1 and row["driver_fds"] > 0 and row["driver_threads"] >= 1
    assert row["pss_mib"] > 0 and row["rss_mib"] >= row["pss_mib"]
    assert math.isnan(row["metrics_bytes"]) and math.isnan(row["metrics_scrape_s"])


def test_the_tree_sampler_counts_a_live_process_threads_by_name():
    started, release = threading.Event(), threading.Event()

    def named() -> None:
        ctypes.CDLL(None).prctl(15, b"soak-probe", 0, 0, 0)  # PR_SET_NAME: this thread's comm
        started.set()
        release.wait(10)

    thread = threading.Thread(target=named)
    thread.start()
    try:
        started.wait(10)
        names = TreeSampler(os.getpid(), os.getpid(), "http://127.0.0.1:9/metrics").thread_names()
    finally:
        release.set()
        thread.join()
    assert names["driver"]["soak-probe"] == 1


def test_the_report_names_the_threads_a_kind_gained():
    first = {"ingress": Counter({"event_engine": 7, "python": 26}), "raylet": Counter({"raylet": 30})}
    last = {"ingress": Counter({"event_engine": 9, "python": 26, "new_pool": 1}), "raylet": Counter({"raylet": 30})}
    text = thread_names_text(first, last)
    assert text == "- ingress: 33 -> 36 threads; `event_engine` 7 -> 9, `new_pool` 0 -> 1"
    assert thread_names_text(first, first).startswith("No kind")


def test_an_hours_windows_are_the_bars_ten_and_fifty_minutes():
    w = windows(3600)
    assert (w.warmup_s, w.first, w.last, w.slope_from_s) == (60, (60, 660), (3000, 3600), 600)
    assert w.has(w.first, 660) and not w.has(w.first, 60) and w.has(w.last, 3600)


def test_a_slope_is_per_hour_and_needs_two_points():
    assert slope_per_hour([0, 1800, 3600], [1000, 1005, 1010]) == pytest.approx(10.0)
    assert math.isnan(slope_per_hour([10], [1000]))


def run_rows(span_s: int = 3600, step: int = 10, **change):
    """A steady run's rows and latencies; `change` maps a column to a function of (t_s, value) that alters it."""
    rows, latencies = [], []
    for t in range(0, span_s + 1, step):
        row = {"t_s": float(t), "rss_mib": 2000.0, "pss_mib": 1500.0}
        row.update({f"{k}_{f}": 0.0 for k in KINDS for f in ("fds", "threads")})
        row.update(ingress_fds=90.0, ingress_threads=50.0, raylet_fds=60.0, raylet_threads=30.0)
        for key, alter in change.items():
            row[key] = alter(t, row[key])
        rows.append(row)
        latencies.append({"m": np.linspace(5, 10, 100)} if t else {})
    return rows, latencies


def passed(lines) -> dict[str, bool]:
    return {line.name: line.ok for line in lines}


def test_a_steady_run_passes_every_line():
    rows, latencies = run_rows(
        rss_mib=lambda t, v: v + 3 * math.sin(t / 50),  # noise, no trend
        ingress_fds=lambda t, v: v + (40 if t % 600 == 0 else 0),  # a burst of connections now and then
    )
    assert all(passed(verdict(rows, latencies, {"ok": 1000, "expected 4xx": 30})).values())


def test_creeping_memory_leaking_descriptors_drifting_latency_and_errors_each_fail_their_line():
    rows, latencies = run_rows(rss_mib=lambda t, v: v + 20 * t / 3600)  # +20 MiB/h against 15 allowed
    assert passed(verdict(rows, latencies, {}))["memory slope"] is False
    rows, latencies = run_rows(ingress_fds=lambda t, v: v + t // 300)  # one descriptor more every 5 minutes
    assert passed(verdict(rows, latencies, {})) == {
        "memory slope": True,
        "fds flat": False,
        "threads flat": True,
        "p99 drift": True,
        "errors": True,
    }
    rows, latencies = run_rows(raylet_threads=lambda t, v: v + (3 if t > 2000 else 0))
    assert passed(verdict(rows, latencies, {}))["threads flat"] is False
    rows, latencies = run_rows()
    for lat in latencies[-60:]:
        lat["m"] = lat["m"] * 1.25
    assert passed(verdict(rows, latencies, {}))["p99 drift"] is False
    for totals in ({"5xx": 1}, {"unanswered": 2}):
        assert passed(verdict(*run_rows(), totals))["errors"] is False


@pytest.mark.serve
@pytest.mark.slow
def test_a_short_soak_serves_the_mix_samples_every_interval_and_writes_its_report(tiny_models_dir, tmp_path):
    from benchmarks.soak.run import main

    names = ["mha-h2-d32", "mha-h4-d32"]
    args = ["--models", str(tiny_models_dir), *(a for n in names for a in ("--model", n))]
    args += ["--duration", "9", "--sample", "1.5", "--capacity-seconds", "2", "--out", str(tmp_path)]
    assert main(args) in (0, 1)  # the verdict's: a 9 s run's slope is noise
    rows = list(csv.DictReader((tmp_path / "samples.csv").open()))
    assert [float(r["t_s"]) for r in rows] == [0, 1.5, 3, 4.5, 6, 7.5, 9]
    assert all(float(r["ingress_fds"]) > 0 and float(r["ingress_threads"]) > 0 for r in rows)
    assert all(float(r["raylet_pss_mib"]) > 0 and float(r["metrics_series"]) > 0 for r in rows)
    measured = rows[1:]
    assert all(int(r["sent"]) > 0 and float(r["all_p99_ms"]) > 0 for r in measured)
    total = {key: sum(int(r[key]) for r in measured) for key in ("ok", "expected_4xx", "disconnect", "slow_ok", "5xx")}
    assert total["ok"] > 0 and total["expected_4xx"] > 0 and total["disconnect"] > 0 and total["slow_ok"] >= 1
    assert total["5xx"] == 0
    report = (tmp_path / "report.md").read_text()
    for line in ("memory slope", "fds flat", "threads flat", "p99 drift", "errors"):
        assert f"| {line} |" in report
    assert "share this machine" in report
    assert len(list(tmp_path.glob("*.png"))) >= 8
