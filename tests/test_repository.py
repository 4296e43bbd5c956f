"""The model repository API (`mha-serving serve --repository`), against one real server of two serving processes on
loopback: Triton's own HTTP client lists, loads and unloads models; a model loaded is served by every process, one
unloaded by none; requests for the other models all succeed meanwhile; the token is required (401) and counted; a
route's target cannot be unloaded (409); SIGHUP loads what was added to the models folder and unloads what left.
And `optimize --rollout shadow` through it (optimize/rollout.py), a route under steady load: a candidate that agrees
with the incumbent goes shadow -> 50 % -> 100 % and answers the route; one that does not is rolled back at its
shadow step, the route set back as it was; no request fails either way. Its bodies are held to the service's
limits (413 chunked or not, 408 past the deadline, with or without the token) and to their documented shapes (400
naming the field, never a 5xx); the served document is whole (every $ref resolves, a 405's Allow lists every method
of the path)."""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch
import tritonclient.http as triton
import yaml
from conftest import TINY, export_tiny_model
from serving import refs, resolved, serve_process
from tritonclient.utils import InferenceServerException

from benchmarks.harness.processes import descendants_named, memory_kib
from contract.repository import TOKEN_ENV
from export.convert import export_model, exporter_versions
from export.model import EncoderClassifier, EncoderConfig
from optimize.rollout import RolloutPlan, ServiceAdmin, rollout
from service.ingress import SERVED_BY
from service.local import launcher
from service.local.ports import free_port
from service.repository_settings import RepositorySettings

pytestmark = [pytest.mark.serve, pytest.mark.slow]
TOKEN = "a-test-token-of-some-length"
HEADER = RepositorySettings().header
AUTH = {HEADER: TOKEN}
ROUTE = "pair"
NEW = "mha-h1-d32"  # exported beside the served folder, copied in by the tests
TWIN = "mha-h2-d32-twin"  # mha-h2-d32's weights under another name: it agrees with it everywhere
ROLLOUT_ROUTE = "classifier"
BODY_TIMEOUT_S = 2.0  # limits.body_timeout_s: the trickling bodies' test waits for it
# Every repository operation (method, path): none is carried out by the limits' and bodies' tests below
OPERATIONS = [
    ("POST", "/v2/repository/index"),
    ("POST", f"/v2/repository/models/{NEW}/load"),
    ("POST", "/v2/repository/models/mha-h2-d32/unload"),
    ("PUT", "/v2/repository/routes/trial"),
    ("DELETE", "/v2/repository/routes/trial"),
]


class Server:
    def __init__(self, proc, models_dir: Path, spare: Path, port: int, metrics_port: int, log: Path) -> None:
        self.proc, self.models_dir, self.spare, self.log = proc, models_dir, spare, log
        self.base = f"http://127.0.0.1:{port}"
        self.triton = triton.InferenceServerClient(f"127.0.0.1:{port}")
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.admin = ServiceAdmin(self.base, HEADER, TOKEN)

    def post(self, path: str, headers: dict[str, str] | None = None, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.base}{path}", headers=headers if headers is not None else AUTH, timeout=180, **kwargs)

    def states(self) -> dict[str, str]:
        return {m["name"]: m["state"] for m in self.triton.get_model_repository_index(headers=AUTH)}

    def served_by(self, name: str, n: int) -> dict[str, int]:
        """Each serving process that answered `name` (one connection per request) -> its status codes' count."""
        seen: dict[str, int] = {}
        for _ in range(n):
            r = httpx.post(f"{self.base}/v1/models/{name}/predict", json={"text": "ab"}, timeout=30)
            seen[f"{r.headers[SERVED_BY]}:{r.status_code}"] = seen.get(f"{r.headers[SERVED_BY]}:{r.status_code}", 0) + 1
        return seen

    def add_folder(self) -> None:
        shutil.copytree(self.spare / NEW, self.models_dir / NEW)


