"""One model at one load level: closed loop (N workers back to back) or open loop (Poisson arrivals at a rate).

Open-loop latency runs from each request's scheduled send time, so a slow server cannot slow the arrivals down and
hide its own queueing (no coordinated omission); arrivals beyond the outstanding cap are dropped and counted.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import ssl
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from loadtest.discovery import ModelInfo
from loadtest.grpc_client import GrpcPool
from loadtest.http_client import ConnectionPool, HTTPError, Response
from loadtest.routes import UNNAMED
from loadtest.stats import LevelResult, latency_summary, percentile
from loadtest.streams import StreamTiming, stream_request
from loadtest.workload import DEFAULT_PROTOCOL, RequestBody

_HEADERS = {"content-type": "application/json"}
ABORT_AFTER = 20  # a level whose first ABORT_AFTER requests all fail is stopped early


@dataclass(frozen=True)
class Limits:
    """Bounds on every level: time, request count, warm-up, per-request timeout, open-loop outstanding cap."""

    duration_s: float
    max_requests: int
    warmup_s: float = 2.0
    timeout_s: float = 30.0
    max_outstanding: int = 256


@dataclass(frozen=True)
class Level:
    """A load level: `closed` with `value` workers, or `open` at `value` requests per second."""

    mode: str
    value: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "closed" else f"rate={self.value:g}/s"


@dataclass(frozen=True)
class Target:
    """Where requests for one model (or route) under one protocol go, the bodies they carry (cycled), what else than
    a 200 a good answer must be (`check` says what is wrong with one, "" when nothing), and for a route, how to read
    which model answered."""

    model: ModelInfo
    path: str  # under the service's base URL, e.g. /v1/models/mha-h8-d512/predict
    bodies: tuple[RequestBody, ...]
    batch_size: int
    protocol: str = DEFAULT_PROTOCOL
    check: Callable[[Response, int], str] | None = None  # (answer, sequences asked) -> problem
    answered_by: Callable[[Response], str] | None = None  # (answer) -> the model that answered it, "" if unnamed
    generate: bool = False  # each request a streamed completion (loadtest.streams), timed per token


class Recorder:
    """The running tally of one phase; also decides when the phase must stop sending."""

    def __init__(self, duration_s: float, max_requests: int, stop: asyncio.Event):
        self.start = time.perf_counter()
        self.deadline = self.start + duration_s
        self.max_requests = max_requests
        self.stop = stop
        self.sent = self.ok = self.sequences = self.dropped = 0
        self.latencies: list[float] = []
        self.streams: list[StreamTiming] = []  # a generation level's successful streams
        self.lags: list[float] = []
        self.errors: Counter[str] = Counter()
        self.examples: dict[str, str] = {}
        self.answered_by: Counter[str] = Counter()  # a route's successful answers by the model that answered
        self.last_done = self.start
        self.stopped_by = ""
        self.cpu_start = time.process_time()
        self.cpu_s = 0.0

    def finish(self) -> None:
        """Close the phase: the CPU time this process spent on it."""
        self.cpu_s = time.process_time() - self.cpu_start

    def take(self, scheduled: bool = False) -> bool:
        """Reserve one send; False (and why, in stopped_by) once any bound is reached.

        A `scheduled` send (open loop) is never refused for lateness: its schedule already ends within the duration,
        and a late send is measured from its scheduled time.
        """
        if not self.stopped_by:
            if self.stop.is_set():
                self.stopped_by = "interrupted"
            elif self.sent >= self.max_requests:
                self.stopped_by = "max_requests"
            elif not scheduled and time.perf_counter() >= self.deadline:
                self.stopped_by = "duration"
        if self.stopped_by:
            return False
        self.sent += 1
        return True

    def record(
        self,
        latency_s: float,
        error: str,
        message: str,
        sequences: int,
        answered_by: str | None = None,
        stream: StreamTiming | None = None,
    ) -> None:
        """One answer: its latency, its error ("" for a success, `message` for an example of it); for a route's
        success, the model that answered ("" when the answer does not say); for a stream, its timing."""
        self.last_done = time.perf_counter()
        if not error:
            self.ok += 1
            self.sequences += sequences
            self.latencies.append(latency_s)
            if stream is not None:
                self.streams.append(stream)
            if answered_by is not None:
                self.answered_by[answered_by or UNNAMED] += 1
            return
        self.errors[error] += 1
        self.examples.setdefault(error, message[:300])
        failed = sum(self.errors.values())
        if self.ok == 0 and failed >= ABORT_AFTER and not self.stopped_by:
            self.stopped_by = f"aborted: the first {failed} requests all failed ({self.describe_errors()})"

    def describe_errors(self) -> str:
        if self.sent == 0:
            return "nothing was sent"
        return ", ".join(f"{k}: {n}" for k, n in self.errors.most_common()) or "nothing was answered"

    def result(self, target: Target, level: Level) -> LevelResult:
        # the measured window: the whole --duration when that was the bound (an open loop's last arrival may come
        # early), else until the last answer
        end = max(self.last_done, self.deadline) if self.stopped_by in ("", "duration") else self.last_done
        window = max(end - self.start, 1e-9)
        m = target.model
        return LevelResult(
            model=m.name,
            heads=m.heads,
            head_dim=m.head_dim,
            d_model=m.d_model,
            precision=m.precision,
            protocol=target.protocol,
            mode=level.mode,
            concurrency=int(level.value) if level.mode == "closed" else 0,
            offered_rate=level.value if level.mode == "open" else 0.0,
            batch_size=target.batch_size,
            duration_s=round(window, 3),
            sent=self.sent,
            ok=self.ok,
            errors=dict(self.errors),
            dropped=self.dropped,
            throughput_rps=round(self.ok / window, 3),
            sequences_per_s=round(self.sequences / window, 3),
            latency_ms=latency_summary(self.latencies),
            send_lag_p99_ms=round(percentile(self.lags, 99) * 1000, 3) if self.lags else 0.0,
            stopped_by=self.stopped_by or "duration",
            client_cpu_pct=round(100 * self.cpu_s / max(self.last_done - self.start, 1e-9), 1),
            error_examples=dict(self.examples),
            targets=m.route.weights() if m.route else {},
            answered_by=dict(self.answered_by),
            kv_heads=m.kv_heads,
        )


async def post(pool: ConnectionPool | GrpcPool, target: Target, body: RequestBody) -> tuple[str, str, str | None]:
    """Send one request; ("", "", answered by) on HTTP 200 (that passes the target's check; answered by is None
    unless the target is a route), else (status code, transport error kind or `malformed_answer`, message, None)."""
    try:
        response = await pool.post(target.path, body.content, body.headers)
    except HTTPError as exc:
        return exc.kind, str(exc), None
    if response.status == 200:
        problem = target.check(response, body.sequences) if target.check else ""
        if problem:
            return "malformed_answer", problem, None
        return "", "", target.answered_by(response) if target.answered_by else None
    try:
        message = str(json.loads(response.body).get("error", response.body[:300]))
    except (ValueError, AttributeError):
        message = response.body[:300].decode("utf-8", errors="replace")
    return str(response.status), message, None


async def send(
    pool: ConnectionPool | GrpcPool, target: Target, body: RequestBody, start: float
) -> tuple[str, str, str | None, StreamTiming | None]:
    """One request (`post`), or for a generating target one stream timed from `start`: (error, message, answered
    by, the stream's timing)."""
    if target.generate:
        error, message, timing = await stream_request(pool, target.path, target.protocol, body, start)
        return error, message, None, timing
    return (*await post(pool, target, body), None)


def poisson_schedule(rate: float, duration_s: float, max_requests: int, rng: random.Random) -> list[float]:
    """Send times (seconds from the start) of a Poisson process at `rate`, within `duration_s`, at most max_requests."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s and len(times) < max_requests:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def closed_loop(pool: ConnectionPool, target: Target, workers: int, rec: Recorder) -> None:
    """`workers` tasks, each sending its next request as soon as the previous one is answered."""
    bodies = target.bodies

    async def worker(k: int) -> None:
        while rec.take():
            body = bodies[k % len(bodies)]
            k += workers
            t = time.perf_counter()
            error, message, answered_by, stream = await send(pool, target, body, t)
            rec.record(time.perf_counter() - t, error, message, body.sequences, answered_by, stream)

    await asyncio.gather(*(worker(i) for i in range(workers)))


async def open_loop(pool: ConnectionPool, target: Target, rate: float, cap: int, rec: Recorder, seed: int) -> None:
    """Poisson arrivals at `rate`; latency measured from the scheduled time; arrivals over `cap` outstanding dropped."""
    schedule = poisson_schedule(rate, rec.deadline - rec.start, rec.max_requests, random.Random(seed))
    inflight: set[asyncio.Task] = set()

    async def one(scheduled: float, body: RequestBody) -> None:
        rec.lags.append(time.perf_counter() - scheduled)
        error, message, answered_by, stream = await send(pool, target, body, scheduled)
        rec.record(time.perf_counter() - scheduled, error, message, body.sequences, answered_by, stream)

    try:
        for i, at in enumerate(schedule):
            scheduled = rec.start + at
            delay = scheduled - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(inflight) >= cap:
                rec.dropped += 1
                continue
            if not rec.take(scheduled=True):
                break
            task = asyncio.create_task(one(scheduled, target.bodies[i % len(target.bodies)]))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.gather(*inflight)
    finally:
        for task in inflight:
            task.cancel()


async def run_phase(
    target: Target, level: Level, limits: Limits, rec: Recorder, pool: ConnectionPool, seed: int = 0
) -> None:
    """Drive one phase until a bound stops it; after Ctrl-C, in-flight requests get one second, then are dropped."""
    if level.mode == "closed":
        work = closed_loop(pool, target, int(level.value), rec)
    else:
        work = open_loop(pool, target, level.value, limits.max_outstanding, rec, seed)
    task = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(rec.stop.wait())
    try:
        await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            rec.stopped_by = rec.stopped_by or "interrupted"
            await asyncio.wait({task}, timeout=1.0)
    finally:
        stopper.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        rec.finish()


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # made once: loading the CA store takes ~0.1 s


def make_pool(address: str, limits: Limits, protocol: str = DEFAULT_PROTOCOL) -> ConnectionPool | GrpcPool:
    """Keep-alive connections to the service for one phase (as many as the phase has requests in flight), or for
    `grpc` one channel to `address` (host:port) that carries them all."""
    if protocol == "grpc":
        return GrpcPool(address, limits.timeout_s)
    return ConnectionPool(address, limits.timeout_s, _tls() if address.startswith("https") else None)
