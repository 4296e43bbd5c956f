"""Routes: a name served like a model, each request answered by one of its targets by weight (pinned by a routing
key); a shadow model mirrored a share of the requests; routes changed in place by `mha-serving serve`'s reload.

The agreement metrics, read through a real Prometheus, are in tests/test_metrics.py.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import yaml
from serving import deployed, free_port, serve_process, v2_tensor

from benchmarks.harness.processes import descendants_named
from contract.rpc import inference_pb2 as pb
from contract.rpc import inference_pb2_grpc as pb_grpc
from service.local import launcher
from service.route_config import Route
from service.routes import ROUTE_KEY, RoutePlan
from service.shadow import compare

ROUTE = "pair"
ROUTES = {ROUTE: {"targets": {"mha-h2-d32": 3, "mha-h4-d32": 1}, "shadow": {"model": "mha-h4-d32", "fraction": 1.0}}}


# ---- the configuration: every error is one line naming it, before anything starts ----
@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ({"mha-h2-d32": {"targets": {"mha-h4-d32": 1}}}, "routes.mha-h2-d32: a route cannot be named like a model"),
        ({"r": {"targets": {"nope": 1}}}, "routes.r.targets: unknown model 'nope'; models: ['mha-h2-d32'"),
        ({"r": {"targets": {"mha-h2-d32": -1, "mha-h4-d32": 2}}}, "routes.r.targets: weights must not be negative"),
        ({"r": {"targets": {"mha-h2-d32": 0, "mha-h4-d32": 0}}}, "routes.r.targets: the weights must not sum to 0"),
        ({"r": {"targets": {}}}, "routes.r.targets: the weights must not sum to 0"),
        ({"r": {"targets": {"mha-h2-d32": 1e308, "mha-h4-d32": 1e308}}}, "the weights must sum to a finite number"),
        ({"r": {"targets": {"mha-h2-d32": True}}}, "routes.r.targets.mha-h2-d32: Input should be a valid number"),
        ({"a route": {"targets": {"mha-h2-d32": 1}}}, "routes.a route.[key]: String should match pattern"),
        (
            {"r": {"targets": {"mha-h2-d32": 1}, "shadow": {"model": "mha-h4-d32", "fraction": 1.5}}},
            "routes.r.shadow.fraction: must be within [0, 1], got 1.5",
        ),
        (
            {"r": {"targets": {"mha-h2-d32": 1}, "shadow": {"model": "nope", "fraction": 0.5}}},
            "routes.r.shadow.model: unknown model 'nope'",
        ),
    ],
)
def test_a_route_that_cannot_be_served_fails_the_start_in_one_line_naming_it(
    tiny_models_dir, tmp_path, capsys, routes, message
):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"models_dir": str(tiny_models_dir), "routes": routes}))
    assert launcher.main(["--config", str(config), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err


def test_ten_thousand_draws_give_each_target_its_weight_within_two_points():
    plan = RoutePlan.of("r", Route(targets={"big": 90, "small": 10, "off": 0}))
    picks = Counter(plan.pick(None) for _ in range(10_000))
    assert abs(picks["big"] / 10_000 - 0.9) <= 0.02 and abs(picks["small"] / 10_000 - 0.1) <= 0.02, picks
    assert picks["off"] == 0


def test_a_routing_key_reaches_the_same_target_whatever_the_order_of_the_weights():
    plan = RoutePlan.of("r", Route(targets={"big": 90, "small": 10}))
    reordered = RoutePlan.of("r", Route(targets={"small": 10, "big": 90}))
    keys = [f"user-{i}" for i in range(10_000)]
    first = [plan.pick(k) for k in keys]
    assert first == [plan.pick(k) for k in keys] == [reordered.pick(k) for k in keys]
    assert abs(first.count("small") / len(keys) - 0.1) <= 0.02  # keys spread by weight too


def test_agreement_counts_rows_whose_predicted_label_matches_and_the_largest_logit_difference():
    answered = np.array([[2.0, 0.0, 1.0], [0.0, 1.0, 0.5]], dtype=np.float32)  # (2, 3)
    shadow = np.array([[1.5, 0.0, 1.0], [0.0, 0.2, 0.9]], dtype=np.float32)
    agreement = compare(answered, shadow)
    assert (agreement.rows, agreement.agreeing) == (2, 1)
    assert agreement.max_abs_diff == pytest.approx(0.8)


# ---- served: the session's Serve, the tiny models, both placements ----
@pytest.fixture(scope="module", params=["colocated", "deployment"])
def routed(request, serve_port, tiny_models_dir):
    with deployed(serve_port, f"routes-{request.param}", tiny_models_dir, request.param, routes=ROUTES) as served:
        yield served


@pytest.mark.serve
def test_a_route_is_listed_with_its_targets_and_served_like_a_model(routed):
    with httpx.Client(base_url=routed.base_url, timeout=60) as client:
        listing = client.get("/v1/models").json()
        assert listing["routes"] == [{"name": ROUTE, **ROUTES[ROUTE], "ready": True}]
        assert ROUTE not in {m["name"] for m in listing["models"]}
        answered = Counter()
        for i in range(40):
            r = client.post(f"/v1/models/{ROUTE}/predict", json={"text": f"hello {i}"})
            assert r.status_code == 200, r.text
            answered[r.json()["model"]] += 1
            ids = v2_tensor("input_ids", [[5, 6, 7, i + 8]])
            r = client.post(f"/v2/models/{ROUTE}/infer", json={"inputs": [ids]})
            assert r.status_code == 200, r.text
            answered[r.json()["model_name"]] += 1
        assert set(answered) == {"mha-h2-d32", "mha-h4-d32"}, answered  # 3:1 weights, 80 draws
        assert client.get(f"/v2/models/{ROUTE}/ready").status_code == 200
        meta = client.get(f"/v2/models/{ROUTE}").json()
        assert meta["name"] == ROUTE and [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask"]
        r = client.post(f"/v1/models/{ROUTE}/attention", json={"text": "hi"})
        assert r.status_code == 404 and "is a route" in r.json()["error"]
        r = client.post("/v1/models/nope/predict", json={"text": "hi"})
        assert r.status_code == 404 and f"routes: ['{ROUTE}']" in r.json()["error"]


@pytest.mark.serve
def test_the_same_routing_key_always_reaches_the_same_target(routed):
    with httpx.Client(base_url=routed.base_url, timeout=60) as client:
        seen: dict[str, set[str]] = {}
        for key in [f"user-{i}" for i in range(12)] * 3:
            r = client.post(f"/v1/models/{ROUTE}/predict", json={"text": "same"}, headers={ROUTE_KEY: key})
            assert r.status_code == 200, r.text
            seen.setdefault(key, set()).add(r.json()["model"])
    assert all(len(models) == 1 for models in seen.values()), seen
    plan = RoutePlan.of(ROUTE, Route.model_validate(ROUTES[ROUTE]))
    assert {k: m.pop() for k, m in seen.items()} == {k: plan.pick(k) for k in seen}  # the key decides, not the replica


@pytest.mark.serve
def test_grpc_calls_to_a_route_are_pinned_by_their_metadata_key(routed, serve_grpc_port):
    message = pb.ModelInferRequest(model_name=ROUTE)
    message.inputs.add(name="input_ids", datatype="INT64", shape=[1, 4]).contents.int64_contents.extend([5, 6, 7, 8])
    plan = RoutePlan.of(ROUTE, Route.model_validate(ROUTES[ROUTE]))
    with grpc.insecure_channel(f"127.0.0.1:{serve_grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for key in [f"user-{i}" for i in range(8)]:
            metadata = (("application", routed.name), (ROUTE_KEY, key))
            answer = stub.ModelInfer(message, metadata=metadata, timeout=60)
            assert answer.model_name == plan.pick(key)


# ---- a reload under load: the weights change in place, no request fails ----
def _config(path: Path, models_dir: Path, targets: dict[str, float]) -> None:
    routes = {ROUTE: {"targets": targets, "shadow": {"model": "mha-h4-d32", "fraction": 0.5}}}
    path.write_text(yaml.safe_dump({"models_dir": str(models_dir), "routes": routes}))


class Load:
    """Threads sending route requests until stopped, recording (time, code, model) per answer."""

    def __init__(self, base_url: str, threads: int = 3) -> None:
        self.answers: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(base_url, i)) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _send(self, base_url: str, i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    r = client.post(f"/v1/models/{ROUTE}/predict", json={"text": f"load {i} {n}"})
                    self.answers.append((time.monotonic(), r.status_code, r.json().get("model", r.text)))
                except httpx.HTTPError as exc:  # a failed request is recorded, not raised in a thread
                    self.answers.append((time.monotonic(), 0, repr(exc)))

    def models_since(self, since: float) -> set[str]:
        return {model for t, code, model in list(self.answers) if t >= since and code == 200}

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)


@pytest.mark.serve
def test_a_reload_changes_the_weights_in_place_under_load_and_no_request_fails(tiny_models_dir, tmp_path):
    config, log = tmp_path / "routes.yaml", tmp_path / "serve.log"
    _config(config, tiny_models_dir, {"mha-h2-d32": 1, "mha-h4-d32": 0})
    port = free_port()
    args = ["--config", str(config), "--port", str(port), "--grpc-port", "0", "--metrics-port", str(free_port())]
    with serve_process(args, log) as (proc, _):
        replicas = descendants_named(proc.pid, "ServeReplica:mha:ingress")
        assert len(replicas) == 1, replicas
        load = Load(f"http://127.0.0.1:{port}")
        try:
            time.sleep(1.0)
            assert load.models_since(0) == {"mha-h2-d32"}
            _config(config, tiny_models_dir, {"mha-h2-d32": 0, "mha-h4-d32": 1})
            proc.send_signal(signal.SIGHUP)
            switched = time.monotonic()
            deadline = switched + 60
            while "mha-h4-d32" not in load.models_since(switched):
                assert time.monotonic() < deadline, "the new weights never took effect:\n" + log.read_text()
                time.sleep(0.2)
            applied = time.monotonic()
            time.sleep(1.0)
            assert load.models_since(applied) == {"mha-h4-d32"}

            _config(config, tiny_models_dir, {"mha-h2-d32": 1, "nope": 1})  # refused: the running routes stay
            proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 30
            while "reload refused" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            refused = time.monotonic()
            time.sleep(1.0)
            assert load.models_since(refused) == {"mha-h4-d32"}
        finally:
            load.stop()
        failed = [a for a in load.answers if a[1] != 200]
        assert not failed and len(load.answers) > 50, (failed[:5], len(load.answers))
        assert descendants_named(proc.pid, "ServeReplica:mha:ingress") == replicas  # reconfigured, not replaced
        line = next(x for x in log.read_text().splitlines() if "reload refused" in x)
        assert "routes.pair.targets: unknown model 'nope'" in line
        routes = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["routes"]
        assert routes[0]["targets"] == {"mha-h2-d32": 0.0, "mha-h4-d32": 1.0}


def test_a_serve_config_file_gives_its_ingress_user_config_routes_to_the_launcher(tiny_models_dir, tmp_path):
    app = {
        "name": "mha",
        "import_path": "service.app:build_app",
        "args": {"models_dir": str(tiny_models_dir)},
        "deployments": [{"name": "ingress", "user_config": {"routes": ROUTES}}],
    }
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump({"applications": [app]}))
    config = launcher.load_config(launcher.parse_args(["--config", str(path)]))
    assert {name: route.model_dump() for name, route in config.routes.items()} == ROUTES