@pytest.fixture(scope="module")
def server(tiny_models_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("repository")
    models_dir, spare = folder / "models", folder / "spare"
    shutil.copytree(tiny_models_dir, models_dir)
    export_tiny_model(spare, heads=1, seed=1)
    torch.manual_seed(2)  # as conftest's mha-h2-d32: the same weights under another name
    twin = EncoderConfig(heads=2, **TINY)
    export_model(EncoderClassifier(twin), replace(twin.metadata(exporter_versions()), name=TWIN), models_dir)
    config, log = folder / "serve.yaml", folder / "serve.log"
    routes = {ROUTE: {"targets": {"mha-h2-d32": 1}}, ROLLOUT_ROUTE: {"targets": {"mha-h2-d32": 1}}}
    limits = {"body_timeout_s": BODY_TIMEOUT_S}
    config.write_text(yaml.safe_dump({"models_dir": str(models_dir), "routes": routes, "limits": limits}))
    port, metrics_port = free_port(), free_port()
    args = ["--config", str(config), "--processes", "2", "--port", str(port), "--grpc-port", "0", "--repository"]
    args += ["--metrics-port", str(metrics_port)]
    with serve_process(args, log, env={TOKEN_ENV: TOKEN}) as (proc, _):
        yield Server(proc, models_dir, spare, port, metrics_port, log)


def test_without_its_token_the_repository_answers_401(server):
    for headers in ({}, {HEADER: "not-the-token"}):
        r = server.post("/v2/repository/index", headers=headers)
        assert r.status_code == 401, r.text
        assert HEADER in r.json()["error"]
    with pytest.raises(InferenceServerException, match="token"):
        server.triton.load_model(NEW)


def test_the_index_lists_every_folder_with_its_state(server):
    server.add_folder()
    try:
        assert server.states() == {"mha-h2-d32": "READY", "mha-h4-d32": "READY", TWIN: "READY", NEW: "UNAVAILABLE"}
        ready = server.post("/v2/repository/index", json={"ready": True}).json()
        assert sorted(m["name"] for m in ready) == sorted(["mha-h2-d32", "mha-h4-d32", TWIN])
    finally:
        shutil.rmtree(server.models_dir / NEW)


def test_a_model_loaded_is_served_by_every_process_and_unloaded_by_none_while_others_keep_answering(server):
    server.add_folder()
    failures, answered, stop = [], [0], threading.Event()

    def steady_load() -> None:  # another model, one connection per request: both processes see it
        while not stop.is_set():
            r = httpx.post(f"{server.base}/v1/models/mha-h4-d32/predict", json={"text": "abc"}, timeout=30)
            answered[0] += 1
            if r.status_code != 200:
                failures.append((r.status_code, r.text))

    workers = [threading.Thread(target=steady_load) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        server.triton.load_model(NEW, headers=AUTH)  # returns once every process serves it
        assert server.triton.is_model_ready(NEW)
        served = server.served_by(NEW, 40)
        assert len(served) == 2 and all(key.endswith(":200") for key in served), served
        server.triton.unload_model(NEW, headers=AUTH)
        assert {key.rsplit(":", 1)[1] for key in server.served_by(NEW, 20)} == {"404"}
        assert server.states()[NEW] == "UNAVAILABLE"
    finally:
        stop.set()
        for w in workers:
            w.join()
        shutil.rmtree(server.models_dir / NEW)
    assert answered[0] > 20 and failures == [], failures[:3]


def test_a_route_target_cannot_be_unloaded_and_bad_requests_are_refused(server):
    r = server.post("/v2/repository/models/mha-h2-d32/unload")
    assert r.status_code == 409 and ROUTE in r.json()["error"], r.text
    r = server.post("/v2/repository/models/not-a-model/load")
    assert r.status_code == 404 and "not-a-model" in r.json()["error"], r.text
    r = server.post("/v2/repository/models/mha-h2-d32/load", json={"parameters": {"config": "{}"}})
    assert r.status_code == 400 and "not supported" in r.json()["error"], r.text
    r = server.post("/v2/repository/index", content=b"{not json")
    assert r.status_code == 400, r.text
    assert server.states()["mha-h2-d32"] == "READY"


def test_every_repository_request_is_counted_by_status(server):
    server.post("/v2/repository/index", headers={})
    deadline = time.monotonic() + 60  # Ray exports what a replica recorded every few seconds
    while True:
        text = httpx.get(server.metrics_url, timeout=30).text
        lines = [line for line in text.splitlines() if line.startswith("ray_mha_repository_requests_total{")]
        if any('code="401"' in line and 'action="index"' in line for line in lines):
            break
        assert time.monotonic() < deadline, lines
        time.sleep(1)


def test_sighup_loads_what_the_models_folder_gained_and_unloads_what_it_lost(server):
    server.add_folder()
    try:
        server.proc.send_signal(signal.SIGHUP)  # each process loads it in its turn: both answer it in the end
        _wait_for(lambda: (served := server.served_by(NEW, 10)) and all(k.endswith(":200") for k in served))
        assert server.states().get(NEW) == "READY"
    finally:
        shutil.rmtree(server.models_dir / NEW)
    server.proc.send_signal(signal.SIGHUP)
    _wait_for(lambda: NEW not in server.states())
    assert "models loaded ['mha-h1-d32']" in server.log.read_text()


def _wait_for(condition, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.5)


def test_the_repository_needs_a_token_to_be_turned_on(tiny_models_dir, monkeypatch, capsys):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert launcher.main(["--models", str(tiny_models_dir), "--repository"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and TOKEN_ENV in err[0] and "is not set" in err[0]
    monkeypatch.setenv(TOKEN_ENV, "short")
    assert launcher.main(["--models", str(tiny_models_dir), "--repository"]) == 2
    assert "has 5 characters" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"needs repository\.token_sha256"):
        RepositorySettings(enabled=True)


def test_a_route_set_and_removed_through_the_api_reaches_every_process(server):
    put = lambda body: httpx.put(f"{server.base}/v2/repository/routes/trial", json=body, headers=AUTH, timeout=60)  # noqa: E731
    r = put({"targets": {"mha-h2-d32": 1, "mha-h4-d32": 0}})
    assert r.status_code == 200, r.text
    for _ in range(10):  # a connection each: both processes
        answer = httpx.post(f"{server.base}/v1/models/trial/predict", json={"text": "ab"}, timeout=30)
        assert answer.status_code == 200 and answer.json()["model"] == "mha-h2-d32", answer.text
    r = put({"targets": {"mha-h9-d32": 1}})
    assert r.status_code == 400 and "unknown model 'mha-h9-d32'" in r.json()["error"], r.text
    r = put({"targets": {"mha-h2-d32": -1}})
    assert r.status_code == 400 and "must not be negative" in r.json()["error"], r.text
    assert httpx.delete(f"{server.base}/v2/repository/routes/trial", headers=AUTH, timeout=60).status_code == 200
    r = httpx.delete(f"{server.base}/v2/repository/routes/trial", headers=AUTH, timeout=60)
    assert r.status_code == 404, r.text
    for _ in range(6):
        assert httpx.post(f"{server.base}/v1/models/trial/predict", json={"text": "ab"}, timeout=30).status_code == 404
    assert server.post("/v2/repository/models/mha-h4-d32/unload").status_code == 200  # no route targets it now
    assert server.post("/v2/repository/models/mha-h4-d32/load").status_code == 200


def _steady_load(server: Server, stop: threading.Event, failures: list, answered: list) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            r = client.post(f"{server.base}/v1/models/{ROLLOUT_ROUTE}/predict", json={"text": "abc"})
            answered.append(r.json().get("model") if r.status_code == 200 else None)
            if r.status_code != 200:
                failures.append((r.status_code, r.text))


def _under_load(server: Server, plan: RolloutPlan):
    stop, failures, answered, lines = threading.Event(), [], [], []
    worker = threading.Thread(target=_steady_load, args=(server, stop, failures, answered))
    worker.start()
    try:
        result = rollout(plan, server.admin, server.metrics_url, log=lines.append)
    finally:
        stop.set()
        worker.join()
    return result, failures, answered, lines


def test_an_agreeing_candidate_is_promoted_step_by_step_with_no_request_failed(server):
    plan = RolloutPlan(ROLLOUT_ROUTE, TWIN, steps_pct=(50.0, 100.0), hold_s=5.0, min_rows=20, min_agreement=0.99)
    result, failures, answered, lines = _under_load(server, plan)
    assert result.promoted, lines
    assert [s.name for s in result.steps] == ["shadow", "50%", "100%"]
    assert all(s.verdict == "held" and s.rows >= 20 and s.agreement == 1.0 for s in result.steps), result.steps
    assert result.steps[-1].requests > 0 and result.steps[-1].errors == 0
    assert failures == [] and TWIN in answered
    assert server.admin.route(ROLLOUT_ROUTE) == {"targets": {TWIN: 1.0}, "shadow": None}
    assert any("step 50%" in line for line in lines)


def test_a_candidate_below_the_agreement_bar_is_rolled_back_and_the_route_set_back(server):
    before = server.admin.route(ROLLOUT_ROUTE)
    incumbent = next(iter(before["targets"]))
    plan = RolloutPlan(ROLLOUT_ROUTE, "mha-h4-d32", hold_s=5.0, min_rows=20, min_agreement=0.99)  # untrained, unrelated
    result, failures, answered, lines = _under_load(server, plan)
    assert not result.promoted
    assert [s.name for s in result.steps] == ["shadow"]
    assert "agreement" in result.steps[0].verdict and "below 0.99" in result.steps[0].verdict, result.steps
    assert server.admin.route(ROLLOUT_ROUTE) == before
    assert failures == [] and set(answered) == {incumbent}
    assert any("set back as it was" in line for line in lines)


def _head(method: str, path: str, headers: dict[str, str], framing: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", framing]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _answer(sock: socket.socket) -> tuple[int, str]:
    """The status and JSON error of one answer, however the connection ends after it."""
    answer = b""
    try:
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 ") and b"application/json" in head.lower(), answer[:300]
    return int(head[9:12]), json.loads(body)["error"]


def _length(answer: bytes) -> int:
    head = answer.partition(b"\r\n\r\n")[0].lower()
    return int(head.split(b"content-length:")[1].split(b"\r\n")[0]) if b"content-length:" in head else 0


def _send_chunked(server: Server, method: str, path: str, headers: dict[str, str], size: int) -> tuple[int, str]:
    """`size` bytes as a chunked body, 64 KiB a chunk, until the server stops reading; then its answer."""
    with socket.create_connection(("127.0.0.1", int(server.base.rsplit(":", 1)[1])), timeout=30) as sock:
        sock.sendall(_head(method, path, headers, "Transfer-Encoding: chunked"))
        try:
            for _ in range(size >> 16):
                sock.sendall(_chunked(b"x" * 0x10000))
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed: the rest is never read
        return _answer(sock)


def test_an_oversized_repository_body_gets_a_readable_413_chunked_or_not_with_or_without_the_token(server):
    port = int(server.base.rsplit(":", 1)[1])
    for (method, path), headers in itertools.product(OPERATIONS, (AUTH, {})):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # announced: refused before a byte
            sock.sendall(_head(method, path, headers, "Content-Length: 2000000"))
            status, error = _answer(sock)
        assert status == 413 and "2000000 bytes is over the limit of 1048576" in error, (method, path, error)
        status, error = _send_chunked(server, method, path, headers, (1 << 20) + (128 << 10))
        assert status == 413 and "over the limit of 1048576 bytes" in error, (method, path, headers, error)
    assert server.states()["mha-h2-d32"] == "READY"


def test_a_huge_chunked_repository_body_is_cut_off_without_growing_the_serving_processes(server):
    pids = descendants_named(server.proc.pid, "ServeReplica")
    before = sum(memory_kib(pid, "Rss") for pid in pids)
    status, error = _send_chunked(server, "POST", "/v2/repository/index", AUTH, 64 << 20)
    growth_mib = (sum(memory_kib(pid, "Rss") for pid in pids) - before) / 1024
    print(f"\n64 MiB chunked index request: {status}, serving processes' RSS +{growth_mib:.1f} MiB")
    assert status == 413 and "over the limit of 1048576 bytes" in error and growth_mib < 20


def test_a_repository_body_trickling_past_the_deadline_gets_408_with_or_without_the_token(server):
    port = int(server.base.rsplit(":", 1)[1])
    socks = []
    start = time.monotonic()
    for (method, path), headers in itertools.product(OPERATIONS, (AUTH, {})):
        for framing, first in (("Content-Length: 64", b"{"), ("Transfer-Encoding: chunked", _chunked(b"{"))):
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(_head(method, path, headers, framing) + first)  # and no more
            socks.append((method, path, bool(headers), framing, sock))
    try:
        for method, path, token, framing, sock in socks:
            status, error = _answer(sock)
            assert status == 408 and f"within {BODY_TIMEOUT_S:g} s" in error, (method, path, token, framing)
    finally:
        for *_, sock in socks:
            sock.close()
    assert time.monotonic() - start < BODY_TIMEOUT_S + 10  # at the deadline, not at a later timeout of the server


MALFORMED = {  # body -> what its 400 names, on every operation that takes a body
    b"[]": "Input should be an object",
    b"5": "Input should be an object",
    b'"x"': "Input should be an object",
    b"null": "Input should be an object",
    b"{not json": "malformed JSON body",
    b"\xff\xfe": "malformed JSON body",
    b'{"parameters": "\xff"}': "malformed JSON body",  # not UTF-8 inside a string
}
MALFORMED_FIELDS = {  # (operation, body) -> what its 400 names
    ("index", b'{"ready": "yes"}'): "ready: Input should be a valid boolean",
    ("index", b'{"ready": 1}'): "ready: Input should be a valid boolean",
    ("load", b'{"parameters": [1]}'): "parameters: Input should be an object",
    ("load", b'{"parameters": 5}'): "parameters: Input should be an object",
    ("load", b'{"parameters": {"a": {"b": 1}}}'): "parameters.a",
    ("load", b'{"parameters": {"config": "{}"}}'): "are not supported",
    ("load", b'{"parameters": {"file:1/model.onnx": "AAAA"}}'): "are not supported",
    ("unload", b'{"parameters": [1]}'): "parameters: Input should be an object",
    ("route", b""): "targets: Field required",
    ("route", b'{"targets": []}'): "targets: Input should be an object",
    ("route", b'{"targets": {}}'): "the weights must not sum to 0",
    ("route", b'{"targets": {"mha-h2-d32": "1"}}'): "targets.mha-h2-d32: Input should be a valid number",
    ("route", b'{"targets": {"mha-h2-d32": true}}'): "targets.mha-h2-d32: Input should be a valid number",
    ("route", b'{"targets": {"mha-h2-d32": 1e400}}'): "Input should be a finite number",
    ("route", b'{"targets": {"mha-h2-d32": 1' + b"0" * 400 + b"}}"): "Input should be a finite number",
    ("route", b'{"targets": {"mha-h2-d32": 1.7e308, "mha-h4-d32": 1.7e308}}'): "must sum to a finite number",
    ("route", b'{"targets": {"mha-h2-d32": 1}, "shadow": {"model": 5}}'): "shadow.model",
    ("route", b'{"targets": {"mha-h2-d32": 1}, "weights": 1}'): "weights: Extra inputs are not permitted",
}
WITH_BODY = {  # operation -> its path, for a model with no folder (the body's 400 comes first)
    "index": "/v2/repository/index",
    "load": "/v2/repository/models/not-a-model/load",
    "unload": "/v2/repository/models/not-a-model/unload",
}


def test_every_malformed_repository_body_is_a_400_naming_the_problem_before_the_model_is_looked_up(server):
    answers = []
    for path in WITH_BODY.values():
        for body, message in MALFORMED.items():
            answers.append((server.post(path, content=body), message, path, body))
    for (operation, body), message in MALFORMED_FIELDS.items():
        if operation == "route":
            r = httpx.put(f"{server.base}/v2/repository/routes/trial", content=body, headers=AUTH, timeout=60)
            answers.append((r, message, "route", body))
        else:
            answers.append((server.post(WITH_BODY[operation], content=body), message, operation, body))
    for answer, message, where, body in answers:
        assert answer.status_code == 400 and message in answer.json()["error"], (where, body, answer.text)
    for name, message in (("bad name!", "a route's name is 1 to 128"), ("mha-h2-d32", "named like a model")):
        r = httpx.put(f"{server.base}/v2/repository/routes/{name}", json={"targets": {"mha-h2-d32": 1}}, headers=AUTH)
        assert r.status_code == 400 and message in r.json()["error"], r.text
    assert server.post("/v2/repository/models/not-a-model/load", content=b"").status_code == 404  # no body: {}
    routes = httpx.get(f"{server.base}/v1/models", timeout=30).json()["routes"]
    assert server.states()["mha-h2-d32"] == "READY" and "trial" not in [r["name"] for r in routes]


def test_every_ref_of_the_served_document_resolves_the_repository_api_included(server):
    document = httpx.get(f"{server.base}/openapi.json", timeout=30).json()
    found = set(refs(document))
    assert {"#/components/schemas/RepositoryLoadRequest", "#/components/schemas/Route"} <= found
    for ref in found:
        assert resolved(document, ref) is not None, f"{ref} does not resolve"


def test_any_other_method_gets_405_with_allow_listing_every_method_the_path_serves(server):
    document = httpx.get(f"{server.base}/openapi.json", timeout=30).json()
    values = {"name": "mha-h2-d32", "version": "1", "model": "mha-h2-d32", "route": "trial"}
    with httpx.Client(base_url=server.base, timeout=30) as client:
        for path, operations in document["paths"].items():
            served = {method.upper() for method in operations}
            r = client.options(path.format(**values))
            allowed = {m.strip() for m in r.headers.get("allow", "").split(",")}
            assert r.status_code == 405 and allowed == served, (path, r.status_code, r.headers.get("allow"))
    r = httpx.options(f"{server.base}/v2/repository/routes/trial", timeout=30)
    assert r.headers["allow"] == "DELETE, PUT" and r.json()["error"], r.text
