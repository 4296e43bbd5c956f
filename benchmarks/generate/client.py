"""The streaming client for both servers: closed loops of streamed OpenAI completions (POST /openai/v1/completions,
stream true), one keep-alive connection per loop, each token timed as its server-sent event arrives. Raw asyncio HTTP
/1.1: on 2 cores the client's CPU per token is taken from the server it measures, so it parses no more than it must.
No torch."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np

from benchmarks.generate.figures import Timed, figures

PATH = "/openai/v1/completions"


def completion_body(model: str, prompt: np.ndarray, new: int) -> bytes:
    """A greedy streamed completion of exactly `new` tokens of token-id `prompt` (T,)."""
    body = {"model": model, "prompt": prompt.tolist(), "max_tokens": new, "temperature": 0, "ignore_eos": True}
    return json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}).encode()


def _request(port: int, body: bytes) -> bytes:
    head = f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


def _event(payload: bytes, one: Timed, now: float) -> None:
    """One `data:` event: a chunk with a choice is a token; a usage says how many tokens there were."""
    if payload == b"[DONE]":
        return
    chunk = json.loads(payload)
    if "error" in chunk:
        one.error = str(chunk["error"])
    if chunk.get("choices"):
        one.token_times.append(now)
    if chunk.get("usage"):
        one.tokens = int(chunk["usage"]["completion_tokens"])


async def _body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    """The rest of a non-streamed answer (an error), by its Content-Length or its chunks."""
    lines = head.lower().split(b"\r\n")
    length = next((int(h.split(b":")[1]) for h in lines if h.startswith(b"content-length:")), None)
    if length is not None:
        return await reader.readexactly(length)
    out = b""
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        out += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return out


async def stream_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int, body: bytes) -> Timed:
    """One streamed completion on an open connection, which stays usable for the next (the chunked body read to
    its end)."""
    one = Timed(time.perf_counter())
    writer.write(_request(port, body))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        one.error = head.split(b"\r\n", 1)[0].decode() + " " + (await _body(reader, head)).decode(errors="replace")
        return one
    pending = b""
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):  # chunked: uvicorn's streamed body
        pending += (await reader.readexactly(size + 2))[:-2]
        now = time.perf_counter()
        *events, pending = pending.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: "):
                _event(event[6:], one, now)
    await reader.readuntil(b"\r\n")  # the last chunk's empty trailer
    return one


async def closed_loop(port: int, bodies: list[bytes]) -> list[Timed]:
    """`bodies` streamed one after the other on one keep-alive connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return [await stream_one(reader, writer, port, body) for body in bodies]
    finally:
        writer.close()


async def _closed_loops(port: int, bodies: list[list[bytes]]) -> tuple[list[Timed], float]:
    start = time.perf_counter()
    done = await asyncio.gather(*(closed_loop(port, mine) for mine in bodies))
    return [t for mine in done for t in mine], time.perf_counter() - start


def served(port: int, model: str, prompts: np.ndarray, new: int, repeats: int) -> dict:
    """One closed loop per row of `prompts` (B, T), side by side, each sending `repeats` completions of its row one
    after the other; the figures from the first request sent to the last token read."""
    bodies = [[completion_body(model, row, new)] * repeats for row in prompts]
    timed, seconds = asyncio.run(_closed_loops(port, bodies))
    return figures(timed, seconds)
