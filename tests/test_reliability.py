"""The service as shipped (`mha-serving serve`, direct ingress, three tiny models, one in its own deployment) against
a bad day: a flood past capacity, slow bodies, a huge chunked body, oversized heads, schemathesis over the whole
OpenAPI document (the model repository API included, with its token), killed replicas, SIGTERM under load; and where
it listens. Loopback only, bounded in count and time; each test prints what it measured."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import ipaddress
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest

from benchmarks.harness.processes import descendants, memory_kib
from benchmarks.harness.server import ServerProcess
from benchmarks.harness.sockets import tcp_sockets
from loadtest.http_client import post_bytes, read_response
from service.repository_settings import RepositorySettings

pytestmark = [pytest.mark.serve, pytest.mark.slow]
PREDICT = "/v1/models/mha-h2-d32/predict"
SLOW = "mha-h4-d32"  # a 0.2 s batch window and a short queue: easy to overload
REMOTE = "mha-h1-d32"  # in its own deployment (as GPU models are on a cluster): the replica the recovery test kills
REPOSITORY_TOKEN = "a-reliability-test-token"
KEEPER = "keeps-every-colocated-model-loaded"  # a route no generated request names (schemathesis's are short)


def server_config(models_dir, **limits) -> dict:
    slow = {"batch_wait_timeout_s": 0.2, "max_batch_size": 4, "max_queued_requests": 8}
    return {
        "models_dir": str(models_dir),
        "backend": "cpu",
        "overrides": {SLOW: slow, REMOTE: {"placement": "deployment"}},
        "limits": {"body_timeout_s": 2.0, **limits},
    }


@pytest.fixture(scope="module")
def models_dir(tiny_models_dir, tmp_path_factory):
    """The session's two tiny models and a third, REMOTE."""
    from conftest import export_tiny_model

    out = tmp_path_factory.mktemp("reliability") / "models"
    shutil.copytree(tiny_models_dir, out)
    export_tiny_model(out, heads=1, seed=1)
    return out


@pytest.fixture(scope="module")
def server(models_dir):
    """The service with the model repository API on (schemathesis drives it with the token): a route targets every
    co-located model, so that no generated unload takes a model away from the other tests (409)."""
    os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")  # as the session's Ray (tests/serving.py)
    config = server_config(models_dir)
    config["repository"] = {"enabled": True, "token_sha256": hashlib.sha256(REPOSITORY_TOKEN.encode()).hexdigest()}
    config["routes"] = {KEEPER: {"targets": {"mha-h2-d32": 1, SLOW: 1}}}
    with ServerProcess(config) as running:
        yield running


def post(port: int, path: str, body: dict, timeout: float = 30) -> tuple[int, dict, float, dict]:
    start = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}{path}", json=body, timeout=timeout)
    return r.status_code, r.json(), time.perf_counter() - start, dict(r.headers)


