"""The bar token generation is held to (issue 58), over real HTTP against a really started `mha-serving serve`: 32
concurrent requests mixing an MQA and an MHA decoder, streamed and not, all answered; a seeded sampled completion
the same alone and batched with others; bad inputs answered 4xx with a JSON body that says why; a client that stops
reading neither blocks others nor keeps its sequence once it closes; and SIGTERM under 16 running streams ends each
with a finish_reason and `[DONE]`, the server exiting 0."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from conftest import export_tiny_decoder, export_tiny_model

from benchmarks.harness.server import ServerProcess

MQA = "lm-h4-kv1-d32"  # 128 bytes of KV a token
MHA = "lm-h4-kv4-d64"  # 1,024 bytes of KV a token
CLASSIFIER = "mha-h2-d32"
MQA_CONTEXT, MHA_CONTEXT = 1024, 2048
# generate.kv_cache_mb, two copies of 16,384 tokens of MQA (16 whole contexts: the 16 streams of the SIGTERM test all
# run) and of 2,048 of MHA, one whole context: a request charged it runs only when no other MHA sequence holds any.
KV_CACHE_MB = 4.0
DRAIN_S = 0.2  # limits.drain_s: far shorter than any of 16 streams of 1,023 tokens, so that a stop aborts them all
CONCURRENCY = 16
TIMEOUT_S = 120  # a bound for a hung request only

pytestmark = [pytest.mark.serve, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("generation-bar-models")
    export_tiny_decoder(out, 1, MQA_CONTEXT, seed=1)
    export_tiny_decoder(out, 4, MHA_CONTEXT, seed=4, d_model=64)
    export_tiny_model(out, heads=2, seed=2)
    config = {
        "models_dir": str(out),
        "backend": "cpu",
        "generate": {"kv_cache_mb": KV_CACHE_MB, "threads": 1},
        "limits": {"drain_s": DRAIN_S},
    }
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # Ray's export every second, as tests/serving.py
    with ServerProcess(config) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    base_url = f"http://127.0.0.1:{server.port}/openai/v1"
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def test_32_requests_16_at_a_time_over_both_decoders_streamed_or_not_all_end_with_a_finish_reason(client):
    def one(i: int) -> tuple[str, str | None]:
        model = (MQA, MHA)[i % 2]
        args = {"model": model, "prompt": f"request {i}:", "max_tokens": 8 + i % 24, "temperature": 0.8, "seed": i}
        if i % 4 < 2:
            choice = client.completions.create(**args).choices[0]
            return choice.text, choice.finish_reason
        chunks = list(client.completions.create(**args, stream=True))
        assert all(c.choices[0].finish_reason is None for c in chunks[:-1]), chunks
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = list(pool.map(one, range(32)))  # any non-2xx raises here, as the openai client raises it
    assert len(answers) == 32
    assert all(reason in ("length", "stop") for _, reason in answers), answers


def test_a_seeded_sampled_completion_is_the_same_alone_and_among_8_concurrent_others(client):
    seeded = {"model": MQA, "prompt": "The for statement", "max_tokens": 48, "temperature": 0.8, "seed": 1234}
    alone = client.completions.create(**seeded).choices[0].text
    start = threading.Barrier(9)  # the nine requests sent together, so that they share decoding steps

    def send(args: dict) -> str:
        start.wait(TIMEOUT_S)
        return client.completions.create(**args).choices[0].text

    others = [
        {"model": MQA, "prompt": f"other prompt {i}", "max_tokens": 64, "temperature": 0.8, "seed": i} for i in range(8)
    ]
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        texts = list(pool.map(send, [seeded, *others]))
    assert texts[0] == alone
    assert len(set(texts)) > 1  # the others sampled texts of their own


def _bad(http: httpx.Client, path: str, body: object) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


COMPLETIONS = "/openai/v1/completions"
# (what is wrong, the body, a part of the message that says why): each beyond tests/test_generation_serving.py's
BAD_COMPLETIONS = [
    ("temperature -1", {"model": MQA, "prompt": "x", "temperature": -1}, "temperature=-1"),
    ("max_tokens 0", {"model": MQA, "prompt": "x", "max_tokens": 0}, "max_tokens=0"),
    ("a token id past the vocabulary", {"model": MQA, "prompt": [1, 100000]}, "outside model"),
    ("a negative token id", {"model": MQA, "prompt": [-1]}, "outside model"),
    ("no token ids", {"model": MQA, "prompt": []}, "prompt is an empty list"),
    ("malformed JSON", b'{"model": "' + MQA.encode() + b'", "prompt": ', "JSON"),
    ("a JSON list", [MQA, "x"], ""),
    ("no prompt", {"model": MQA}, "prompt"),
    ("17 stop strings", {"model": MQA, "prompt": "x", "stop": [str(i) for i in range(17)]}, "stop"),
    ("best_of 2", {"model": MQA, "prompt": "x", "best_of": 2}, "not supported: best_of"),
    ("logprobs 21", {"model": MQA, "prompt": "x", "logprobs": 21}, "logprobs=21 must be an integer from 0 to 20"),
    ("max_tokens 0 without echo", {"model": MQA, "prompt": "x", "max_tokens": 0}, "max_tokens=0 must be"),
    ("top_p 0", {"model": MQA, "prompt": "x", "top_p": 0}, "top_p"),
    (
        "huge max_tokens",
        {"model": MHA, "prompt": "def f(x):", "max_tokens": 10**9},
        "10 tokens + max_tokens 1000000000",
    ),
]


@pytest.mark.parametrize("body, says", [pytest.param(b, s, id=why) for why, b, s in BAD_COMPLETIONS])
def test_a_bad_completion_is_a_4xx_with_openais_error_body_saying_why(http, body, says):
    answer = _bad(http, COMPLETIONS, body)
    assert 400 <= answer.status_code < 500, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == answer.status_code, error
    assert says in error["message"], error


def test_bad_generate_requests_are_4xx_with_a_json_error_saying_why(http):
    over = _bad(http, f"/v2/models/{MHA}/generate", {"text_input": "def f(x):", "parameters": {"max_tokens": 2040}})
    assert over.status_code == 400 and "10 tokens + max_tokens 2040" in over.json()["error"], over.text
    assert f"context length of {MHA_CONTEXT}" in over.json()["error"]
    unknown = _bad(http, "/v2/models/nope/generate", {"text_input": "x"})
    assert unknown.status_code == 404 and "unknown model 'nope'" in unknown.json()["error"], unknown.text
    for path in (f"/v2/models/{MQA}/generate", f"/v2/models/{MQA}/generate_stream"):
        for body in (b"{", {"parameters": {}}, {"text_input": "x", "parameters": {"temperature": -1}}):
            answer = _bad(http, path, body)
            assert 400 <= answer.status_code < 500 and answer.json()["error"], (path, body, answer.text)


def test_a_client_that_stops_reading_blocks_no_one_and_its_sequence_ends_when_it_closes(server, client, http):
    """The hostile client reserves MHA's whole KV budget with a stream it never reads, on a socket with a small
    receive buffer: what the server sends piles up on the server's side (here in its kernel's send buffer, which
    grows to 4 MiB on loopback: this whole stream of ~450 KB). While it holds the connection open, other clients
    are answered; once it closes, a request that needs MHA's whole budget runs, which it can only when no MHA
    sequence is left running."""
    body = {"model": MHA, "prompt": [1], "max_tokens": MHA_CONTEXT - 1, "stream": True, "ignore_eos": True}
    payload = json.dumps(body).encode()
    hostile = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hostile.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it advertises
    hostile.settimeout(TIMEOUT_S)
    hostile.connect(("127.0.0.1", server.port))
    try:
        head = f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        hostile.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        started = hostile.recv(256)  # the status line: the answer started, its first token made; then no more reads
        assert started.startswith(b"HTTP/1.1 200"), started
        others = client.completions.create(model=MQA, prompt="while it waits", max_tokens=16, temperature=0)
        assert others.choices[0].finish_reason in ("length", "stop")
        asked = http.post(f"/v1/models/{CLASSIFIER}/predict", json={"text": "hello"})
        assert asked.status_code == 200, asked.text
    finally:
        hostile.close()
    whole_budget = {"model": MHA, "prompt": [1] * (MHA_CONTEXT - 48), "max_tokens": 48, "ignore_eos": True}
    after = http.post(COMPLETIONS, json=whole_budget | {"temperature": 0})
    assert after.status_code == 200, after.text
    assert after.json()["usage"] == {"prompt_tokens": MHA_CONTEXT - 48, "completion_tokens": 48, "total_tokens": 2048}


def _series(text: str, name: str, **labels: str) -> list[tuple[str, float]]:
    """`name`'s samples whose labels include `labels`: (the line's labels, value)."""
    found = []
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            found.append((line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])))
    return found


def test_no_generation_request_above_was_answered_5xx(server):
    """Once the metrics have counted the completions above (32, 1 + 9, 2 around the hostile client, and the bad
    ones), none was a 5xx."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:
        text = httpx.get(url, timeout=10).text
        if sum(v for _, v in _series(text, "ray_mha_requests_total", endpoint="openai_completions")) >= 44:
            break
        time.sleep(1)
    requests = _series(text, "ray_mha_requests_total")
    assert sum(v for labels, v in requests if 'endpoint="openai_completions"' in labels) >= 44, requests
    assert [labels for labels, v in requests if re.search(r'code="5\d\d"', labels) and v > 0] == []


