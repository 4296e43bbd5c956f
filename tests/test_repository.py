"""The model repository API (`mha-serving serve --repository`), against one real server of two serving processes on
loopback: Triton's own HTTP client lists, loads and unloads models; a model loaded is served by every process, one
unloaded by none; requests for the other models all succeed meanwhile; the token is required (401) and counted; a
route's target cannot be unloaded (409); SIGHUP loads what was added to the models folder and unloads what left.
And `optimize --rollout shadow` through it (optimize/rollout.py), a route under steady load: a candidate that agrees
with the incumbent goes shadow -> 50 % -> 100 % and answers the route; one that does not is rolled back at its
shadow step, the route set back as it was; no request fails either way."""

from __future__ import annotations

import shutil
import signal
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
from serving import serve_process
from tritonclient.utils import InferenceServerException

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
    config.write_text(yaml.safe_dump({"models_dir": str(models_dir), "routes": routes}))
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
    plan = RolloutPlan(ROLLOUT_ROUTE, TWIN, steps_pct=(50.0, 100.0), hold_s=3.0, min_rows=20, min_agreement=0.99)
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
    plan = RolloutPlan(ROLLOUT_ROUTE, "mha-h4-d32", hold_s=3.0, min_rows=20, min_agreement=0.99)  # untrained, unrelated
    result, failures, answered, lines = _under_load(server, plan)
    assert not result.promoted
    assert [s.name for s in result.steps] == ["shadow"]
    assert "agreement" in result.steps[0].verdict and "below 0.99" in result.steps[0].verdict, result.steps
    assert server.admin.route(ROLLOUT_ROUTE) == before
    assert failures == [] and set(answered) == {incumbent}
    assert any("set back as it was" in line for line in lines)
