"""Several serving processes on one node (`mha-serving serve --processes 2`): both accept on the same HTTP and gRPC
ports (the kernel spreads connections; the `x-served-by` header names the process that answered), a routing key
picks the same target whichever answers, a route reload reaches both, a SIGKILLed process is replaced while the
other keeps serving, and SIGTERM drains both. One real server for the file, on loopback."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml
from serving import serve_process

from benchmarks.harness.polling import until
from benchmarks.harness.processes import descendants_named
from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from loadtest.http_client import post_bytes
from service.ingress import SERVED_BY
from service.local.ports import free_port
from service.routes import ROUTE_KEY

pytestmark = [pytest.mark.serve, pytest.mark.slow]
ROUTE = "pair"
INGRESS = "ServeReplica:mha:ingress"


def _write(path: Path, models_dir: Path, targets: dict[str, float]) -> None:
    path.write_text(yaml.safe_dump({"models_dir": str(models_dir), "routes": {ROUTE: {"targets": targets}}}))


class Server:
    def __init__(self, proc, config: Path, models_dir: Path, ports: tuple[int, int, int], log: Path) -> None:
        self.proc, self.config, self.models_dir, self.log = proc, config, models_dir, log
        port, grpc_port, metrics_port = ports
        self.port, self.base, self.grpc_address = port, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"

    def predict(self, name: str, key: str | None = None) -> httpx.Response:
        """One request on a connection of its own (the kernel picks the process per connection)."""
        headers = {ROUTE_KEY: key} if key else {}
        return httpx.post(f"{self.base}/v1/models/{name}/predict", json={"text": "ab"}, headers=headers, timeout=30)

    def answers(self, name: str, n: int, key: str | None = None) -> list[tuple[str, str]]:
        """(the process that answered, the model that answered) of `n` requests, each asserted 200."""
        out = []
        for _ in range(n):
            r = self.predict(name, key)
            assert r.status_code == 200, r.text
            out.append((r.headers[SERVED_BY], r.json()["model"]))
        return out


@pytest.fixture(scope="module")
def server(tiny_models_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("processes")
    config, log = folder / "serve.yaml", folder / "serve.log"
    _write(config, tiny_models_dir, {"mha-h2-d32": 1, "mha-h4-d32": 1})
    ports = free_port(), free_port(), free_port()
    args = ["--config", str(config), "--processes", "2", "--port", str(ports[0]), "--grpc-port", str(ports[1])]
    with serve_process([*args, "--metrics-port", str(ports[2])], log) as (proc, _):
        yield Server(proc, config, tiny_models_dir, ports, log)


def test_two_serving_processes_answer_on_one_port(server):
    assert len(descendants_named(server.proc.pid, INGRESS)) == 2
    processes = {who for who, _ in server.answers("mha-h2-d32", 60)}
    assert len(processes) == 2, processes


def test_the_repository_api_is_off_unless_turned_on(server):
    r = httpx.post(f"{server.base}/v2/repository/index", timeout=30)
    assert r.status_code == 404, r.text


def test_each_process_keeps_its_own_request_series(server):
    server.answers("mha-h2-d32", 40)
    deadline = time.monotonic() + 60  # Ray exports what a replica recorded every few seconds
    while True:
        lines = httpx.get(server.metrics_url, timeout=30).text.splitlines()
        counted = [
            line for line in lines if line.startswith("ray_mha_requests_total{") and 'model="mha-h2-d32"' in line
        ]
        replicas = {line.split('replica="', 1)[1].split('"', 1)[0] for line in counted if 'replica="' in line}
        if len(replicas) >= 2:
            break
        assert time.monotonic() < deadline, counted
        time.sleep(2)


def test_both_processes_answer_grpc_on_one_port(server):
    answered = 0
    for _ in range(20):  # a channel of its own per call: a connection each
        with grpc.insecure_channel(server.grpc_address) as channel:
            request = pb.ModelInferRequest(model_name="mha-h2-d32")
            tensor = request.inputs.add(name="input_ids", datatype="INT64", shape=[1, 3])
            tensor.contents.int64_contents.extend([1, 101, 102])
            reply = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=30)
            answered += reply.model_name == "mha-h2-d32"
    assert answered == 20


def test_a_routing_key_picks_the_same_target_whichever_process_answers(server):
    for key in ("user-1", "user-2", "user-3"):
        answers = server.answers(ROUTE, 24, key)
        assert len({who for who, _ in answers}) == 2, answers
        assert len({model for _, model in answers}) == 1, answers


def test_a_route_reload_reaches_every_process_and_says_when_all_have_it(server):
    applied = "reload: applied in every serving process"
    before = server.log.read_text().count(applied)
    _write(server.config, server.models_dir, {"mha-h2-d32": 0, "mha-h4-d32": 1})
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while server.log.read_text().count(applied) == before:
        assert time.monotonic() < deadline, server.log.read_text()
        time.sleep(0.2)
    answers = server.answers(ROUTE, 40)
    assert len({who for who, _ in answers}) == 2 and {model for _, model in answers} == {"mha-h4-d32"}


def test_a_killed_process_is_replaced_while_the_other_keeps_serving(server):
    before = {who for who, _ in server.answers("mha-h2-d32", 40)}
    victim = descendants_named(server.proc.pid, INGRESS)[0]
    outcomes: list[tuple[float, int]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                outcomes.append((time.monotonic(), server.predict("mha-h2-d32").status_code))
            except httpx.HTTPError:  # a connection the victim held, or had just accepted
                outcomes.append((time.monotonic(), 0))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 90
        while True:  # Serve's health check replaces it: a third process id answers
            try:
                seen = {who for who, _ in server.answers("mha-h2-d32", 10)}
            except httpx.TransportError:  # a connection the victim's socket took as it died: reset, as the load's
                assert time.monotonic() < killed + 1.0, "a connection reset more than a second after the kill"
                seen = set()
            if seen - before:
                break
            assert time.monotonic() < deadline, server.log.read_text()[-3000:]
            time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    after_kill = [code for t, code in outcomes if t > killed + 1.0]
    assert after_kill and all(code == 200 for code in after_kill), after_kill[:20]
    failed_at_kill = [code for t, code in outcomes if t <= killed + 1.0 and code != 200]
    assert len(failed_at_kill) <= 4, failed_at_kill  # at most the requests the victim held or had just accepted


def _read_answer(sock: socket.socket) -> tuple[int, str]:
    """(status, x-served-by) of the one response on `sock`."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return 0, ""
        data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in head[1:] if ": " in line)
    return int(head[0].split()[1]), headers.get(SERVED_BY, "")


