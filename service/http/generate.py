"""The HTTP generation handlers: OpenAI's completions and models under /openai/v1, and the Open Inference Protocol's
generate and generate_stream. Each decodes its body into GenerateRequests (OpenAI's: one per choice), takes the data
plane's token events (`DataPlane.generate`, the one entry) and encodes them: one JSON answer, or server-sent events.
The first event is awaited before the answer starts, so that a refusal (400, 404, 503) is an HTTP status. Time counts
from the request's arrival (ARRIVED). No torch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from service import openapi
from service.chat_template import ChatTemplates
from service.dataplane import DataPlane, Endpoint
from service.errors import ModelNotFoundError
from service.generate import GenerateRequest, TokenEvent
from service.http.inference import json_body
from service.http.uvicorn_adapter import ABORT, ARRIVED
from service.protocol import chat, openai
from service.protocol import generate as oip
from service.responses import error_body, json_response

logger = logging.getLogger(__name__)
COMPLETIONS = Endpoint("openai_completions")
CHAT_COMPLETIONS = Endpoint("openai_chat_completions")
GENERATE = Endpoint("v2_generate")
GENERATE_STREAM = Endpoint("v2_generate_stream")
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


class Stalled(Exception):
    """The client took none of the stream for send_timeout_s."""


class EventStream(StreamingResponse):
    """Server-sent events over the token events; the events are closed however the answer ends (a client gone
    included), so the sequence leaves the batch and its admission ends. The first event is sent on its own, ahead of
    the ones already made behind it (time to first token as the client sees it). A client that takes none of the
    stream for `send_timeout_s` (uvicorn's write waits once its buffer is full) is treated as gone: once the events
    are closed, the connection is aborted where the server offers it (ABORT: a graceful close would wait for the
    client to read what is buffered), else (Serve's proxy) the answer ends unfinished, which closes the connection."""

    def __init__(self, body: AsyncIterator[bytes], events: AsyncIterator[TokenEvent], send_timeout_s: float) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._send_timeout_s = events, send_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        first = True

        async def bounded(message) -> None:
            nonlocal first
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise Stalled from None
            if first and message["type"] == "http.response.body":
                first = False
                await asyncio.sleep(0)  # the loop turn ends, and the server's writes with it: the first event leaves

        stalled = False
        try:
            await super().__call__(scope, receive, bounded)
        except Stalled:
            stalled = True
        finally:
            await self._events.aclose()
        if stalled:
            logger.info("a stream's client took none of it for %g s: ended", self._send_timeout_s)
            if (abort := scope.get(ABORT)) is not None:
                abort()


def arrival(request: Request) -> float:
    """perf_counter() when the request's head began to arrive, as the ingress's own server notes it; through Serve's
    proxy, which does not, now (a handler's start)."""
    return request.scope.get(ARRIVED) or time.perf_counter()


Events = AsyncIterator[tuple[int, TokenEvent]]  # each choice's events with its index (DataPlane.generate)


async def opened(
    plane: DataPlane,
    endpoint: Endpoint,
    name: str,
    build: Callable[[str], GenerateRequest | list[GenerateRequest]],
    arrived: float,
) -> tuple[tuple[int, TokenEvent], Events]:
    """The request's first event (admitted, queued, a prefill run) and the rest; raises what refused it. `build`
    makes the request, or its choices, for the model it goes to (the data plane calls it once admitted), timed from
    `arrived`."""

    def stamped(model: str) -> GenerateRequest | list[GenerateRequest]:
        built = build(model)
        if isinstance(built, GenerateRequest):
            return dataclasses.replace(built, arrived=arrived)
        return [dataclasses.replace(r, arrived=arrived) for r in built]

    events = plane.generate(endpoint, name, stamped)
    try:
        return await anext(events), events
    except BaseException:
        await events.aclose()
        raise


async def _all(
    first: tuple[int, TokenEvent], events: Events, take: Callable[[int, TokenEvent], object] | None = None
) -> tuple[dict[int, str], dict[int, TokenEvent]]:
    """Each choice's whole text and last event, by index; `take` sees every event."""
    texts: dict[int, list[str]] = {}
    lasts: dict[int, TokenEvent] = {}
    async for index, event in _each(first, events):
        if take is not None:
            take(index, event)
        texts.setdefault(index, []).append(event.text)
        lasts[index] = event
    return {index: "".join(parts) for index, parts in texts.items()}, lasts


async def _each(first: tuple[int, TokenEvent], events: Events) -> Events:
    yield first
    async for pair in events:
        yield pair


async def _encoded(
    first: tuple[int, TokenEvent],
    events: Events,
    encode: Callable[[int, TokenEvent], list[bytes]],
    end: Callable[[], list[bytes]],
    openai_errors: bool = False,
) -> AsyncIterator[bytes]:
    """Each event's SSE lines, then `end`'s; an error after the answer started is an event with the error's body (as
    the one mapping renders it), then `end`'s."""
    try:
        async for index, event in _each(first, events):
            for line in encode(index, event):
                yield line
    except Exception as exc:  # the status is sent already: the client reads an error event
        yield sse(error_body(str(exc), getattr(exc, "status", 500), openai_errors))
    for line in end():
        yield line


async def completions(plane: DataPlane, request: Request) -> Response:
    """POST /openai/v1/completions: a completion (a choice per prompt and `n`), or with `stream` its chunks as
    server-sent events."""
    arrived = arrival(request)
    body = await json_body(request, plane, openai.CompletionRequest)
    first, events = await opened(plane, COMPLETIONS, body.model, lambda _: openai.to_requests(body), arrived)
    return await _answered(plane, body, openai.Completion.of(body), first, events)


async def chat_completions(plane: DataPlane, templates: ChatTemplates, request: Request) -> Response:
    """POST /openai/v1/chat/completions: the messages rendered by the model's chat template, then as a completion
    of that prompt, answered in the chat format."""
    arrived = arrival(request)
    body = await json_body(request, plane, chat.ChatCompletionRequest)

    def build(model: str) -> list[GenerateRequest]:
        return chat.to_requests(body, templates.render(model, chat.messages(body)))

    first, events = await opened(plane, CHAT_COMPLETIONS, body.model, build, arrived)
    return await _answered(plane, body, chat.ChatCompletion.of(body), first, events)


async def _answered(
    plane: DataPlane,
    body: openai.CompletionRequest | chat.ChatCompletionRequest,
    completion: openai.Completion,
    first: tuple[int, TokenEvent],
    events: Events,
) -> Response:
    """The whole completion, or its chunks as server-sent events (the usage last, when asked)."""
    if not body.stream:
        texts, lasts = await _all(first, events, completion.take)
        return json_response(completion.whole(texts, lasts))
    with_usage = body.stream_options is not None and body.stream_options.include_usage

    def end() -> list[bytes]:
        return [sse(completion.usage_chunk()), DONE] if with_usage else [DONE]

    encoded = _encoded(first, events, lambda i, e: [sse(completion.chunk(i, e))], end, openai_errors=True)
    return EventStream(encoded, events, plane.limits.send_timeout_s)


async def models(plane: DataPlane) -> Response:
    """GET /openai/v1/models: the decoders."""
    return json_response(openai.model_list((await plane.listing()).statuses))


async def model(plane: DataPlane, name: str) -> Response:
    """GET /openai/v1/models/{name}: one decoder; 404 in OpenAI's shape for anything else."""
    for status in (await plane.listing()).statuses:
        if status.name == name and (entry := openai.model_entry(status)) is not None:
            return json_response(entry)
    raise ModelNotFoundError(f"no decoder {name!r} is served: GET /openai/v1/models lists them")


async def generate(plane: DataPlane, request: Request, name: str) -> Response:
    """POST /v2/models/{name}/generate: the whole text and its finish reason."""
    arrived = arrival(request)
    body = await json_body(request, plane, oip.GenerateBody)
    first, events = await opened(plane, GENERATE, name, lambda _: oip.to_request(body), arrived)
    logprobs: list = []
    texts, lasts = await _all(first, events, lambda _, event: logprobs.extend(event.logprobs))
    return json_response(oip.answer(name, body, texts[0], lasts[0], logprobs))


async def generate_stream(plane: DataPlane, request: Request, name: str) -> Response:
    """POST /v2/models/{name}/generate_stream: an event per text delta, the last with `details`."""
    arrived = arrival(request)
    body = await json_body(request, plane, oip.GenerateBody)
    first, events = await opened(plane, GENERATE_STREAM, name, lambda _: oip.to_request(body), arrived)
    encoded = _encoded(first, events, lambda _, e: [sse(oip.answer(name, body, e.text, e))], lambda: [])
    return EventStream(encoded, events, plane.limits.send_timeout_s)


def add_routes(app: FastAPI, plane: DataPlane) -> None:
    """Token generation (decoders): OpenAI's completions under /openai/v1, the Open Inference Protocol's generate."""
    errors = (404, 503, *openapi.WITH_BODY)

    @app.post(
        "/openai/v1/completions",
        openapi_extra=openapi.request_body(openai.CompletionRequest),
        responses=openapi.responses(openai.CompletionResponse, *errors, event_stream=True, openai=True),
    )
    async def openai_completions(request: Request) -> Response:
        """OpenAI's completions: a decoder's text for a prompt (text or token ids); `stream: true` for
        server-sent events."""
        return await completions(plane, request)

    templates = ChatTemplates(plane.models_dir)

    @app.post(
        "/openai/v1/chat/completions",
        openapi_extra=openapi.request_body(chat.ChatCompletionRequest),
        responses=openapi.responses(chat.ChatCompletionResponse, *errors, event_stream=True, openai=True),
    )
    async def openai_chat_completions(request: Request) -> Response:
        """OpenAI's chat completions: the messages rendered by the decoder's chat template (its folder's
        tokenizer_config.json); `stream: true` for server-sent events."""
        return await chat_completions(plane, templates, request)

    @app.get("/openai/v1/models", responses=openapi.responses(openai.ModelList, openai=True))
    async def openai_models() -> Response:
        """The decoders, in OpenAI's list format."""
        return await models(plane)

    @app.get(
        "/openai/v1/models/{name}",
        responses=openapi.responses(openai.Model, 404, openai=True),
    )
    async def openai_model(name: str) -> Response:
        """One decoder, in OpenAI's model format."""
        return await model(plane, name)

    @app.post(
        "/v2/models/{name}/generate",
        openapi_extra=openapi.request_body(oip.GenerateBody),
        responses=openapi.responses(oip.GenerateResponse, *errors),
    )
    async def v2_generate(name: str, request: Request) -> Response:
        """The Open Inference Protocol's generate extension: the whole text."""
        return await generate(plane, request, name)

    @app.post(
        "/v2/models/{name}/generate_stream",
        openapi_extra=openapi.request_body(oip.GenerateBody),
        responses=openapi.responses(oip.GenerateResponse, *errors, event_stream=True),
    )
    async def v2_generate_stream(name: str, request: Request) -> Response:
        """The generate extension's stream: server-sent events, one per text delta, `details` on the last."""
        return await generate_stream(plane, request, name)
