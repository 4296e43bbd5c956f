"""A whole run: every selected model (or route) at every load level under every protocol, warm-up first,
server-side metrics (and a route's shadow agreement) around each level. A model's protocols take turns at each level
(the same requests in each), so a drift in the machine's load falls on all of them alike.

Results accumulate in an Outcome as they are measured, so an interrupted or failing run still has a report to write.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field, replace

import httpx

from loadtest import server_metrics, streams
from loadtest.agreement import ShadowCounts, ShadowMeter
from loadtest.discovery import ModelInfo
from loadtest.progress import Progress
from loadtest.routes import ANSWERED_BY
from loadtest.runner import Level, Limits, Recorder, Target, make_pool, run_phase
from loadtest.stats import LevelResult, Slo, generation_summary
from loadtest.streams import StreamTiming, TokenSpec
from loadtest.workload import ANSWER_CHECKS, DEFAULT_PROTOCOL, SeqLenSpec, build_bodies, endpoint

DEFAULT_PROMPT = TokenSpec(32, 32, "--prompt-tokens")
DEFAULT_OUTPUT = TokenSpec(64, 64, "--output-tokens")
NO_SLO = Slo()
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
    protocols: tuple[str, ...] = (DEFAULT_PROTOCOL,)
    grpc_url: str = ""  # host:port of the gRPC service (protocol grpc)
    metrics_url: str = ""
    metrics_names: tuple[str, ...] = server_metrics.DEFAULT_METRICS  # the first with data is used
    metrics_match: tuple[tuple[str, str], ...] = ()  # only series with these labels, e.g. (("application", "mha"),)
    metrics_wait_s: float = 20.0
    seed: int = 0
    # generation (decoders): streamed completions of these prompt and output lengths, goodput under `slo`, and the
    # server's histograms read beside the one settled on (its inter-token latency)
    generate: bool | None = False  # None until the models say (the CLI's plan before discovery)
    prompt_tokens: TokenSpec = DEFAULT_PROMPT
    output_tokens: TokenSpec = DEFAULT_OUTPUT
    slo: Slo = NO_SLO
    metrics_also: tuple[str, ...] = ()
    metrics_last: str = ""  # observed at each request's end: waited for before `metrics_also` is read


@dataclass
class Outcome:
    """What a run measured so far: one result per level, notes, and failures (each makes the exit non-zero)."""

    results: list[LevelResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    interrupted: bool = False
    streams: list[dict[str, object]] = field(default_factory=list)  # a row per successful stream (streams.csv)


class _ServerSide:
    """Scrapes around each level; settles on the first metric name with data; turns itself off (with a note) when
    no metric can be read."""

    def __init__(self, plan: Plan, outcome: Outcome):
        self.plan = plan
        self.outcome = outcome
        self.names = plan.metrics_names
        self.match = dict(plan.metrics_match)
        self.base: dict[str, float] = {}
        self.alias: dict[str, str] = {}  # a route's targets, whose series count the route's requests
        self.enabled = bool(plan.metrics_url)
        self.client = httpx.Client(timeout=10.0, trust_env=False)
        self.shadow = ShadowMeter(self.client, plan.metrics_url, self.match, plan.metrics_wait_s, outcome.notes)

    def _off(self, why: str) -> None:
        self.enabled = False
        self.base = {}
        self.outcome.notes.append(f"server-side percentiles omitted: {why}")

    def start(self, model: ModelInfo) -> None:
        """Note each histogram's count for `model` before any of its load (a route's: its targets' series too, as
        the service may label a route's requests by the model that answered)."""
        self.base = {}
        self.alias = {target: model.name for target, _ in model.route.targets} if model.route else {}
        if model.route and model.route.shadow:
            self.shadow.start(model.route)
        if self.enabled:
            try:
                names = self.names + ((self.plan.metrics_last,) if self.plan.metrics_last else ())
                hists = server_metrics.scrape(self.client, self.plan.metrics_url, names, self.match, self.alias)
            except server_metrics.MetricsError as exc:
                return self._off(str(exc))
            self.base = {name: hist.count(model.name) for name, hist in hists.items()}

    def _also(self, model: str, ok_since_start: int) -> dict[str, server_metrics.Histogram]:
        """The histograms read beside the settled one (a decoder's ITL), from one more scrape once the one observed
        at each request's end has counted them all; {} when unreadable (a note says so)."""
        if not self.plan.metrics_also or not self.enabled:
            return {}
        try:
            if last := self.plan.metrics_last:
                args = (self.client, self.plan.metrics_url, (last,), self.match, model)
                server_metrics.wait_for_counts(*args, self.base, ok_since_start, self.plan.metrics_wait_s, self.alias)
            return server_metrics.scrape(self.client, self.plan.metrics_url, self.plan.metrics_also, self.match)
        except server_metrics.MetricsError as exc:
            self.outcome.notes.append(f"{model}: {', '.join(self.plan.metrics_also)} not read: {exc}")
            return {}

    def settle(self, model: str, ok_since_start: int) -> dict[str, server_metrics.Histogram] | None:
        """A scrape once `model` has `ok_since_start` new observations in a histogram (None when turned off)."""
        if not self.enabled:
            return None
        url, wait = self.plan.metrics_url, self.plan.metrics_wait_s
        try:
            args = (self.client, url, self.names, self.match, model, self.base, ok_since_start, wait, self.alias)
            hists, name = server_metrics.wait_for_counts(*args)
        except server_metrics.MetricsError as exc:
            return self._off(str(exc))
        if ok_since_start > 0:
            if not name:
                names = " or ".join(repr(n) for n in self.names)
                return self._off(f"no histogram {names} counted {ok_since_start} requests to {model} at {url}")
            self.names = (name,)  # from now on, this one
        return hists | self._also(model, ok_since_start)

    def percentiles(self, before: dict, after: dict, model: str) -> dict[str, object]:
        name = self.names[0]
        return server_metrics.server_percentiles(before[name], after[name], model, name)

    def also_percentiles(self, before: dict, after: dict, model: str) -> dict[str, dict[str, object]]:
        """The percentiles of each histogram read beside the settled one, by name (those read before and after)."""
        names = [n for n in self.plan.metrics_also if n in before and n in after]
        return {n: server_metrics.server_percentiles(before[n], after[n], model, n) for n in names}


