"""The ingress's own server's application (service/http/api.py InferenceFirst): the inference routes are answered
ahead of FastAPI's stack with the same limits check and error mapping, everything else goes to the application.
The data plane is a stand-in whose admission fails: what is checked is the dispatch, not inference."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from service.config import RequestLimits
from service.errors import ModelNotFoundError
from service.http.api import INFERENCE_ROUTES, HandledRoute, InferenceFirst


class Behind:
    """The application behind: holds the inference routes as the FastAPI application registers them, and records
    every request that reaches it."""

    def __init__(self, plane) -> None:
        self.routes = [HandledRoute(route, plane) for route in INFERENCE_ROUTES]
        self.passed: list[tuple[str, str]] = []

    async def __call__(self, scope, receive, send) -> None:
        self.passed.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _first(admit) -> InferenceFirst:
    plane = SimpleNamespace(limits=RequestLimits(), admit=admit, models_dir="models")
    return InferenceFirst(Behind(plane), plane)


def _client(admit) -> tuple[httpx.AsyncClient, list[tuple[str, str]]]:
    app = _first(admit)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test"), app.app.passed


def _not_found(kind, name, *rest):
    raise ModelNotFoundError(f"model {name!r} is not served")


def test_inference_posts_are_answered_first_and_every_other_request_goes_to_the_application():
    async def run():
        client, passed = _client(_not_found)
        async with client:
            for path in ("/v2/models/m/infer", "/v2/models/m/versions/1/infer", "/v1/models/m/predict"):
                answer = await client.post(path, content=b"{}")
                assert answer.status_code == 404 and answer.json() == {"error": "model 'm' is not served"}, path
            assert passed == []
            for method, path in [("GET", "/v2/models/m/infer"), ("POST", "/v2/models/m/ready"),
                                 ("POST", "/v2/models/a/b/infer"), ("POST", "/v1/models/m/attention")]:  # fmt: skip
                assert (await client.request(method, path)).status_code == 299
            assert [p for _, p in passed] == ["/v2/models/m/infer", "/v2/models/m/ready", "/v2/models/a/b/infer",
                                              "/v1/models/m/attention"]  # fmt: skip

    asyncio.run(run())


def test_a_body_announced_over_the_limit_is_refused_before_the_handler():
    called = []

    async def run():
        client, _ = _client(lambda *args: called.append(args))
        async with client:
            big = RequestLimits().max_body_bytes + 1
            answer = await client.post("/v2/models/m/infer", headers={"content-length": str(big)}, content=b"x" * big)
            assert answer.status_code == 413 and "over the limit" in answer.json()["error"]

    asyncio.run(run())
    assert called == []


def test_an_unexpected_error_is_a_json_500_and_is_raised_on_for_the_server_to_log():
    def broken(*args):
        raise KeyError("boom")

    async def run():
        client, _ = _client(broken)
        async with client:
            answer = await client.post("/v1/models/m/predict", content=b"{}")
            assert answer.status_code == 500 and answer.json() == {"error": "internal error: KeyError: 'boom'"}

    asyncio.run(run())
    transport = httpx.ASGITransport(app=_first(broken))  # raise_app_exceptions: what the server sees

    async def raised():
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            await client.post("/v1/models/m/predict", content=b"{}")

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(raised())
