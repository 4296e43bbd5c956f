"""`--rollout shadow` against a real server on loopback (the repository API on, a route under steady load): a
candidate that agrees with the incumbent goes shadow -> 50 % -> 100 % and answers the route; one that does not is
rolled back at its shadow step, the route set back as it was; no request fails either way."""

from __future__ import annotations

import dataclasses
import shutil
import threading

import httpx
import pytest
import torch
import yaml
from conftest import TINY
from serving import serve_process

from export.convert import export_model, exporter_versions
from export.model import EncoderClassifier, EncoderConfig
from optimize.rollout import RolloutPlan, ServiceAdmin, rollout
from service.local.arguments import TOKEN_ENV
from service.local.ports import free_port
from service.repository_settings import RepositorySettings

pytestmark = [pytest.mark.serve, pytest.mark.slow]
TOKEN = "a-rollout-token-of-some-length"
ROUTE = "classifier"
TWIN = "mha-h2-d32-twin"  # the incumbent's weights under another name: it agrees with it everywhere


class Service:
    def __init__(self, port: int, metrics_port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.admin = ServiceAdmin(self.base, RepositorySettings().header, TOKEN)

    def steady_load(self, stop: threading.Event, failures: list, answered: list) -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                r = client.post(f"{self.base}/v1/models/{ROUTE}/predict", json={"text": "abc"})
                answered.append(r.json().get("model") if r.status_code == 200 else None)
                if r.status_code != 200:
                    failures.append((r.status_code, r.text))


@pytest.fixture(scope="module")
def service(tiny_models_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rollout")
    models_dir = folder / "models"
    shutil.copytree(tiny_models_dir, models_dir)
    torch.manual_seed(2)  # as conftest's mha-h2-d32
    config = EncoderConfig(heads=2, **TINY)
    meta = dataclasses.replace(config.metadata(exporter_versions()), name=TWIN)
    export_model(EncoderClassifier(config), meta, models_dir)
    serve_config = folder / "serve.yaml"
    routes = {ROUTE: {"targets": {"mha-h2-d32": 1}}}
    serve_config.write_text(yaml.safe_dump({"models_dir": str(models_dir), "routes": routes}))
    port, metrics_port = free_port(), free_port()
    args = ["--config", str(serve_config), "--port", str(port), "--grpc-port", "0", "--repository"]
    args += ["--metrics-port", str(metrics_port)]
    with serve_process(args, folder / "serve.log", env={TOKEN_ENV: TOKEN}):
        yield Service(port, metrics_port)


def _under_load(service: Service, plan: RolloutPlan):
    stop, failures, answered, lines = threading.Event(), [], [], []
    worker = threading.Thread(target=service.steady_load, args=(stop, failures, answered))
    worker.start()
    try:
        result = rollout(plan, service.admin, service.metrics_url, log=lines.append)
    finally:
        stop.set()
        worker.join()
    return result, failures, answered, lines


def test_an_agreeing_candidate_is_promoted_step_by_step_with_no_request_failed(service):
    plan = RolloutPlan(ROUTE, TWIN, steps_pct=(50.0, 100.0), hold_s=3.0, min_rows=20, min_agreement=0.99)
    result, failures, answered, lines = _under_load(service, plan)
    assert result.promoted, lines
    assert [s.name for s in result.steps] == ["shadow", "50%", "100%"]
    assert all(s.verdict == "held" and s.rows >= 20 and s.agreement == 1.0 for s in result.steps), result.steps
    assert result.steps[-1].requests > 0 and result.steps[-1].errors == 0
    assert failures == [] and TWIN in answered
    assert service.admin.route(ROUTE) == {"targets": {TWIN: 1.0}, "shadow": None}
    assert any("step 50%" in line for line in lines)


def test_a_candidate_below_the_agreement_bar_is_rolled_back_and_the_route_set_back(service):
    before = service.admin.route(ROUTE)
    incumbent = next(iter(before["targets"]))
    plan = RolloutPlan(ROUTE, "mha-h4-d32", hold_s=3.0, min_rows=20, min_agreement=0.99)  # untrained, unrelated
    result, failures, answered, lines = _under_load(service, plan)
    assert not result.promoted
    assert [s.name for s in result.steps] == ["shadow"]
    assert "agreement" in result.steps[0].verdict and "below 0.99" in result.steps[0].verdict, result.steps
    assert service.admin.route(ROUTE) == before
    assert failures == [] and set(answered) == {incumbent}
    assert any("set back as it was" in line for line in lines)