async def _one_shot(port: int, request: bytes) -> tuple[int, bytes, float]:
    """One request on its own connection: (status, raw response, seconds)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        return int(head[9:12]), head + body, time.perf_counter() - start
    finally:
        writer.close()


def read_answer(sock: socket.socket) -> bytes:
    """One HTTP answer (head and Content-Length body), however the connection ends after it."""
    answer = b""
    try:
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return answer


def _length(answer: bytes) -> int:
    head = answer.partition(b"\r\n\r\n")[0].lower()
    return int(head.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head else 0


def flood(port: int, path: str, count: int) -> list[tuple[int, bytes, float]]:
    body = json.dumps({"text": "flood"}).encode()
    request = post_bytes(path, body)

    async def run():
        return await asyncio.wait_for(asyncio.gather(*(_one_shot(port, request) for _ in range(count))), 60)

    return asyncio.run(run())


def test_a_flood_past_capacity_gets_only_fast_json_503s_with_retry_after(server):
    """200 requests at once at a model that holds 4 running + 8 waiting: the rest are refused at once."""
    results = flood(server.port, f"/v1/models/{SLOW}/predict", 200)
    codes = [code for code, _, _ in results]
    refused = [(raw, s) for code, raw, s in results if code == 503]
    assert set(codes) == {200, 503} and refused, codes
    for raw, _ in refused:
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"retry-after: 1" in head.lower() and b"application/json" in head
        assert "over capacity" in json.loads(body)["error"]
    p99 = float(np.percentile([s for _, s in refused], 99)) * 1e3
    print(f"\nflood: {codes.count(200)} answered, {len(refused)} refused with JSON 503, 503 p99 {p99:.1f} ms")
    assert p99 < 2000  # not queued behind the model (that takes seconds); the figure is printed


def test_requests_whose_clients_went_away_are_dropped_from_their_batch(server):
    """Three requests to SLOW (a 0.2 s batch window, 4 rows a batch) whose clients hang up while they wait, then one
    that stays: the batch runs only the one that stays. Were the three kept, it would run four rows."""
    body = json.dumps({"text": "gone"}).encode()
    request = post_bytes(f"/v1/models/{SLOW}/predict", body)
    seen = []  # (rows of the batch, ms waited) of the request that stayed, per try
    for _ in range(3):  # bounded; a try counts only if that request joined the window the three opened
        gone = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(3)]
        for sock in gone:
            sock.sendall(request)
        time.sleep(0.05)  # they wait in the batch window now
        for sock in gone:
            sock.close()
        code, answer, _, _ = post(server.port, f"/v1/models/{SLOW}/predict", {"text": "stays"})
        assert code == 200, answer
        seen.append((answer["timing"]["batch_rows"], round(answer["timing"]["queue_ms"])))
        if seen[-1][1] < 180:  # less than a window of its own (200 ms): it shared the three's window
            break
    print(f"\nthe request that stayed, with three clients gone (batch rows, ms queued): {seen}")
    assert seen[-1][1] < 180, f"it never shared the window of the three: {seen}"
    assert seen[-1][0] == 1, seen


def _stall(port: int, count: int) -> list[socket.socket]:
    """`count` connections that each send a predict's headers and 1 byte of a 200-byte body, then nothing."""
    socks = []
    head = (
        f"POST {PREDICT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    )
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(head.encode() + b"{")
        socks.append(sock)
    return socks


def test_slow_bodies_do_not_stall_other_clients_and_time_out_with_408(server):
    socks = _stall(server.port, 300)
    try:
        latencies = []
        with httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=10) as client:
            deadline = time.perf_counter() + 1.5
            while time.perf_counter() < deadline:
                start = time.perf_counter()
                assert client.get("/v2/health/live").status_code == 200
                assert client.post(PREDICT, json={"text": "a fast client"}).status_code == 200
                latencies.append(time.perf_counter() - start)
        p99 = float(np.percentile(latencies, 99)) * 1e3
        answers = []
        for sock in socks:  # body_timeout_s is 2 s: every stalled request is answered 408
            sock.settimeout(10)
            answers.append(sock.recv(64).decode(errors="replace"))
    finally:
        for sock in socks:
            sock.close()
    timed_out = sum(a.startswith("HTTP/1.1 408") for a in answers)
    print(f"\n300 slow bodies: probe p99 {p99:.1f} ms over {len(latencies)} rounds; {timed_out} answered 408")
    assert timed_out == 300 and p99 < 1000  # generous on 2 shared cores; the figure is printed


def test_a_huge_chunked_body_is_cut_off_at_the_limit_without_growing_the_ingress(server):
    pid = server.replica_pid("ingress")
    before = memory_kib(pid, "Rss")
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    head = f"POST {PREDICT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
    chunk = b"10000\r\n" + b"x" * 0x10000 + b"\r\n"  # 64 KiB per chunk, 64 MiB in all
    sent = 0
    try:
        for _ in range(1024):
            sock.sendall(chunk)
            sent += 0x10000
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed: the rest is never read
    sock.settimeout(10)
    answer = read_answer(sock)
    sock.close()
    growth_mib = (memory_kib(pid, "Rss") - before) / 1024
    print(f"\nchunked body: {sent / 2**20:.0f} MiB sent before the cut, ingress RSS +{growth_mib:.1f} MiB")
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"over the limit of 1048576 bytes" in answer and growth_mib < 20


