"""The soak run's load client, run in a process of its own so that its CPU is counted apart from the server's: the
capacity first (closed loop over the mix's valid requests), then open-loop arrivals at a fraction of it: every model,
HTTP v2 JSON, simple JSON and gRPC, invalid requests, early disconnects and now and then a slow client. Each sample
interval's answers go to the parent as soon as the interval closes. Loopback only. No torch, nothing of `service/`.
"""

from __future__ import annotations

import asyncio
import math
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

from loadtest.grpc_client import GrpcPool
from loadtest.http_client import ConnectionPool, HTTPError, post_bytes
from loadtest.workload import GRPC_INFER, SeqLenSpec, encode_body, endpoint, make_texts

PROTOCOLS = ("v2", "simple", "grpc")  # a valid request's way in, drawn evenly
INVALID = ("bad json", "unknown model", "too long", "unknown model grpc", "too long grpc")  # taken in turn
UNKNOWN_MODEL = "no-such-model"
SEQ_LEN = SeqLenSpec("uniform", 16, 48)  # tokens per valid request (clamped to a model's max_len)
# HTTP keep-alive connections, taken in turn: at the soak's rates each is used well within the ingress's 30 s idle
# limit, so all stay open all run and the ingress's descriptor count moves only with what the server itself holds.
HTTP_CONNECTIONS = 32
MAX_OUTSTANDING = 512  # arrivals beyond this many requests in flight are dropped (and counted)
SLOW_PIECES = 10  # a slow client's body, in this many pieces over ~1 s


@dataclass(frozen=True)
class Mix:
    """What the open loop sends besides valid requests."""

    invalid: float = 0.03  # share of arrivals: an invalid request (each of INVALID in turn), 4xx expected
    disconnect: float = 0.01  # share of arrivals: a valid request on a connection of its own, closed before the answer
    slow_every_s: float = 15.0  # one slow client this often: a valid request whose body comes in pieces over ~1 s


@dataclass(frozen=True)
class Plan:
    """What the client drives, and where."""

    port: int
    grpc_port: int
    models: tuple[tuple[str, int], ...]  # (name, max_len) of each served model
    fraction: float  # of the measured capacity
    duration_s: float
    sample_s: float
    capacity_s: float = 5.0
    concurrency: int = 32  # of the capacity's closed loop
    mix: Mix = field(default_factory=Mix)
    seed: int = 0
    timeout_s: float = 30.0


@dataclass
class Tally:
    """One interval's answers: latencies (ms, from the scheduled send) of valid 200s by model, every outcome by
    (kind, outcome), slow clients' latencies, arrivals dropped for too many in flight."""

    latencies_ms: dict[str, list[float]] = field(default_factory=dict)
    outcomes: Counter = field(default_factory=Counter)
    slow_ms: list[float] = field(default_factory=list)
    dropped: int = 0


def intervals(duration_s: float, sample_s: float) -> int:
    """How many sample intervals a run has (the last may be shorter)."""
    return max(1, math.ceil(duration_s / sample_s - 1e-9))


def interval_of(end: float, t0: float, sample_s: float, last: int) -> int:
    """The interval (1..last) an answer at monotonic time `end` falls in: k covers (t0 + (k-1) S, t0 + k S]; answers
    after the run's end count in the last."""
    return min(max(1, math.ceil((end - t0) / sample_s)), last)


def classify(kind: str, outcome: str) -> str:
    """What an answer means for the verdict: "ok", "expected 4xx" (an invalid request refused), "5xx", "unanswered"
    (no HTTP answer: timeout, closed, refused), "unexpected" (a valid request not answered 200, an invalid one not
    refused), or "disconnect" (closed by the client on purpose)."""
    if kind == "disconnect":
        return "disconnect"
    if not outcome.isdigit():
        return "unanswered"
    code = int(outcome)
    if code >= 500:
        return "5xx"
    if kind == "invalid":
        return "expected 4xx" if 400 <= code < 500 else "unexpected"
    return "ok" if code == 200 else "unexpected"


