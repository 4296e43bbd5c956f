"""Admission of generation requests by `mha-serving serve`, as clients see it: a decoder in its own deployment has one
queue, its engine's (one more request than the engine holds is a 503 at once, never a wait in Serve's queue);
streams hold only generation's share of `limits.max_in_flight`, so a classifier is answered while every decoder is
full; and generation's 400s are counted in the request metrics like the classifiers'."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time

import httpx
import pytest
from conftest import export_tiny_decoder, export_tiny_model
from prometheus import series_total

from benchmarks.harness.server import ServerProcess

REMOTE = "lm-h4-kv4-d256"  # in a deployment of its own
COLOCATED = "lm-h4-kv2-d32"
CLASSIFIER = "mha-h2-d32"
CONTEXT = 2048  # each stream asks for the whole context: it runs for seconds, longer than any check here
MAX_RUNNING, MAX_WAITING = 32, 100  # the engine holds 132 (more than a classifier deployment's 64 ongoing)
MAX_IN_FLIGHT = 300  # generation's share: three quarters, 225
SETTLE_S = 0.5  # after the last answer expected, how long no other may come

pytestmark = [pytest.mark.serve, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("admission-models")
    # d_model 256: a step's time is mostly ONNX Runtime's (the GIL released), as a real decoder's; a d_model 32
    # decoder's steps are mostly Python, and its engine's thread then starves the replica's event loop, delaying
    # requests there (by up to 1.3 s, measured) whatever the limits
    export_tiny_decoder(out, 4, CONTEXT, seed=5, d_model=256, layers=4, spread=False)
    export_tiny_decoder(out, 2, CONTEXT, seed=3)
    export_tiny_model(out, heads=2, seed=2)
    config = {
        "models_dir": str(out),
        "backend": "cpu",
        "generate": {
            # every running stream's whole context, with room to spare: the running ones are bounded by max_running
            "kv_cache_tokens": 4 * MAX_RUNNING * CONTEXT,
            "max_running": MAX_RUNNING,
            "max_waiting": MAX_WAITING,
            "threads": 1,
            "queue_timeout_s": 120.0,  # no waiting stream times out during a test
        },
        "limits": {"max_in_flight": MAX_IN_FLIGHT},
        "overrides": {REMOTE: {"placement": "deployment"}},
    }
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # Ray's export every second, as tests/serving.py
    with ServerProcess(config) as running:
        _warm_up(running.port)
        yield running


def _warm_up(port: int) -> None:
    """ORT's first runs of a full batch and Serve's first calls to the deployment (0.5 s or more on 2 busy cores),
    out of the way of the timed bursts: a running batch's worth of short streams to each decoder at once."""

    async def run() -> None:
        bodies = [_stream(name, max_tokens=4) for name in (REMOTE, COLOCATED) for _ in range(MAX_RUNNING)]
        async with _streams(port, bodies) as answers:
            await _until(answers, 200, len(bodies))

    asyncio.run(run())


