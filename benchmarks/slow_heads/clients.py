"""The slow-heads run's clients: N connections trickling a request head a line at a time (run in a process of its
own), and a probe sending small predicts on one kept-alive connection meanwhile. Loopback only."""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import threading
import time
from itertools import count

CONNECTING = 512  # connects in flight at once: under the listen backlog (2048), so no handshake waits on a full queue


def outcome(answer: bytes) -> str:
    """What the server did with a slow head, from all it sent before its close: "408", "503", "bare close", or
    "other" (any other answer)."""
    if not answer:
        return "bare close"
    status = answer[9:12].decode(errors="replace") if answer.startswith(b"HTTP/1.1 ") else ""
    return status if status in ("408", "503") else "other"


async def _slow_head(port: int, line_every_s: float, give_up_s: float, connecting: asyncio.Semaphore):
    """One connection sending a request line, then a header line every `line_every_s`, until the server closes:
    (outcome, monotonic time of its first byte, seconds from it to the close)."""
    async with connecting:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return "connect failed", float("nan"), float("nan")
    start = time.monotonic()
    writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n")

    async def trickle() -> None:
        for i in count():
            await asyncio.sleep(line_every_s)
            writer.write(b"X-Slow-%d: v\r\n" % i)

    trickling = asyncio.create_task(trickle())
    answer = b""
    try:
        async with asyncio.timeout(give_up_s):
            while chunk := await reader.read(65536):
                answer += chunk
        result = outcome(answer)
    except TimeoutError:
        result = "still open"
    except ConnectionError:
        result = "reset"
    seconds = time.monotonic() - start
    trickling.cancel()
    writer.close()
    return result, start, seconds


def slow_client(port: int, n: int, line_every_s: float, give_up_s: float) -> dict:
    """Run in a process of its own: n slow heads at once; their records and the descriptor limit it ran under."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, n + 1024)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))

    async def all_of_them() -> list:
        connecting = asyncio.Semaphore(CONNECTING)
        return await asyncio.gather(*(_slow_head(port, line_every_s, give_up_s, connecting) for _ in range(n)))

    begin = time.monotonic()
    records = asyncio.run(all_of_them())
    return {"begin": begin, "end": time.monotonic(), "nofile": target, "records": records}


class Probe(threading.Thread):
    """A small predict request every `every_s` on one kept-alive connection (a new one after a failure); each
    sample: (monotonic start, seconds, or None for a failure: an error, a timeout, a status other than 200)."""

    def __init__(self, port: int, model: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.port, self.path, self.every_s = port, f"/v1/models/{model}/predict", every_s
        self.samples: list[tuple[float, float | None]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        body, headers = json.dumps({"text": "still answered?"}).encode(), {"Content-Type": "application/json"}
        conn, next_at = None, time.monotonic()
        while not self.stopping.is_set():
            start = time.monotonic()
            try:
                conn = conn or http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("POST", self.path, body, headers)
                response = conn.getresponse()
                response.read()
                seconds = time.monotonic() - start if response.status == 200 else None
            except (OSError, http.client.HTTPException):
                conn.close()
                conn, seconds = None, None
            self.samples.append((start, seconds))
            next_at = max(next_at + self.every_s, time.monotonic())
            self.stopping.wait(next_at - time.monotonic())
        if conn is not None:
            conn.close()
