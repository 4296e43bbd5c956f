"""What one load-client process does (it runs in a process of its own, clients.py): closed-loop connections to the
serving processes' shared port, each opened fresh for the window and kept alive through it, over HTTP v2 infer (JSON
or binary) or gRPC; what ended within the window, and which serving process answered (HTTP's `x-served-by`)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import numpy as np

from benchmarks.serving.requests import binary_requests, request_bodies, request_ids
from loadtest.grpc_client import infer_message
from loadtest.http_client import post_bytes
from service.ingress import SERVED_BY

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
GRPC_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]  # a channel's own connection: gRPC shares them otherwise
RETRY_S = 0.05  # before a connection that failed is opened again


@dataclass(frozen=True)
class Command:
    """A window of load from one client process. `start` and `deadline` are time.monotonic() values, the same clock
    in every process of the machine: what ends before `start` is the warm-up, what is in flight at `deadline` is not
    counted."""

    protocol: str  # "http" or "grpc"
    port: int
    model: str
    body: str  # HTTP's: "json" or "binary"
    connections: int
    start: float
    deadline: float
    seed: int = 0  # which requests, and where in them each connection starts


@dataclass
class Outcome:
    """What one client process counted within its window, and the CPU it took from the command to its end."""

    latencies_s: np.ndarray  # one per 200
    errors: int = 0  # other statuses, and exchanges that failed
    served_by: Counter = field(default_factory=Counter)  # 200s per serving process ("" where none was named)
    cpu_s: float = 0.0
    wall_s: float = 0.0
    failure: str = ""  # the first failed exchange's error


class Tally:
    def __init__(self, start: float, deadline: float) -> None:
        self.start, self.deadline = start, deadline
        self.latencies: list[float] = []
        self.errors, self.failure, self.served_by = 0, "", Counter()

    def add(self, status: int, latency: float, end: float, who: str = "") -> None:
        if self.start <= end <= self.deadline:
            if status == 200:
                self.latencies.append(latency)
                self.served_by[who] += 1
            else:
                self.errors += 1
                self.failure = self.failure or f"HTTP {status}"

    def failed(self, exc: BaseException) -> None:
        if self.start <= time.monotonic() <= self.deadline:
            self.errors += 1
        self.failure = self.failure or f"{type(exc).__name__}: {exc}"


def header_value(head: bytes, name: bytes) -> bytes | None:
    """The value of header `name` (lower case) in a response head, or None."""
    lower = head.lower()
    at = lower.find(b"\r\n" + name + b":")
    if at < 0:
        return None
    start = at + len(name) + 3
    return head[start : head.index(b"\r\n", start)].strip()


def content_length(head: bytes) -> int:
    value = header_value(head, b"content-length")
    if value is None:
        raise ValueError("an answer without Content-Length (the scaling client reads no chunked bodies)")
    return int(value)


def served_by(head: bytes) -> str:
    return (header_value(head, SERVED_BY.encode()) or b"").decode()


def http_requests(model: str, body: str, seed: int) -> list[bytes]:
    path = f"/v2/models/{model}/infer"
    if body == "binary":
        return binary_requests(path, 64)
    return [post_bytes(path, b) for b in request_bodies(64, seed=seed)]


async def _http_connection(cmd: Command, requests: list[bytes], tally: Tally, offset: int) -> None:
    i = offset
    while time.monotonic() < cmd.deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", cmd.port)
        except OSError as exc:
            tally.failed(exc)
            await asyncio.sleep(RETRY_S)
            continue
        try:
            while (sent := time.monotonic()) < cmd.deadline:
                writer.write(requests[i % len(requests)])
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(content_length(head))
                end = time.monotonic()
                tally.add(int(head[9:12]), end - sent, end, served_by(head))
                i += 1
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            tally.failed(exc)
        finally:
            writer.close()


def _http_blocking(cmd: Command, requests: list[bytes], tally: Tally) -> None:
    """One connection on a blocking socket: no event loop's CPU in a c=1 latency."""
    i = 0
    while time.monotonic() < cmd.deadline:
        try:
            with socket.create_connection(("127.0.0.1", cmd.port)) as sock, sock.makefile("rb") as stream:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while (sent := time.monotonic()) < cmd.deadline:
                    sock.sendall(requests[i % len(requests)])
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        if not (line := stream.readline()):
                            raise ConnectionError("the server closed the connection")
                        head += line
                    stream.read(content_length(head))
                    end = time.monotonic()
                    tally.add(int(head[9:12]), end - sent, end, served_by(head))
                    i += 1
        except (OSError, ValueError) as exc:
            tally.failed(exc)
            time.sleep(RETRY_S)


async def _grpc_connection(cmd: Command, messages: list[bytes], tally: Tally, offset: int) -> None:
    """One channel (its own HTTP/2 connection), one call in flight; requests and answers left serialized."""
    i = offset
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cmd.port}", options=GRPC_OPTIONS) as channel:
        call = channel.unary_unary(MODEL_INFER)
        while (sent := time.monotonic()) < cmd.deadline:
            try:
                await call(messages[i % len(messages)])
                status = 200
            except grpc.aio.AioRpcError as exc:
                tally.failed(exc)
                await asyncio.sleep(RETRY_S)
                continue
            end = time.monotonic()
            tally.add(status, end - sent, end)
            i += 1


def _grpc_blocking(cmd: Command, messages: list[bytes], tally: Tally) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{cmd.port}", options=GRPC_OPTIONS) as channel:
        call = channel.unary_unary(MODEL_INFER)
        i = 0
        while (sent := time.monotonic()) < cmd.deadline:
            try:
                call(messages[i % len(messages)])
            except grpc.RpcError as exc:
                tally.failed(exc)
                time.sleep(RETRY_S)
                continue
            end = time.monotonic()
            tally.add(200, end - sent, end)
            i += 1


async def _all(connection, cmd: Command, requests: list[bytes], tally: Tally) -> None:
    await asyncio.gather(*(connection(cmd, requests, tally, cmd.seed * 13 + k * 7) for k in range(cmd.connections)))


def run(cmd: Command) -> Outcome:
    """`cmd`'s window of load, in this process."""
    wall, cpu = time.monotonic(), time.process_time()
    tally = Tally(cmd.start, cmd.deadline)
    if cmd.protocol == "http":
        requests = http_requests(cmd.model, cmd.body, cmd.seed)
        blocking, connection = _http_blocking, _http_connection
    else:
        requests = [infer_message(cmd.model, ids).SerializeToString() for ids in request_ids(64, seed=cmd.seed)]
        blocking, connection = _grpc_blocking, _grpc_connection
    if cmd.connections == 1:
        blocking(cmd, requests, tally)
    else:
        asyncio.run(_all(connection, cmd, requests, tally))
    latencies = np.array(tally.latencies, dtype=np.float64)
    used, took = time.process_time() - cpu, time.monotonic() - wall
    return Outcome(latencies, tally.errors, tally.served_by, used, took, tally.failure)


def serve_commands(conn) -> None:
    """A client process's loop: a Command from the pipe, its Outcome back, until None comes."""
    while (cmd := conn.recv()) is not None:
        try:
            conn.send(run(cmd))
        except Exception as exc:  # sent back whole: the run reports it and stops
            conn.send(exc)