class Requests:
    """Every body the client sends, made once: per model and protocol a small pool of valid bodies, and the invalid
    ones."""

    def __init__(self, models: tuple[tuple[str, int], ...], seed: int) -> None:
        self.valid: dict[tuple[str, str], list[bytes]] = {}
        self.raw: dict[str, list[bytes]] = {}  # whole v2 HTTP requests, for the clients on connections of their own
        for i, (name, max_len) in enumerate(models):
            texts, _ = make_texts(SEQ_LEN, max_len, 16, seed + i)
            for protocol in PROTOCOLS:
                self.valid[name, protocol] = [encode_body(protocol, [t], name) for t in texts]
            path = endpoint("v2", name)
            self.raw[name] = [post_bytes(path, b, {"Connection": "close"}) for b in self.valid[name, "v2"]]
        name, max_len = models[0]
        long_text = "x" * (max_len + 8)  # max_len + 9 tokens with the BOS
        self.invalid = {
            "bad json": (endpoint("v2", name), b'{"inputs": ['),
            "unknown model": (endpoint("simple", UNKNOWN_MODEL), encode_body("simple", ["hello"])),
            "too long": (endpoint("simple", name), encode_body("simple", [long_text])),
            "unknown model grpc": (GRPC_INFER, encode_body("grpc", ["hello"], UNKNOWN_MODEL)),
            "too long grpc": (GRPC_INFER, encode_body("grpc", [long_text], name)),
        }