def _send(port: int, request: bytes) -> bytes:
    """`request` on its own connection, all of it (the server drops what follows a refusal), then the answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        return read_answer(sock)


def _json_error(answer: bytes, status: int) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()) and b"application/json" in head, answer[:300]
    return json.loads(body)["error"]


def test_oversized_request_heads_get_a_json_431_as_they_arrive(server):
    """limits.max_header_bytes (64 KiB) and limits.max_headers (100), enforced by the ingress's HTTP server."""
    pid = server.replica_pid("ingress")
    before = memory_kib(pid, "Rss")
    head = b"GET /v2/health/live HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    start = time.perf_counter()
    one_mb = _send(server.port, head + b"X-Big: " + b"a" * 1_000_000 + b"\r\n\r\n")
    many = _send(server.port, head + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"\r\n")
    huge = _send(server.port, head + b"X-Huge: " + b"a" * (32 << 20) + b"\r\n\r\n")  # 32 MiB
    seconds = time.perf_counter() - start
    growth_mib = (memory_kib(pid, "Rss") - before) / 1024
    after = httpx.get(f"http://127.0.0.1:{server.port}/v2/health/live", timeout=10)
    print(f"\nheads: 1 MB, 1000 headers, 32 MiB -> 431 in {seconds:.2f} s; ingress RSS +{growth_mib:.1f} MiB")
    assert _json_error(one_mb, 431) == "request headers are over the limit of 65536 bytes"
    assert _json_error(many, 431) == "more than 100 request headers"
    assert _json_error(huge, 431) == "request headers are over the limit of 65536 bytes"
    assert growth_mib < 20 and after.status_code == 200


def test_expect_100_continue_gets_the_413_first_when_the_body_is_too_large(server):
    head = f"POST {PREDICT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
    refused = _send(server.port, (head + "Content-Length: 2000000\r\n\r\n").encode())
    assert b"100 Continue" not in refused
    assert _json_error(refused, 413) == "request body of 2000000 bytes is over the limit of 1048576 bytes"
    body = b'{"text": "hi"}'
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # within the limit: as before
        sock.sendall((head + f"Content-Length: {len(body)}\r\n\r\n").encode())
        assert sock.recv(64) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert read_answer(sock).startswith(b"HTTP/1.1 200")


# Every check, and a schema-valid request must get a 2xx: the document states the served models' limits
# (tests/schemathesis_hooks.py names the few relations JSON Schema cannot state, and leaves binary bodies out).
# The model repository API with its token: what its answers depend on is the service's state, not the request.
SCHEMATHESIS_TOML = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx"]

[[operations]]
include-path = "/v1/models/{name}/attention"
# A model's attention variant is found in its own replica on first use: the document cannot list who has one.
checks.positive_data_acceptance.expected-statuses = ["2xx", "404"]

[[operations]]
include-path-regex = "^/v2/repository/models/"
# 409: the model has its own deployment, or (unload) a route targets it. Each load opens the model in the serving
# process again: a few are enough to show it, the bodies' shapes are the rest.
checks.positive_data_acceptance.expected-statuses = ["2xx", "409"]
generation.max-examples = 10

[[operations]]
include-name = "PUT /v2/repository/routes/{route}"
# Each route set reconfigures the serving process (a second or two): as for loads, a few.
generation.max-examples = 10

[[operations]]
include-path-regex = "^/(openai/v1/(completions|chat/completions|models/)|v2/models/[^/]+/generate)"
# No decoder in this models folder: generation asked of a classifier is a 400, of an unknown model a 404, and OpenAI's
# model object of either a 404.
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404"]

