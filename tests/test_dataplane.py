"""The data plane on its own, with no transport in front of it: a decoded request in, a typed result out, admission's
refusals as typed errors, routes resolved, drain. Co-located tiny models in this process; no Serve, no HTTP."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from serving import bare_logits

from service.config import AppConfig
from service.dataplane import DataPlane, Endpoint
from service.errors import BadRequestError, ModelNotFoundError, OverCapacityError
from service.inference import InferenceRequest
from service.ingress import placements

MODELS = ["mha-h2-d32", "mha-h4-d32"]
TEST = Endpoint("test")


def _plane(models_dir, **config) -> DataPlane:
    app = AppConfig(models_dir=str(models_dir), models=MODELS, **config)
    return DataPlane(app, placements(app, {}, MODELS))


def _run(models_dir, scenario, **config):
    async def main():
        return await scenario(_plane(models_dir, **config))

    return asyncio.run(main())


def test_a_decoded_request_is_answered_with_the_models_own_logits(tiny_models_dir):
    ids = np.array([[1, 101, 102, 0], [1, 103, 0, 0]], dtype=np.int64)  # (2, 4), padded
    mask = (ids > 0).astype(np.int64)

    async def scenario(plane):
        return await plane.infer(TEST, "mha-h2-d32", InferenceRequest(ids, mask, id="r1"))

    result = _run(tiny_models_dir, scenario)
    assert result.model == "mha-h2-d32" and result.metadata.heads == 2 and result.batch_rows == 2
    np.testing.assert_allclose(result.logits, bare_logits(tiny_models_dir, "mha-h2-d32", ids, mask), atol=1e-5)


def test_a_route_is_answered_by_the_target_its_key_picks(tiny_models_dir):
    routes = {"pair": {"targets": {"mha-h2-d32": 1, "mha-h4-d32": 1}}}

    async def scenario(plane):
        plan = plane.models.routes.get("pair")
        answered = []
        for key in ("a", "b", "c", "d"):
            result = await plane.infer(TEST, "pair", InferenceRequest(texts=["xy"]), route_key=key)
            answered.append((result.model, plan.pick(key)))
        return answered

    answered = _run(tiny_models_dir, scenario, routes=routes)
    assert all(model == picked for model, picked in answered), answered


@pytest.mark.parametrize(
    ("name", "request_", "error", "words"),
    [
        ("nope", InferenceRequest(texts=["x"]), ModelNotFoundError, "unknown model 'nope'"),
        ("mha-h2-d32", InferenceRequest(texts=["x"], outputs=("probs",)), BadRequestError, "unknown output 'probs'"),
        ("mha-h2-d32", InferenceRequest(), BadRequestError, "neither token ids nor texts"),
        ("mha-h2-d32", InferenceRequest(texts=["x"] * 3), BadRequestError, "3 texts in one request, over the limit"),
    ],
)
def test_what_admission_and_the_models_contract_refuse_is_a_typed_error_naming_it(
    tiny_models_dir, name, request_, error, words
):
    async def scenario(plane):
        with pytest.raises(error, match=words):
            await plane.infer(TEST, name, request_)
        return plane.load.inference

    assert _run(tiny_models_dir, scenario, limits={"max_rows": 2}) == 0  # nothing left counted in flight


def test_over_max_in_flight_a_request_is_refused_before_it_is_read(tiny_models_dir):
    async def scenario(plane):
        read = []
        async with plane.admit(TEST, "mha-h2-d32"):
            with pytest.raises(OverCapacityError, match="1 inference requests in progress"):
                async with plane.admit(TEST, "mha-h2-d32"):
                    read.append("body")  # never reached: refused at admission
        return read

    assert _run(tiny_models_dir, scenario, limits={"max_in_flight": 1}) == []


def test_drain_makes_readiness_say_why_and_ends_once_nothing_is_in_progress(tiny_models_dir):
    async def scenario(plane):
        ready_before = await plane.not_ready()
        left = await plane.drained(until=0.0)
        return ready_before, left, await plane.not_ready()

    assert _run(tiny_models_dir, scenario) == (None, 0, "shutting down")


def test_a_route_is_refused_where_the_endpoint_serves_models_only(tiny_models_dir):
    per_model = Endpoint("maps", per_model="attention maps are per model")
    routes = {"pair": {"targets": {"mha-h2-d32": 1}}}

    async def scenario(plane):
        with pytest.raises(ModelNotFoundError, match="'pair' is a route: attention maps are per model"):
            async with plane.admit(per_model, "pair"):
                pass
        async with plane.admit(per_model, "mha-h2-d32") as call:
            return call.target

    assert _run(tiny_models_dir, scenario, routes=routes) == "mha-h2-d32"
