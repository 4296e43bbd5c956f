"""The cluster-faults run's load client, in a process of its own: an open loop at a fixed rate of valid simple-JSON
predicts (`/v1/models/{model}/predict`, the models taken in turn) to Serve's proxy, each attempt bounded by a timeout,
each request retried after a short backoff when its answer is one a client should retry (RETRYABLE). Every request's
record (analysis.Record: the first attempt's outcome is what a client without retries
sees, the last one's what a client with retries sees) goes to a CSV file once the loop has stopped and every request
has ended. Loopback only. No torch, nothing of `service/`.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.cluster_faults.analysis import Record, write_records

# A connection that failed (refused, reset, closed before an answer), the answers of a proxy or service that has
# lost what it was talking to (500, 502, 503), and a 404 that is not the service's JSON (a way in that does not know
# its routes yet: docs/operations.md): retried, as operations.md tells clients to. Inference is idempotent, so a retry
# is safe even when the first attempt did reach a model. A timeout is not retried: the client has waited its limit.
WAY_IN_404 = "404 not JSON"
RETRYABLE = frozenset({"connect_error", "reset", "closed", "500", "502", "503", WAY_IN_404})
TEXTS = tuple(f"steady load through cluster faults, request kind {k}" for k in range(16))
MAX_CONNECTIONS = 2000  # above the requests that can be in flight at the rate x the timeout (a stall holds them all)


@dataclass(frozen=True)
class LoadPlan:
    url: str  # Serve's HTTP proxy: http://127.0.0.1:PORT
    models: tuple[str, ...]  # taken in turn
    rate: float  # requests per second
    timeout_s: float  # per attempt
    retries: int  # attempts after the first, at most
    backoff_s: float  # before the first retry; doubled before each next one
    t0: float  # monotonic time the first request is due
    out: Path  # the records' CSV


def outcome_of(exc: BaseException) -> str:
    """What an attempt that got no HTTP answer counts as."""
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect_error"  # refused: nothing listens (the proxy is down)
    if isinstance(exc, httpx.RemoteProtocolError):
        return "closed"  # the server closed the connection before an answer
    if isinstance(exc, httpx.ReadError | httpx.WriteError | ConnectionError):
        return "reset"
    return "error"


class Load:
    def __init__(self, plan: LoadPlan, client: httpx.AsyncClient) -> None:
        self.plan, self.client = plan, client
        self.bodies = [json.dumps({"text": t}).encode() for t in TEXTS]
        self.records: list[Record] = []

    async def attempt(self, url: str, body: bytes) -> str:
        try:
            async with asyncio.timeout(self.plan.timeout_s):
                response = await self.client.post(url, content=body, headers={"Content-Type": "application/json"})
            json_body = response.headers.get("content-type", "").startswith("application/json")
            return WAY_IN_404 if response.status_code == 404 and not json_body else str(response.status_code)
        except (TimeoutError, httpx.TransportError, OSError) as exc:
            return outcome_of(exc)

    async def one(self, i: int, scheduled: float) -> None:
        plan = self.plan
        model = plan.models[i % len(plan.models)]
        url, body = f"{plan.url}/v1/models/{model}/predict", self.bodies[i % len(self.bodies)]
        sent = time.monotonic()
        first = outcome = await self.attempt(url, body)
        first_end = end = time.monotonic()
        attempts = 1
        while outcome in RETRYABLE and attempts <= plan.retries:
            await asyncio.sleep(plan.backoff_s * 2 ** (attempts - 1))
            outcome = await self.attempt(url, body)
            end, attempts = time.monotonic(), attempts + 1
        self.records.append(Record(i, model, scheduled, sent, first_end, first, end, outcome, attempts))

    async def run(self, stop) -> None:
        """Requests due at t0 + i / rate until `stop` is set, then wait for every one of them to end."""
        running: set[asyncio.Task] = set()
        i = 0
        while not stop.is_set():
            due = self.plan.t0 + i / self.plan.rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            task = asyncio.create_task(self.one(i, due))
            running.add(task)
            task.add_done_callback(running.discard)
            i += 1
        await asyncio.gather(*running)


def run_client(plan: LoadPlan, stop) -> None:
    """The client process's entry: the load until `stop` (a multiprocessing Event) is set, then the records' CSV."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops it
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:  # a stall can hold a connection per request
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))

    async def main() -> None:
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=64)
        # trust_env off: a proxy configured in the environment must not see loopback requests
        async with httpx.AsyncClient(limits=limits, timeout=plan.timeout_s, trust_env=False) as client:
            load = Load(plan, client)
            try:
                await load.run(stop)
            finally:
                write_records(plan.out, sorted(load.records, key=lambda r: r.i))

    asyncio.run(main())