[[operations]]
include-name = "DELETE /v2/repository/routes/{route}"
# 404: no route of that name (one that a PUT set before is removed)
checks.positive_data_acceptance.expected-statuses = ["2xx", "404"]
"""
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")


def test_schemathesis_finds_no_failure_over_the_whole_openapi_document(server, tmp_path):
    config, report = tmp_path / "schemathesis.toml", tmp_path / "report.json"
    config.write_text(SCHEMATHESIS_TOML)
    st = str(Path(sys.executable).parent / "st")
    cmd = [st, "--config-file", str(config), "run", f"http://127.0.0.1:{server.port}/openapi.json", "--checks", "all"]
    cmd += ["--max-examples", "50", "--workers", "1", "--generation-deterministic", "--request-timeout", "30"]
    cmd += ["--header", f"{RepositorySettings().header}: {REPOSITORY_TOKEN}"]
    cmd += ["--report", "json", "--report-json-path", str(report)]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)}
    start = time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)  # its cache: there
    result = json.loads(report.read_text())
    cases = result["test_cases"]
    print(
        f"\nschemathesis: {cases['generated']} generated requests over {result['operations']['tested']} operations, "
        f"{len(result['failures'])} failures, {len(result['errors'])} errors in {time.perf_counter() - start:.1f} s; "
        f"{result['filtered']} refusals for a relation JSON Schema cannot state (schemathesis_hooks.UNSTATABLE)"
    )
    assert run.returncode == 0, run.stdout[-4000:]
    assert cases["generated"] >= 1000 and cases["with_failures"] == 0 and not result["failures"]
    assert not result["errors"] and not result["warnings"]["unresolvable_reference"]
    assert result["operations"]["tested"] == result["operations"]["total"]  # the repository's among them


def _listening(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of these processes."""
    return [(s.address, s.port, s.pid) for s in tcp_sockets(pids) if s.listening]


def _is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def _name(pid: int) -> str:
    """The process's program name; "" for one that ended meanwhile."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def test_every_route_is_answered_by_the_ingresss_own_server_past_no_serve_wrapper(server):
    """`mha-serving serve`: one way in, the ingress replica's own server: no route carries Serve's `x-request-id`,
    which its proxy and its request wrapper add; every route answers JSON."""
    base = f"http://127.0.0.1:{server.port}"
    with httpx.Client(base_url=base, timeout=30) as client:
        predict = client.post(PREDICT, json={"text": "fast"})
        tensor = {"name": "text", "datatype": "BYTES", "shape": [1], "data": ["fast"]}
        infer = client.post(f"/v2/models/{SLOW}/infer", json={"inputs": [tensor]})
        others = [client.get(path) for path in ("/v2/health/ready", "/v1/models")]
    assert predict.status_code == infer.status_code == 200, (predict.text, infer.text)
    for r in (predict, infer, *others):
        assert r.status_code == 200 and "x-request-id" not in r.headers
        assert r.headers["content-type"] == "application/json"


ANSWERED_ALIKE = [  # (path, body): answers, errors included, that must not depend on how a request was handled
    (
        "/v2/models/mha-h2-d32/infer",
        {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [5, 6, 7]}]},
    ),
    (
        "/v2/models/mha-h2-d32/versions/1/infer",
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}]},
    ),
    ("/v2/models/mha-h2-d32/versions/9/infer", {"inputs": []}),
    (
        "/v2/models/mha-h2-d32/infer",
        {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": [10**6]}]},
    ),
    (
        "/v2/models/mha-h2-d32/infer",
        {
            "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}],
            "outputs": [{"name": "probs"}],
        },
    ),
    ("/v2/models/mha-h2-d32/infer", b'{"inputs": [,'),
    ("/v2/models/nope/infer", {"inputs": []}),
    (PREDICT, {"texts": ["a fine film", "a dull one"]}),
    (PREDICT, {"input_ids": [[5, 6], [7]]}),
    (PREDICT, {"text": "x" * 10_000}),
]


def _answers(port: int) -> list[tuple[int, str, dict]]:
    """ANSWERED_ALIKE's answers, one request at a time: status, content type, JSON body (predict's timing left out)."""
    out = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for path, body in ANSWERED_ALIKE:
            r = client.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode())
            answer = r.json()
            answer.pop("timing", None)
            out.append((r.status_code, r.headers["content-type"], answer))
    return out


def test_a_lone_request_run_inline_answers_as_a_batched_one_does_errors_included(server):
    """Alone in the ingress, an inference request runs on the event loop (inline); with another request in
    progress (here a body still arriving), the same requests go through the batcher. Both answer alike."""
    _answers(server.port)  # a lone run first: the model learns how long a lone run takes (inline runs need it)
    lone = _answers(server.port)
    with socket.create_connection(("127.0.0.1", server.port)) as slow:
        slow.sendall(post_bytes(PREDICT, b'{"text": "still arriving"}')[:-5])  # in progress until 408 (2 s)
        time.sleep(0.1)
        beside = _answers(server.port)
    assert lone == beside
    assert [status for status, _, _ in lone] == [200, 200, 404, 400, 400, 400, 404, 200, 200, 400]
    assert {content_type for _, content_type, _ in lone} == {"application/json"}


def test_an_error_answer_keeps_the_connection_for_the_next_request(server):
    """4xx answers from a route (unknown model, bad JSON, a contract error) leave the keep-alive connection open."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        answers, sockets = [], set()
        for path, body in [("/v2/models/nope/infer", b"{}"), (PREDICT, b'{"text": '), (PREDICT, b'{"text": "ok"}')]:
            conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            answers.append((response.status, response.getheader("connection")))
            sockets.add(id(conn.sock))
    finally:
        conn.close()
    assert answers == [(404, None), (400, None), (200, None)]
    assert len(sockets) == 1 and None not in sockets