def test_sigterm_under_16_running_streams_ends_each_with_a_finish_reason_and_done_and_the_server_exits_0(server):
    """Last in this file: it stops the module's server. 16 streams that would outlast limits.drain_s each read
    their first chunk, then the launcher's process gets SIGTERM: each stream ends with a readable finish_reason and
    `data: [DONE]`, abort for most (length for one that finished before the stop)."""
    body = {"model": MQA, "prompt": [1], "max_tokens": MQA_CONTEXT - 1, "temperature": 0, "ignore_eos": True}
    running = threading.Semaphore(0)
    results: list[list[str]] = [[] for _ in range(CONCURRENCY)]

    def stream(i: int) -> None:
        with (
            httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=TIMEOUT_S) as own,
            own.stream("POST", COMPLETIONS, json=body | {"stream": True}) as r,
        ):
            assert r.status_code == 200
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            results[i].append(next(lines))
            running.release()
            results[i].extend(lines)

    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        streams = [pool.submit(stream, i) for i in range(CONCURRENCY)]
        for _ in range(CONCURRENCY):
            assert running.acquire(timeout=TIMEOUT_S)
        server.terminate()
        for done in streams:
            done.result(TIMEOUT_S)
    reasons = []
    for lines in results:
        assert lines[-1] == "data: [DONE]", lines[-3:]
        chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
        ends = [c["choices"][0]["finish_reason"] for c in chunks]
        assert all(reason is None for reason in ends[:-1]) and ends[-1] in ("abort", "length"), ends[-3:]
        reasons.append(ends[-1])
    print(f"the 16 streams' finish_reasons after SIGTERM: {reasons}")
    # A stream admitted well before the others may finish its 1,023 tokens before the stop; most cannot.
    assert reasons.count("abort") >= CONCURRENCY // 2, reasons
    assert server.returncode == 0, server.log()[-2000:]
