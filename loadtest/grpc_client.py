"""Closed-loop load over the Open Inference Protocol's gRPC service, counted like `http_client.load`: one channel
(HTTP/2 carries every concurrent call, as tritonclient.grpc does), `concurrency` calls in flight, what ended within
the window. No torch.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np

from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from loadtest.http_client import LoadResult


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
    kept = [o for o in out if start <= o[2] <= deadline]
    ok = np.array([t for s, t, _ in kept if s == 200])
    return LoadResult(len(ok), sum(1 for s, _, _ in kept if s != 200), seconds, ok)