def test_pipelined_requests_are_all_answered_in_order_whatever_their_bodies_size(server):
    """HTTP/1.1 pipelining: 40 v2 requests on one connection, sent without waiting for answers, every other one with
    a 100 kB body, each write ending a few bytes into the next head (so a read holds a body's end and a head's start):
    each answered 200, in the order sent."""
    requests = []
    for i in range(40):
        body = {"id": str(i), "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [f"t {i}"]}]}
        raw = json.dumps(body).encode() + (b" " * 100_000 if i % 2 == 0 else b"")
        requests.append(post_bytes("/v2/models/mha-h2-d32/infer", raw))
    stream_bytes = b"".join(requests)
    cuts = list(itertools.accumulate(len(r) for r in requests[:-1]))  # where each next request begins
    pieces = [stream_bytes[a:b] for a, b in itertools.pairwise([0, *(c + 10 for c in cuts), len(stream_bytes)])]

    def send_in_pieces(sock: socket.socket) -> None:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.02)

    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        writer = threading.Thread(target=send_in_pieces, args=(sock,))
        writer.start()
        stream = sock.makefile("rb")
        answers = []
        for _ in requests:
            status, body = read_response(stream)
            answers.append((status, json.loads(body).get("id") if status == 200 else body[:200]))
        writer.join()
    assert answers == [(200, str(i)) for i in range(40)], [a for a in answers if a[0] != 200][:3]


