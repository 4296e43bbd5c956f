"""A whole run: every selected model at every load level, warm-up first, server-side metrics around each level.

Results accumulate in an Outcome as they are measured, so an interrupted or failing run still has a report to write.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace

import httpx

from loadtest import server_metrics
from loadtest.discovery import ModelInfo
from loadtest.progress import Progress
from loadtest.runner import Level, Limits, Recorder, Target, make_client, run_phase
from loadtest.stats import LevelResult
from loadtest.workload import SeqLenSpec, build_bodies, endpoint

CLIENT_CPU_WARN_PCT = 70.0  # above this, the report notes that the client may be competing with the service


@dataclass(frozen=True)
class Plan:
    """Everything a run needs, fixed before the first request."""

    base_url: str
    models: tuple[ModelInfo, ...]
    levels: tuple[Level, ...]
    limits: Limits
    seq_len: SeqLenSpec
    batch_size: int = 1
    protocol: str = "simple"
    metrics_url: str = ""
    metrics_name: str = server_metrics.DEFAULT_METRIC
    metrics_match: tuple[tuple[str, str], ...] = ()  # only series with these labels, e.g. (("application", "mha"),)
    metrics_wait_s: float = 20.0
    seed: int = 0


@dataclass
class Outcome:
    """What a run measured so far: one result per level, notes, and failures (each makes the exit non-zero)."""

    results: list[LevelResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    interrupted: bool = False


class _ServerSide:
    """Scrapes around each level; turns itself off (with a note) when the metric cannot be read."""

    def __init__(self, plan: Plan, outcome: Outcome):
        self.plan = plan
        self.outcome = outcome
        self.enabled = bool(plan.metrics_url)
        self.client = httpx.Client(timeout=10.0, trust_env=False)

    def _off(self, why: str) -> None:
        self.enabled = False
        self.outcome.notes.append(f"server-side percentiles omitted: {why}")

    def settle(self, model: str, at_least: float) -> server_metrics.Histogram | None:
        """A scrape once `model` has recorded `at_least` observations (or None when turned off)."""
        if not self.enabled:
            return None
        name, url, match = self.plan.metrics_name, self.plan.metrics_url, dict(self.plan.metrics_match)
        try:
            hist = server_metrics.wait_for_count(
                self.client, url, name, match, model, at_least, self.plan.metrics_wait_s
            )
        except server_metrics.MetricsError as exc:
            self._off(str(exc))
            return None
        if at_least > 0 and hist.count(model) == 0:
            self._off(f"no histogram {name!r} for model {model} at {url} (set --metrics-name)")
            return None
        return hist


async def _phase(target: Target, level: Level, plan: Plan, duration: float, stop, progress, label) -> Recorder:
    rec = Recorder(duration, plan.limits.max_requests, stop)
    async with make_client(level, plan.limits) as client:
        watcher = asyncio.ensure_future(progress.watch(label, rec))
        try:
            await run_phase(target, level, plan.limits, rec, client, seed=plan.seed)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
    return rec


async def _run_model(model: ModelInfo, plan: Plan, outcome: Outcome, stop, progress, server: _ServerSide) -> None:
    bodies, notes = build_bodies(plan.seq_len, model.max_len, plan.batch_size, plan.protocol, seed=plan.seed)
    outcome.notes += [f"{model.name}: {n}" for n in notes]
    target = Target(model, plan.base_url + endpoint(plan.protocol, model.name), tuple(bodies), plan.batch_size)
    base = await asyncio.to_thread(server.settle, model.name, 0)
    seen_ok = base.count(model.name) if base else 0.0
    for level in plan.levels:
        if stop.is_set():
            return
        warm_sent = warm_ok = 0
        if plan.limits.warmup_s > 0:
            label = f"{model.name} {level.label} warm-up"
            warm = await _phase(target, level, plan, plan.limits.warmup_s, stop, progress, label)
            warm_sent, warm_ok = warm.sent, warm.ok
            seen_ok += warm.ok
        before = await asyncio.to_thread(server.settle, model.name, seen_ok)
        rec = await _phase(target, level, plan, plan.limits.duration_s, stop, progress, f"{model.name} {level.label}")
        seen_ok += rec.ok
        result = replace(rec.result(target, level), warmup_sent=warm_sent, warmup_ok=warm_ok)
        after = await asyncio.to_thread(server.settle, model.name, seen_ok) if before else None
        if before and after:
            result = replace(
                result, server=server_metrics.server_percentiles(before, after, model.name, plan.metrics_name)
            )
        outcome.results.append(result)
        if result.client_cpu_pct > CLIENT_CPU_WARN_PCT:
            outcome.notes.append(
                f"{model.name} {level.label}: the load tester itself used {result.client_cpu_pct:.0f}% of a core; "
                "when it shares the machine with the service, the service's numbers are a lower bound"
            )
        progress.done(result)
        if result.ok == 0 and result.stopped_by != "interrupted":
            outcome.failures.append(
                f"{model.name} {level.label}: no successful responses ({rec.describe_errors() or 'nothing answered'}); "
                "skipped its remaining levels"
            )
            return


async def run_session(plan: Plan, outcome: Outcome, stop: asyncio.Event, progress: Progress) -> None:
    """Measure every model at every level, appending to `outcome` as it goes; stops early when `stop` is set."""
    server = _ServerSide(plan, outcome)
    if server.enabled:
        progress.note(
            f"server-side latency from {plan.metrics_url} ({plan.metrics_name}): after each phase, waiting up to "
            f"{plan.metrics_wait_s:g} s for the service's metrics to catch up (Ray exports them every ~10 s)"
        )
    try:
        for model in plan.models:
            if stop.is_set():
                break
            await _run_model(model, plan, outcome, stop, progress, server)
    finally:
        server.client.close()
        outcome.interrupted = outcome.interrupted or stop.is_set()
