"""The load tester as a library, for one served model: a window of open-loop Poisson arrivals at a rate, or of closed
loop at a concurrency, each after an unmeasured warm-up, summed up as a Window. Latency runs from each request's
scheduled send time (loadtest/runner.py), so queueing at an unsustainable rate shows in p99.
"""

from __future__ import annotations

import asyncio

import httpx

from loadtest.discovery import DiscoveryError, ModelInfo, discover, wait_ready
from loadtest.runner import Level, Limits, Recorder, Target, make_pool, run_phase
from loadtest.workload import ANSWER_CHECKS, SeqLenSpec, build_bodies, endpoint
from optimize.measurement import Window, finite_ms

MAX_REQUESTS = 10**9  # windows end by their duration


class LoadError(RuntimeError):
    """The served model cannot be driven: not listed, or never ready."""


def find_model(base_url: str, name: str, timeout_s: float) -> ModelInfo:
    """The model as the service lists it, once it answers ready; LoadError otherwise."""
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        try:
            listed = {m.name: m for m in discover(client, base_url).models}
        except DiscoveryError as exc:
            raise LoadError(str(exc)) from None
        if name not in listed:
            raise LoadError(f"the server does not list {name!r}; it lists {sorted(listed)}")
        model = listed[name]
        if not wait_ready(client, base_url, model, timeout_s):
            raise LoadError(f"{name} was not ready within {timeout_s:g} s")
    return model


class Driver:
    """Drives one model at `base_url` with one request body pool (the same texts in every window)."""

    def __init__(
        self, base_url: str, model: ModelInfo, cores: int, seq_len: int = 32, protocol: str = "simple", seed: int = 0
    ) -> None:
        spec = SeqLenSpec.parse(f"fixed:{seq_len}")
        bodies, _ = build_bodies(spec, model.max_len, 1, (protocol,), seed=seed)
        self.base_url, self.cores, self.protocol = base_url, cores, protocol
        path = endpoint(protocol, model.name)
        self.target = Target(model, path, tuple(bodies[protocol]), 1, protocol, ANSWER_CHECKS.get(protocol))
        self.limits = Limits(duration_s=1.0, max_requests=MAX_REQUESTS, warmup_s=0.0)
        self._windows = 0

    def window(self, mode: str, level: float, seconds: float, warmup_s: float = 0.0) -> Window:
        """`seconds` of load at `level` (requests/s open, workers closed) after `warmup_s` of the same, unmeasured."""
        return asyncio.run(self._window(Level(mode, level), seconds, warmup_s))

    async def _window(self, level: Level, seconds: float, warmup_s: float) -> Window:
        if warmup_s > 0:
            await self._phase(level, warmup_s)
        rec = await self._phase(level, seconds)
        result = rec.result(self.target, level)
        latency = result.latency_ms
        return Window(
            mode=level.mode,
            level=level.value,
            seconds=result.duration_s,
            sent=result.sent,
            ok=result.ok,
            errors=dict(result.errors),
            dropped=result.dropped,
            rps=result.throughput_rps,
            p50_ms=finite_ms(latency.get("p50")),
            p99_ms=finite_ms(latency.get("p99")),
            cores=self.cores,
            client_cpu_pct=result.client_cpu_pct,
        )

    async def _phase(self, level: Level, seconds: float) -> Recorder:
        self._windows += 1  # each window its own Poisson arrivals
        pool = make_pool(self.base_url, self.limits, self.protocol)
        rec = Recorder(seconds, MAX_REQUESTS, asyncio.Event())
        try:
            await run_phase(self.target, level, self.limits, rec, pool, seed=self._windows)
        finally:
            await pool.aclose()
        return rec