def test_lone_requests_run_inline_are_counted_like_the_others_through_a_real_prometheus(server):
    """The ingress's request counter, scraped by a real Prometheus from the server's metrics export, counts the
    lone requests run inline, with their status codes."""
    from prometheus import PrometheusServer

    query = 'sum by (code) (ray_mha_requests_total{model="mha-h2-d32", endpoint="v2_infer"})'
    good = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 3], "data": [5, 6, 7]}]}
    bad = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [1, 1], "data": [10**6]}]}
    path = "/v2/models/mha-h2-d32/infer"

    def counts(result: list[dict]) -> dict[str, float]:
        return {r["metric"]["code"]: float(r["value"][1]) for r in result}

    with PrometheusServer(f"127.0.0.1:{server.metrics_port}") as prom, httpx.Client(timeout=30) as client:
        for body in (good, good, bad):  # the model learns its lone runs' cost; every series exists
            client.post(f"http://127.0.0.1:{server.port}{path}", json=body)
        before: dict[str, float] = {}
        while (now := counts(prom.wait_for(query, lambda res: len(res) >= 2, 90))) != before:  # settled
            before = now
            time.sleep(5)
        codes = [client.post(f"http://127.0.0.1:{server.port}{path}", json=b).status_code for b in [good] * 5 + [bad]]
        grown = lambda res: counts(res).get("200", 0) >= before["200"] + 5 and counts(res)["400"] > before["400"]  # noqa: E731
        after = counts(prom.wait_for(query, grown, 90))
    assert codes == [200] * 5 + [400]
    assert after["200"] == before["200"] + 5 and after["400"] == before["400"] + 1


