"""A decoder in a Serve deployment of its own (`placement: deployment`), its token events streamed back through the
handle (service/deployment.py DecoderServer, service/remote_decoder.py): the same greedy text as the engine run
in-process, a stream whose text equals the whole answer, the ingress's 400s before any Ray call, the replica's own
refusals with their own status and message, a client gone freeing its sequence in the replica, and SIGTERM ending a
running stream with a finish_reason."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest
from conftest import export_tiny_decoder

from benchmarks.harness.server import ServerProcess
from service.decoder_placement import ColocatedDecoder
from service.generate import GenerateRequest, GenerationSettings, SamplingParams

LM = "lm-h4-kv2-d32"  # context 64
LONG = "lm-h4-kv4-d32"  # context 2048: its streams last seconds
KV_TOKENS = 2048  # one full context of LONG: a second LONG sequence waits for the first
DRAIN_S = 0.5  # limits.drain_s: all of it kept for the aborted streams' last events (no grace to finish in)
QUEUE_TIMEOUT_S = 0.5  # well below a whole LONG stream, well above the step in which a cancelled one leaves
PROMPT = "def f(x):"

pytestmark = [pytest.mark.serve, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("decoder-deployments")
    export_tiny_decoder(out, 2, 64, seed=3)
    export_tiny_decoder(out, 4, KV_TOKENS, seed=5)
    config = {
        "models_dir": str(out),
        "backend": "cpu",
        # one sequence at a time: a LONG stream holds the running batch (its KV is charged as it grows, so the budget
        # alone would let a short request in beside it)
        "generate": {"kv_cache_tokens": KV_TOKENS, "max_running": 1, "threads": 1, "queue_timeout_s": QUEUE_TIMEOUT_S},
        "limits": {"drain_s": DRAIN_S},
        "overrides": {LM: {"placement": "deployment"}, LONG: {"placement": "deployment"}},
    }
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")
    with ServerProcess(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client:
        yield client


def _in_process(models_dir: str, prompt: str, max_tokens: int) -> str:
    """The greedy text of the same engine run in this process."""

    async def run() -> str:
        decoder = ColocatedDecoder.open(models_dir, LM, GenerationSettings(threads=1, backend="cpu"))
        try:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            return "".join([e.text async for e in decoder.submit(GenerateRequest(prompt, params))])
        finally:
            decoder.close()

    return asyncio.run(run())


def _long(max_tokens: int, stream: bool = False) -> dict:
    body = {"model": LONG, "prompt": [1], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return body | {"stream": stream}


def test_the_decoders_in_their_deployments_are_listed_ready_as_generators(http):
    listed = {m["id"] for m in http.get("/openai/v1/models").json()["data"]}
    assert {LM, LONG} <= listed, listed
    assert http.get(f"/v2/models/{LM}/ready").status_code == 200


def test_a_completion_from_the_deployment_is_the_engines_greedy_text_and_the_stream_says_the_same(server, http):
    body = {"model": LM, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = http.post("/openai/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    answer = whole.json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 24
    assert answer["choices"][0]["text"] == _in_process(server.config["models_dir"], PROMPT, 24)
    with http.stream("POST", "/openai/v1/completions", json=body | {"stream": True}) as r:
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
    parameters = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    generated = http.post(f"/v2/models/{LM}/generate", json={"text_input": PROMPT, "parameters": parameters})
    assert generated.status_code == 200 and generated.json()["text_output"] == answer["choices"][0]["text"]


def test_a_prompt_beyond_the_context_is_a_400_from_the_ingress_naming_both_numbers(http):
    answer = http.post("/openai/v1/completions", json={"model": LM, "prompt": PROMPT, "max_tokens": 60})
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert "60" in message and "64" in message and "Traceback" not in message


def test_a_refusal_raised_in_the_replica_keeps_its_status_and_message(http):
    """While a LONG sequence holds the running batch, a short request waits in the replica's engine past
    generate.queue_timeout_s: a 503 with Retry-After and the engine's own message, not Ray's traceback. Tried again
    should the LONG one end first (a machine so fast that it ends within the timeout)."""
    for _ in range(5):
        with (
            httpx.Client(base_url=http.base_url, timeout=60) as holder,
            holder.stream("POST", "/openai/v1/completions", json=_long(KV_TOKENS - 1, stream=True)) as running,
        ):
            assert running.status_code == 200  # its first token is out: it runs, holding the budget
            short = http.post("/openai/v1/completions", json=_long(4))
        if short.status_code != 200:
            break
    assert short.status_code == 503, short.text
    message = short.json()["error"]["message"]
    assert LONG in message and "queue_timeout_s" in message, message
    assert "Traceback" not in message and "RayTaskError" not in message and short.headers.get("retry-after")


def test_a_client_that_disconnects_mid_stream_frees_its_sequence_in_the_replica(http):
    """One sequence runs at a time: the next starts only once the one before has left."""
    start = time.perf_counter()
    whole = http.post("/openai/v1/completions", json=_long(KV_TOKENS - 1))
    full_s = time.perf_counter() - start
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == KV_TOKENS - 1
    with (
        httpx.Client(base_url=http.base_url, timeout=60) as gone,
        gone.stream("POST", "/openai/v1/completions", json=_long(KV_TOKENS - 1, stream=True)) as r,
    ):
        assert r.status_code == 200
        next(r.iter_lines())
    start = time.perf_counter()
    after = http.post("/openai/v1/completions", json=_long(8))
    waited_s = time.perf_counter() - start
    assert after.status_code == 200, after.text
    print(f"a whole {KV_TOKENS - 1}-token completion: {full_s:.2f} s; the next after a disconnect: {waited_s:.2f} s")
    assert waited_s < full_s / 2


def test_a_stop_ends_a_running_stream_from_a_deployment_with_a_finish_reason_and_the_server_exits_0(server):
    """Last in this file: it stops the module's server."""
    with (
        httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=60) as client,
        client.stream("POST", "/openai/v1/completions", json=_long(KV_TOKENS - 1, stream=True)) as r,
    ):
        lines = r.iter_lines()
        first = next(lines)
        stopper = threading.Thread(target=server.terminate)
        stopper.start()
        rest = [line for line in lines if line.startswith("data: ")]
    stopper.join()
    assert rest[-1] == "data: [DONE]", rest[-3:]
    chunks = [json.loads(line[len("data: ") :]) for line in [first, *rest[:-1]]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    print(f"the stream's finish_reason after SIGTERM: {reasons[-1]} after {len(reasons)} chunks")
    assert reasons[-1] == "abort" and all(reason is None for reason in reasons[:-1])
    assert server._proc is not None and server._proc.returncode == 0, server.log()[-2000:]