class Client:
    """The pools (HTTP keep-alive connections, one gRPC channel) and one coroutine per kind of request, each
    returning its outcome: the status as text, a transport error's kind, or "sent" for an early disconnect."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.requests = Requests(plan.models, plan.seed)
        self.http: asyncio.Queue[ConnectionPool] = asyncio.Queue()  # a pool of one connection each, first in first out
        for _ in range(HTTP_CONNECTIONS):
            self.http.put_nowait(ConnectionPool(f"http://127.0.0.1:{plan.port}", plan.timeout_s))
        self.grpc = GrpcPool(f"127.0.0.1:{plan.grpc_port}", plan.timeout_s)

    async def post(self, path: str, body: bytes) -> str:
        try:
            if path == GRPC_INFER:
                return str((await self.grpc.post(path, body)).status)
            connection = await self.http.get()
            try:
                return str((await connection.post(path, body)).status)
            finally:
                self.http.put_nowait(connection)
        except HTTPError as exc:
            return exc.kind

    async def valid(self, model: str, protocol: str, i: int) -> str:
        bodies = self.requests.valid[model, protocol]
        return await self.post(GRPC_INFER if protocol == "grpc" else endpoint(protocol, model), bodies[i % len(bodies)])

    async def invalid(self, which: str) -> str:
        return await self.post(*self.requests.invalid[which])

    async def disconnect(self, model: str, i: int, rng: random.Random) -> str:
        """A whole request on a connection of its own, closed a few milliseconds later: before the answer."""
        raw = self.requests.raw[model]
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", self.plan.port)
        except OSError:
            return "connect_error"
        try:
            writer.write(raw[i % len(raw)])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.005))
        except OSError:
            return "connection_closed"
        finally:
            writer.close()
        return "sent"

    async def slow(self, model: str, i: int) -> str:
        """A request whose body comes in SLOW_PIECES pieces over ~1 s on a connection of its own (then closed)."""
        raw = self.requests.raw[model][i % len(self.requests.raw[model])]
        head, _, body = raw.partition(b"\r\n\r\n")
        step = -(-len(body) // SLOW_PIECES)
        try:
            async with asyncio.timeout(self.plan.timeout_s):
                reader, writer = await asyncio.open_connection("127.0.0.1", self.plan.port)
                try:
                    writer.write(head + b"\r\n\r\n")
                    for start in range(0, len(body), step):
                        await asyncio.sleep(1.0 / SLOW_PIECES)
                        writer.write(body[start : start + step])
                    answer = await reader.read()  # Connection: close: the answer ends with the connection
                finally:
                    writer.close()
        except TimeoutError:
            return "timeout"
        except OSError:
            return "connection_closed"
        return answer[9:12].decode() if answer.startswith(b"HTTP/1.1 ") else "connection_closed"

    async def aclose(self) -> None:
        while not self.http.empty():
            await self.http.get_nowait().aclose()
        await self.grpc.aclose()


async def capacity(client: Client, rng: random.Random) -> float:
    """Valid requests answered 200 per second by a closed loop of `plan.concurrency` over every model and protocol,
    for `plan.capacity_s` after a second of warm-up."""
    plan, names = client.plan, [name for name, _ in client.plan.models]
    start = time.monotonic() + 1.0
    deadline = start + plan.capacity_s
    ok = 0

    async def worker() -> None:
        nonlocal ok
        i = 0
        while time.monotonic() < deadline:
            outcome = await client.valid(rng.choice(names), rng.choice(PROTOCOLS), i)
            i += 1
            if outcome == "200" and start <= time.monotonic() <= deadline:
                ok += 1

    await asyncio.gather(*(worker() for _ in range(plan.concurrency)))
    return ok / plan.capacity_s


class OpenLoop:
    """Poisson arrivals at `rate` from `t0` for the run's duration, each a kind drawn by the mix, plus the slow
    clients; every answer tallied in its interval, each interval sent (`ship`) as soon as it has closed."""

    def __init__(self, client: Client, rate: float, t0: float, ship, stop) -> None:
        self.client, self.rate, self.t0, self.ship, self.stop = client, rate, t0, ship, stop
        self.plan = client.plan
        self.last = intervals(self.plan.duration_s, self.plan.sample_s)
        self.tallies: dict[int, Tally] = {}
        self.rng = random.Random(self.plan.seed)
        self.names = [name for name, _ in self.plan.models]

    def tally(self, at: float) -> Tally:
        return self.tallies.setdefault(interval_of(at, self.t0, self.plan.sample_s, self.last), Tally())

    async def one(self, scheduled: float, n: int) -> None:
        """Arrival number `n`, due at `scheduled`: what it is, sent, its outcome tallied."""
        u, model = self.rng.random(), self.rng.choice(self.names)
        mix = self.plan.mix
        if u < mix.invalid:
            kind, outcome = "invalid", await self.client.invalid(INVALID[n % len(INVALID)])
        elif u < mix.invalid + mix.disconnect:
            kind, outcome = "disconnect", await self.client.disconnect(model, n, self.rng)
        else:
            kind, outcome = "valid", await self.client.valid(model, self.rng.choice(PROTOCOLS), n)
        end = time.monotonic()
        tally = self.tally(end)
        tally.outcomes[kind, outcome] += 1
        if kind == "valid" and outcome == "200":
            tally.latencies_ms.setdefault(model, []).append((end - scheduled) * 1e3)

    async def slow_clients(self, end: float) -> None:
        n, at = 0, self.t0 + self.plan.mix.slow_every_s / 2
        while at < end and not self.stop.is_set():
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            start = time.monotonic()
            outcome = await self.client.slow(self.rng.choice(self.names), n)
            done = time.monotonic()
            tally = self.tally(done)
            tally.outcomes["slow", outcome] += 1
            if outcome == "200":
                tally.slow_ms.append((done - start) * 1e3)
            n, at = n + 1, at + self.plan.mix.slow_every_s

    async def shipper(self) -> None:
        for k in range(1, self.last):
            await asyncio.sleep(max(0.0, self.t0 + k * self.plan.sample_s + 0.02 - time.monotonic()))
            self.ship(k, self.tallies.pop(k, Tally()))

    async def run(self) -> None:
        end = self.t0 + self.plan.duration_s
        shipping = asyncio.create_task(self.shipper())
        slow = asyncio.create_task(self.slow_clients(end))
        inflight: set[asyncio.Task] = set()
        at, n = self.t0 + self.rng.expovariate(self.rate), 0
        while at < end and not self.stop.is_set():
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            if len(inflight) >= MAX_OUTSTANDING:
                self.tally(at).dropped += 1
            else:
                task = asyncio.create_task(self.one(at, n))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            at, n = at + self.rng.expovariate(self.rate), n + 1
        await asyncio.gather(slow, *inflight)
        await shipping
        self.ship(self.last, self.tallies.pop(self.last, Tally()))  # what ended after the run's end is in it too


def run_client(plan: Plan, queue, stop) -> None:
    """The client process's entry: ("capacity", requests/s, offered rate, t0), then ("interval", k, Tally) for each
    interval, on `queue` (or ("error", message) when there is no capacity to drive); it ends once `stop` is set."""

    async def main() -> None:
        client = Client(plan)
        try:
            measured = await capacity(client, random.Random(plan.seed))
            if measured <= 0:
                queue.put(("error", "no valid request was answered 200 while the capacity was measured"))
                return
            rate = plan.fraction * measured
            t0 = time.monotonic() + 0.5
            queue.put(("capacity", measured, rate, t0))
            await OpenLoop(client, rate, t0, lambda k, t: queue.put(("interval", k, t)), stop).run()
            while not stop.is_set():  # the connections stay open until the parent's last sample is taken
                await asyncio.sleep(0.1)
        finally:
            await client.aclose()

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops it
    asyncio.run(main())