def test_everything_listens_on_loopback_and_no_serve_proxy_is_a_second_entry_point(server):
    """--host 127.0.0.1: the API, Ray's metrics ports, agents and gRPC on loopback. Ray 2.60 binds only each Serve
    replica's own gRPC port on every interface ([::], token-authenticated): not HTTP, checked here. Serve runs no
    HTTP proxy: the ingress's own server is the one way in."""
    sockets = _listening(descendants(os.getsid(server.replica_pid("ingress"))))
    wide = [(a, port, _name(pid)) for a, port, pid in sockets if not _is_loopback(a)]
    proxies = [port for _, port, pid in sockets if _name(pid) == "ray::ProxyActor"]
    print(f"\nlistening: {len(sockets)} sockets, {len(sockets) - len(wide)} on loopback; others: {wide}")
    assert (server.port, "127.0.0.1") in {(port, a) for a, port, _ in sockets}
    assert (server.metrics_port, "127.0.0.1") in {(port, a) for a, port, _ in sockets}
    for address, port, name in wide:  # only the replicas' gRPC: an HTTP request gets no HTTP answer
        assert address == "::" and name.startswith("ray::ServeReplica"), (address, port, name)
        answer = _send(port, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert not answer.startswith(b"HTTP/1"), answer[:100]
    assert proxies == []
    assert not any(_name(pid) == "ray::ProxyActor" for pid in descendants(os.getsid(server.replica_pid("ingress"))))


CLIENT_TIMEOUT_S = 10.0  # every request is bounded (by the recovery bound): one waiting longer shows up as "timeout"


def _keep_asking(port: int, model: str, stop: threading.Event, log: list) -> None:
    """Predict requests one after another until `stop`: (start, end, status code or error name) each."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=CLIENT_TIMEOUT_S) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                code = client.post(f"/v1/models/{model}/predict", json={"text": "still there?"}).status_code
            except httpx.TimeoutException:
                code = "timeout"
            except httpx.TransportError as exc:  # connection refused or reset while the ingress restarts
                code = type(exc).__name__
                time.sleep(0.05)
            log.append((start, time.perf_counter(), code))


def _answered(log: list, since: float) -> bool:
    return any(code == 200 and start > since for start, _, code in log)


def _outage(log: list, since: float, until: float) -> float:
    """The longest stretch between `since` and `until` in which no request sent after `since` was answered 200."""
    marks = [since, *sorted(end for start, end, code in log if code == 200 and start > since), until]
    return max(b - a for a, b in itertools.pairwise(marks))


def _kill_under_load(server, victim: str, models: list[str]) -> tuple[dict[str, list], float, float]:
    """SIGKILL `victim`'s replica while two clients per model keep asking, until each model answered again and one
    second more: every request's (start, end, code) per model, when the kill was and when the asking stopped."""
    logs: dict[str, list] = {m: [] for m in models}
    stop = threading.Event()
    clients = [threading.Thread(target=_keep_asking, args=(server.port, m, stop, logs[m])) for m in models * 2]
    for client in clients:
        client.start()
    time.sleep(1.0)
    pid = server.replica_pid(victim)
    killed = time.perf_counter()
    os.kill(pid, signal.SIGKILL)
    while time.perf_counter() - killed < 15 and not all(_answered(logs[m], killed) for m in models):
        time.sleep(0.1)
    time.sleep(1.0)  # and it keeps serving
    stop.set()
    stopped = time.perf_counter()
    for client in clients:
        client.join(CLIENT_TIMEOUT_S + 5)
    return logs, killed, stopped


def test_a_killed_model_replica_or_ingress_serves_again_within_10_s_and_no_request_hangs(server):
    """SIGKILL under load (two clients per model, every request bounded): first REMOTE's replica, then the ingress."""
    models = [REMOTE, "mha-h2-d32"]
    for victim in (REMOTE, "ingress"):
        logs, killed, stopped = _kill_under_load(server, victim, models)
        codes = {m: Counter(str(code) for _, end, code in logs[m] if end > killed) for m in models}
        for model in models:
            outage = _outage(logs[model], killed, stopped)
            slowest = max(end - start for start, end, _ in logs[model] if end > killed)
            print(
                f"\nkill {victim}: {model} answered again after {outage:.1f} s; {dict(codes[model])}; "
                f"slowest request {slowest:.1f} s"
            )
            assert outage < 10 and "timeout" not in codes[model], (model, codes[model])
        if victim == REMOTE:  # the other model did not notice; the killed one refused at most with a JSON 503
            assert set(codes["mha-h2-d32"]) == {"200"} and set(codes[REMOTE]) <= {"200", "503"}, codes
        else:  # no 5xx: connections refused or cut while the ingress restarts
            assert all(code == "200" or not code.isdigit() for c in codes.values() for code in c), codes


def test_sigterm_under_load_turns_readiness_503_answers_every_request_and_exits_in_time(tiny_models_dir):
    """Eight requests wait in SLOW's batch window (1.5 s here, room for 16 rows) when SIGTERM comes: each was sent
    whole 0.5 s before, so the server holds all eight, and each must still be answered."""
    config = server_config(tiny_models_dir)
    config["overrides"][SLOW] |= {"batch_wait_timeout_s": 1.5, "max_batch_size": 16, "max_queued_requests": 16}
    with ServerProcess(config) as server:
        body = json.dumps({"text": "in flight"}).encode()
        inflight = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(8)]
        for sock in inflight:
            sock.sendall(post_bytes(f"/v1/models/{SLOW}/predict", body))
        time.sleep(0.5)  # read by the server, waiting in the window
        stopper = threading.Thread(target=server.terminate, args=(30,))
        stopper.start()
        ready, waited = None, time.perf_counter()
        while time.perf_counter() - waited < 5:
            try:
                ready = httpx.get(f"http://127.0.0.1:{server.port}/v2/health/ready", timeout=2)
            except httpx.HTTPError:
                break
            if ready.status_code == 503:
                break
        readiness_s = time.perf_counter() - waited
        answers = [read_answer(sock) for sock in inflight]
        for sock in inflight:
            sock.close()
        codes = [int(a[9:12]) if a.startswith(b"HTTP/1.1 ") else a[:40] for a in answers]  # an error: what came
        stopper.join()
        log = server.log()
    print(
        f"\nSIGTERM: readiness 503 after {readiness_s * 1e3:.0f} ms, {codes.count(200)}/8 in flight answered 200, "
        f"exit after {server.stop_s:.1f} s"
    )
    assert ready is not None and ready.status_code == 503 and ready.json()["error"] == "shutting down"
    assert codes == [200] * 8, codes
    assert server.returncode == 0 and server.stop_s < 10, log[-2000:]
    assert "failed to shut down" not in log and "drained in" in log