def _stream(model: str, max_tokens: int = CONTEXT - 1) -> dict:
    body = {"model": model, "prompt": [1], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return body | {"stream": True}


@contextlib.asynccontextmanager
async def _streams(port: int, bodies: list[dict]):
    """A completion stream per body on a connection of its own: the connections opened first, then every request
    written at once; yields each one's [status, seconds from the writes to it, body of a refusal] as they come
    (status None: no answer yet, it waits in a queue). Leaving closes them all (their clients gone)."""
    connections = await asyncio.gather(*(asyncio.open_connection("127.0.0.1", port) for _ in bodies))
    answers: list[list] = [[None, None, ""] for _ in bodies]

    async def answer(i: int, reader: asyncio.StreamReader, start: float) -> None:
        status = int((await reader.readline()).split()[1])
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        refusal = ""
        if status != 200 and (length := re.search(r"content-length: (\d+)", head)):
            refusal = (await reader.readexactly(int(length.group(1)))).decode()
        answers[i] = [status, time.perf_counter() - start, refusal]

    for (_, writer), body in zip(connections, bodies, strict=True):
        payload = json.dumps(body).encode()
        head = "POST /openai/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        writer.write(head.encode() + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    start = time.perf_counter()
    tasks = [asyncio.create_task(answer(i, reader, start)) for i, (reader, _) in enumerate(connections)]
    try:
        yield answers
    finally:
        for task in tasks:
            task.cancel()
        for _, writer in connections:
            writer.close()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until(answers: list[list], status: int, count: int, timeout_s: float = 60) -> list[list]:
    """The answers once `count` have `status` and SETTLE_S more passed."""
    deadline = time.monotonic() + timeout_s
    while sum(a[0] == status for a in answers) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(SETTLE_S)
    return [list(a) for a in answers]


def test_generations_400s_are_counted_in_the_request_metrics_like_the_classifiers(server):
    base_url = f"http://127.0.0.1:{server.port}"
    with httpx.Client(base_url=base_url, timeout=60) as client:
        bad = {"text_input": "hi", "parameters": {"temperature": -1}}
        assert client.post(f"/v2/models/{COLOCATED}/generate", json=bad).status_code == 400
        unsupported = {"model": REMOTE, "prompt": "hi", "n": 0}
        assert client.post("/openai/v1/completions", json=unsupported).status_code == 400
    wanted = {
        ("v2_generate", COLOCATED): 1,
        ("openai_completions", REMOTE): 1,
    }
    url, text = f"http://127.0.0.1:{server.metrics_port}/metrics", ""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        total = "ray_mha_requests_total"
        seen = {key: series_total(text, total, endpoint=key[0], model=key[1], code="400") for key in wanted}
        if seen == wanted:
            break
        time.sleep(1)
    assert seen == wanted, [line for line in text.splitlines() if line.startswith("ray_mha_requests_total")]


def test_a_decoder_in_its_own_deployment_holds_what_its_engine_holds_and_refuses_one_more_at_once(server):
    """140 streams at once to a decoder whose engine holds 32 running + 100 waiting: 132 run or wait (their answer
    starts with their first token), 8 get a 503 within a second, from the engine's full queue."""
    held = MAX_RUNNING + MAX_WAITING
    extra = 8

    async def run() -> list[list]:
        async with _streams(server.port, [_stream(REMOTE)] * (held + extra)) as answers:
            return await _until(answers, 503, extra)

    answers = asyncio.run(run())
    refused = [a for a in answers if a[0] == 503]
    print(f"refused after {sorted(round(a[1], 3) for a in refused)} s")
    assert len(refused) == extra, [a for a in answers if a[0] not in (None, 200)]
    assert all(a[1] < 1.0 for a in refused) and all("queue is full" in a[2] for a in refused), refused
    assert {a[0] for a in answers} <= {None, 200, 503}
    assert sum(a[0] == 200 for a in answers) <= MAX_RUNNING


def test_a_classifier_gets_its_200_while_streams_hold_every_slot_generation_may_have(server):
    """400 streams at once across two decoders under max_in_flight 300: at most generation's share (225) are held,
    the rest refused, and a classifier request is still answered."""
    share = MAX_IN_FLIGHT * 3 // 4
    bodies = [_stream(name) for _ in range(200) for name in (REMOTE, COLOCATED)]
    base_url = f"http://127.0.0.1:{server.port}"

    async def run() -> tuple[list[list], httpx.Response]:
        async with _streams(server.port, bodies) as answers:
            answers = await _until(answers, 503, len(bodies) - share)
            async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
                answer = await client.post(f"/v1/models/{CLASSIFIER}/predict", json={"text": "still served"})
            return answers, answer

    answers, classified = asyncio.run(run())
    assert classified.status_code == 200, classified.text
    held = [a for a in answers if a[0] in (None, 200)]
    over_share = [a for a in answers if a[0] == 503 and "max_generation_in_flight" in a[2]]
    print(f"{len(held)} streams held, {len(over_share)} refused over generation's share")
    assert len(held) <= share and over_share, {a[0] for a in answers}
    assert {a[0] for a in answers} <= {None, 200, 503}