async def _phase(
    target: Target, level: Level, plan: Plan, duration: float, stop: asyncio.Event, progress: Progress, label: str
) -> Recorder:
    pool = make_pool(plan.grpc_url if target.protocol == "grpc" else plan.base_url, plan.limits, target.protocol)
    rec = Recorder(duration, plan.limits.max_requests, stop)
    watcher = asyncio.ensure_future(progress.watch(label, rec))
    try:
        await run_phase(target, level, plan.limits, rec, pool, seed=plan.seed)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await pool.aclose()
    return rec


def _where(target: Target, level: Level, plan: Plan) -> str:
    """A level's name in progress lines and failures: the protocol named when the run has several."""
    protocol = f" {target.protocol}" if len(plan.protocols) > 1 else ""
    return f"{target.model.name}{protocol} {level.label}"


def _keep(result: LevelResult, rec: Recorder, outcome: Outcome, progress: Progress, where: str) -> bool:
    """Add a level's result to the outcome; False when it failed (the protocol's remaining levels for this model are
    skipped)."""
    outcome.results.append(result)
    progress.done(where, result)
    if result.client_cpu_pct > CLIENT_CPU_WARN_PCT:
        outcome.notes.append(
            f"{where}: the load tester itself used {result.client_cpu_pct:.0f}% of a core; "
            "when it shares the machine with the service, the service's numbers are a lower bound"
        )
    if result.ok == 0 and result.stopped_by != "interrupted":
        outcome.failures.append(
            f"{where}: no successful responses ({rec.describe_errors()}); skipped its remaining levels"
        )
        return False
    return True


def _generation_targets(model: ModelInfo, plan: Plan, outcome: Outcome) -> list[Target]:
    """One streaming target per protocol, each carrying the same prompts and output lengths."""
    args = (plan.prompt_tokens, plan.output_tokens, model.max_len, plan.protocols, model.name)
    bodies, notes = streams.build_bodies(*args, seed=plan.seed)
    outcome.notes += [f"{model.name}: {n}" for n in notes]
    return [
        Target(model, streams.endpoint(p, model.name), tuple(bodies[p]), 1, p, generate=True) for p in plan.protocols
    ]


