"""Closed-loop load over the Open Inference Protocol's gRPC service, counted like `http_client.load`: one channel
(HTTP/2 carries every concurrent call, as tritonclient.grpc does), `concurrency` calls in flight, what ended within
the window. No torch.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np

from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from loadtest.http_client import HTTPError, LoadResult, Response


def infer_message(model: str, ids: np.ndarray) -> pb.ModelInferRequest:
    """A ModelInferRequest of (B, T) token ids as raw input contents (tritonclient.grpc's default)."""
    message = pb.ModelInferRequest(model_name=model)
    message.inputs.add(name="input_ids", datatype="INT64", shape=list(ids.shape))
    message.raw_input_contents.append(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return message


async def _run(url: str, messages: list, concurrency: int, deadline: float) -> list:
    out: list[tuple[int, float, float]] = []  # (status, latency, when it ended)
    async with grpc.aio.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)

        async def caller(offset: int) -> None:
            i = offset
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                try:
                    await stub.ModelInfer(messages[i % len(messages)])
                    status = 200
                except grpc.aio.AioRpcError:
                    status = 500
                end = time.perf_counter()
                out.append((status, end - start, end))
                i += 1

        await asyncio.gather(*(caller(k * 7) for k in range(concurrency)))
    return out


def _one_caller(url: str, messages: list, deadline: float) -> list:
    """One blocking call at a time (grpc's synchronous stub): no event loop's CPU in the client's latency."""
    out: list[tuple[int, float, float]] = []
    with grpc.insecure_channel(url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        i = 0
        while (start := time.perf_counter()) < deadline:
            try:
                stub.ModelInfer(messages[i % len(messages)])
                status = 200
            except grpc.RpcError:
                status = 500
            end = time.perf_counter()
            out.append((status, end - start, end))
            i += 1
    return out


def load(url: str, messages: list, concurrency: int, seconds: float, warmup_s: float = 0.0) -> LoadResult:
    """`concurrency` calls in flight on one channel to `url` (host:port) for `warmup_s` (not counted), then
    `seconds`; a call that fails counts as an error."""
    start = time.perf_counter() + warmup_s
    deadline = start + seconds
    if concurrency == 1:
        out = _one_caller(url, messages, deadline)
    else:
        out = asyncio.run(_run(url, messages, concurrency, deadline))
    return LoadResult.within(out, start, deadline)


def server_live(address: str, timeout_s: float) -> str:
    """Why the gRPC service at `address` (host:port) is not live (its ServerLive's error), or "" when it is."""
    with grpc.insecure_channel(address) as channel:
        try:
            answer = pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    return "" if answer.live else "ServerLive answered live: false"


# A failed call as the HTTP status the same error gets over HTTP, so the load tester's report counts both alike.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
}


class GrpcPool:
    """One channel for a load-test phase, with ConnectionPool's `post(path, body)`: the body is a serialized request
    message, the path the method; a failed call answers its HTTP twin's status and `{"error": details}`."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.aio.insecure_channel(address)
        self._methods: dict[str, grpc.aio.UnaryUnaryMultiCallable] = {}
        self._streams: dict[str, grpc.aio.UnaryStreamMultiCallable] = {}

    async def post(self, path: str, body: bytes, headers: Sequence[tuple[str, str]] = ()) -> Response:
        """Call `path` with `body` (`headers` are HTTP's: a request message carries all it needs)."""
        method = self._methods.get(path)
        if method is None:
            method = self._methods[path] = self._channel.unary_unary(path)  # bytes in, bytes out
        try:
            return Response(200, await method(body, timeout=self.timeout_s))
        except grpc.aio.AioRpcError as exc:
            return self._failed(exc)

    async def stream(self, path: str, body: bytes, on_message: Callable[[bytes], None]) -> Response:
        """Call the server-streaming method `path` with `body`, handing each answer message to `on_message` as it
        arrives; a 200 with an empty body when the stream ends well, a failed call as `post` answers it."""
        method = self._streams.get(path)
        if method is None:
            method = self._streams[path] = self._channel.unary_stream(path)  # bytes in, bytes out
        try:
            async for message in method(body, timeout=self.timeout_s):
                on_message(message)
        except grpc.aio.AioRpcError as exc:
            return self._failed(exc)
        return Response(200, b"")

    def _failed(self, exc: grpc.aio.AioRpcError) -> Response:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise HTTPError("timeout", f"no answer within {self.timeout_s:g} s") from None
        if code == grpc.StatusCode.UNAVAILABLE and "connect" in details.lower():
            raise HTTPError("connect_error", f"cannot connect to {self.address}: {details}") from None
        return Response(HTTP_STATUS.get(code, 500), json.dumps({"error": f"{code.name}: {details}"}).encode())

    async def aclose(self) -> None:
        await self._channel.close()