def test_sigterm_drains_every_process_and_each_request_in_progress_gets_its_answer(server):
    """Last in the file: it stops the server. Requests whose bodies are still arriving are in progress in both
    processes when SIGTERM comes; readiness turns 503 on both, and every one of them is answered."""
    body = json.dumps({"text": "in flight"}).encode()
    whole = post_bytes("/v1/models/mha-h2-d32/predict", body)
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(12)]
    for sock in socks:
        sock.sendall(whole[:-4])  # the head and all but the body's last bytes: admitted, reading the body
    time.sleep(0.5)
    server.proc.send_signal(signal.SIGTERM)

    def draining() -> set[int]:  # 12 fresh connections, both processes among them, all answered 503
        codes = {httpx.get(f"{server.base}/v2/health/ready", timeout=10).status_code for _ in range(12)}
        return codes if codes == {503} else set()

    # Each process turns at its reconfigure (~1.5 s on 2 idle cores, Serve's); within the bodies' 10 s and drain_s
    until("readiness 503 on both processes", draining, 5.0, every_s=0.25, retried=())
    for sock in socks:
        sock.sendall(whole[-4:])
    answers = [_read_answer(sock) for sock in socks]
    assert server.proc.wait(timeout=30) == 0, server.log.read_text()[-3000:]
    assert [code for code, _ in answers] == [200] * len(socks), answers
    assert len({who for _, who in answers}) == 2, answers