def stream_row(result: LevelResult, timing: StreamTiming, slo: Slo) -> dict[str, object]:
    """One successful stream's figures in ms (streams.csv): what the level's percentiles and goodput are made of."""
    gaps = timing.gaps_s
    tpot = timing.tpot_s
    row: dict[str, object] = {"model": result.model, "protocol": result.protocol, "level": result.level}
    row |= {"prompt_tokens": timing.prompt_tokens, "output_tokens": timing.tokens}
    row |= {"ttft_ms": round(timing.ttft_s * 1000, 6), "itl_max_ms": round(max(gaps) * 1000, 6) if gaps else ""}
    row |= {"itl_mean_ms": round(sum(gaps) / len(gaps) * 1000, 6) if gaps else ""}
    row |= {"tpot_ms": "" if tpot is None else round(tpot * 1000, 6), "e2e_ms": round(timing.e2e_s * 1000, 6)}
    return row | {"meets_slo": int(slo.met_by(timing)) if slo.given else ""}


def _targets(model: ModelInfo, plan: Plan, outcome: Outcome) -> list[Target]:
    """One target per protocol, each carrying the same texts."""
    if plan.generate:
        return _generation_targets(model, plan, outcome)
    args = (plan.seq_len, model.max_len, plan.batch_size, plan.protocols)
    bodies, notes = build_bodies(*args, seed=plan.seed, model=model.name)
    outcome.notes += [f"{model.name}: {n}" for n in notes]
    return [
        Target(
            model,
            endpoint(p, model.name),
            tuple(bodies[p]),
            plan.batch_size,
            p,
            ANSWER_CHECKS.get(p),
            ANSWERED_BY[p] if model.route else None,
        )
        for p in plan.protocols
    ]


async def _settle(
    server: _ServerSide, model: ModelInfo, seen_ok: int
) -> tuple[dict[str, server_metrics.Histogram] | None, ShadowCounts | None]:
    """The scrapes that frame a level: latency histograms, and a route's shadow counters (None where not read)."""
    hists = await asyncio.to_thread(server.settle, model.name, seen_ok)
    route = model.route
    shadow = await asyncio.to_thread(server.shadow.settle, route, seen_ok) if route and route.shadow else None
    return hists, shadow


async def _run_model(
    model: ModelInfo, plan: Plan, outcome: Outcome, stop: asyncio.Event, progress: Progress, server: _ServerSide
) -> None:
    targets = _targets(model, plan, outcome)
    await asyncio.to_thread(server.start, model)
    seen_ok = 0  # successful requests to this model so far, under every protocol, warm-ups included
    for level in plan.levels:
        for target in list(targets):
            if stop.is_set():
                return
            where = _where(target, level, plan)
            warm_sent = warm_ok = 0
            if plan.limits.warmup_s > 0:
                warm = await _phase(target, level, plan, plan.limits.warmup_s, stop, progress, f"{where} warm-up")
                warm_sent, warm_ok = warm.sent, warm.ok
                seen_ok += warm.ok
                if stop.is_set():
                    return
            before, shadow_before = await _settle(server, model, seen_ok)
            rec = await _phase(target, level, plan, plan.limits.duration_s, stop, progress, where)
            if rec.sent == 0 and stop.is_set():
                return
            seen_ok += rec.ok
            result = replace(rec.result(target, level), warmup_sent=warm_sent, warmup_ok=warm_ok)
            after, shadow_after = (None, None) if stop.is_set() else await _settle(server, model, seen_ok)
            if plan.generate:
                failed = sum(rec.errors.values())
                summary = generation_summary(rec.streams, failed, result.duration_s, plan.slo)
                result = replace(result, generation=summary)
                outcome.streams += [stream_row(result, timing, plan.slo) for timing in rec.streams]
            if before and after:
                result = replace(result, server=server.percentiles(before, after, model.name))
                if also := server.also_percentiles(before, after, model.name):
                    result = replace(result, generation=result.generation | {"server_also": also})
            if model.route and model.route.shadow:
                result = replace(result, shadow=server.shadow.report(model.route, shadow_before, shadow_after))
            if not _keep(result, rec, outcome, progress, where):
                targets.remove(target)


async def run_session(plan: Plan, outcome: Outcome, stop: asyncio.Event, progress: Progress) -> None:
    """Measure every model at every level, appending to `outcome` as it goes; stops early when `stop` is set."""
    server = _ServerSide(plan, outcome)
    if server.enabled:
        progress.note(
            f"server-side latency from {plan.metrics_url} ({' or '.join(plan.metrics_names)}): after each phase, "
            f"waiting up to {plan.metrics_wait_s:g} s for the service's metrics to catch up (Ray exports them every "
            "~10 s by default)"
        )
    try:
        for model in plan.models:
            if stop.is_set():
                break
            await _run_model(model, plan, outcome, stop, progress, server)
    finally:
        server.client.close()
        outcome.interrupted = outcome.interrupted or stop.is_set()
