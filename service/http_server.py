"""What Ray Serve's HTTP servers run with in our processes, installed before Serve starts them: request heads bounded
while they arrive (431, or 413 for `Expect: 100-continue`), one send per response, a listening socket a restarted
replica can bind again at once; in Serve's proxy a refusal of every request when the ingress listens itself (direct
ingress); in that ingress replica, a request cancelled when its client goes away and, with `mha-serving serve`, the
inference routes sent straight to the application, or answered at once, from the connection's own callbacks, when
their body is in and the application can (a lone request on a co-located model). No torch.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import uvicorn.config
from starlette.middleware import Middleware
from starlette.responses import Response
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from service.asgi import HEAD_CHECKED, match_inference, too_large
from service.config import RequestLimits
from service.errors import HeadersTooLargeError, NotServedHereError, ServiceError
from service.responses import error_response, raw_error_response

# An inference request whose head is in waits this long for the rest of its body before its ASGI task starts: a
# client that sends head and body apart (httpx, tritonclient) is still answered at once (_answer_now).
HOLD_S = 0.05
LINGER_S = 2.0  # after a refusal, the rest of the request is read and dropped this long, so the client sees the answer
PROTOCOL = "service.http_server:LimitedHttpProtocol"
PROXY_CALLBACK = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "service.http_server:proxy_callback"}
API_PORT = "MHA_SERVING_API_PORT"  # set by the launcher with direct ingress: Serve's proxy then refuses every request
# Serve's documented per-request switch: it then awaits the app in the connection's own task instead of starting two
# more per request (the app's and a watcher reading `receive` until the client disconnects); the protocol below
# cancels that task itself when the connection is lost.
NO_SERVE_DISCONNECT_WATCH = (b"x-request-disconnect-disabled", b"?1")
# Set by the launcher (before Ray starts) for `mha-serving serve` with direct ingress and no access log: the ingress
# replica's server sends the inference routes straight to the application, past Serve's request wrapper.
FAST_PATH = "MHA_SERVING_FAST_PATH"
DIRECT_INGRESS = "RAY_SERVE_ENABLE_DIRECT_INGRESS"  # Serve's switch, set by the launcher: the ingress replica listens


class CoalescedWrites:
    """A connection's transport, except that what is written within one event-loop turn goes out in one send:
    uvicorn writes a response's head and its body separately, two send syscalls on the loopback where one does.
    Flushed when the response is complete (LimitedHttpProtocol.on_response_complete), before a close or an EOF, and
    at the end of the loop turn otherwise (a streamed body)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport, self._loop = transport, loop
        self._pending: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)

    def write_now(self, data: bytes) -> None:
        """`data` sent at once (with anything pending before it): a whole response, nothing to wait for."""
        self._pending.append(data)
        self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request while its head arrives: a head (request line and headers)
    over `limits.max_header_bytes` or with more than `limits.max_headers` headers (431; nothing past the limit is
    kept), or an `Expect: 100-continue` for a body over `limits.max_body_bytes` (413, before any `100 Continue`)."""

    limits = RequestLimits()
    watch_disconnects = False  # in the ingress replica (direct ingress): cancel a request whose client went away
    fast_app = None  # with watch_disconnects: the ASGI app the inference routes go to directly; None: all via Serve
    # With fast_app: (method, path, headers, body) -> the response of an inference request answered at once, or None
    # when it cannot be (Ingress.answer_now); None: every request goes through the ASGI app.
    direct: Callable[[str, str, list[tuple[bytes, bytes]], bytes], Response | None] | None = None
    in_progress = 0  # requests of this process's connections whose head is in and whose response is not complete
    counts_arrivals = False  # set by `install`: this process is a direct-ingress replica, its server sees every request

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False  # a request head has begun and is not complete yet
        self._head_bytes = 0  # its bytes as parsed (request target, headers)
        self._arrived = 0  # bytes of the data received while it was incomplete
        self._refusal: ServiceError | None = None
        self._task: asyncio.Task | None = None  # the task running this connection's current request
        self._counted = 0  # this connection's requests counted in `in_progress` (more when pipelined)
        self._completing_head = False  # inside uvicorn's on_headers_complete, which starts the request's task
        self._held: tuple[RequestResponseCycle, object] | None = None  # a request whose task waits for its body
        self._hold_timer: asyncio.TimerHandle | None = None  # when a held request's body is left to the ASGI path
        if self.watch_disconnects:
            self.app = self._in_task(self.app)

    def _in_task(self, app):
        """`app`, noting the task that runs each request (uvicorn starts one per request); with `fast_app`, an
        inference request goes to it instead, skipping Serve's wrapper of each request (its request id, context,
        per-request metrics and ongoing-request count: the ingress keeps its own count, metrics and drain)."""

        async def noted(scope, receive, send) -> None:
            self._task = asyncio.current_task()
            fast = self.fast_app
            if fast is not None and match_inference(scope["method"], scope["path"]) is not None:
                await fast(scope, receive, send)
            else:
                await app(scope, receive, send)

        return noted

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescedWrites(transport, self.loop)  # type: ignore[assignment]

    def on_response_complete(self) -> None:
        self._uncount(1)
        self.transport.flush()
        super().on_response_complete()

    def _uncount(self, n: int) -> None:
        n = min(n, self._counted)
        self._counted -= n
        LimitedHttpProtocol.in_progress -= n

    def connection_lost(self, exc: Exception | None) -> None:
        """The client went away: a request still unanswered is cancelled (its batch slot freed, counted as 499)."""
        self._unhold()  # a request held for its body never started: nothing to cancel
        self._uncount(self._counted)
        cycle, task = self.cycle, self._task
        super().connection_lost(exc)
        if task is not None and cycle is not None and not cycle.response_complete and not task.done():
            task.cancel()

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # the rest of a refused request: dropped
        super().data_received(data)  # an error raised by a callback below ends up in send_400_response
        if self._held is not None and self._hold_timer is None:  # its body is still arriving (a second send, say)
            self._hold_timer = self.loop.call_later(HOLD_S, self._release)
        if self._in_head and self._refusal is None:
            self._arrived += len(data)
            if self._arrived > self.limits.max_header_bytes:
                self._refusal = self._head_too_large()
                self._refuse()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._arrived = True, 0, 0

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_header_bytes:
            self._stop(self._head_too_large())
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        limits = self.limits
        if len(self.headers) >= limits.max_headers:
            self._stop(HeadersTooLargeError(f"more than {limits.max_headers} request headers"))
        self._head_bytes += len(name) + len(value) + 4  # "name: value\r\n"
        if self._head_bytes > limits.max_header_bytes:
            self._stop(self._head_too_large())
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        length = dict(self.headers).get(b"content-length", b"") if self.expect_100_continue else b""
        if length.isdigit() and int(length) > self.limits.max_body_bytes:
            self._stop(too_large(int(length), self.limits.max_body_bytes))
        self.scope[HEAD_CHECKED] = True
        if self.watch_disconnects:
            self.headers.append(NO_SERVE_DISCONNECT_WATCH)  # the scope's header list
        self._counted += 1
        LimitedHttpProtocol.in_progress += 1
        self._completing_head = True
        try:
            super().on_headers_complete()
        finally:
            self._completing_head = False

    def _start_asgi_task(self, cycle: RequestResponseCycle, app) -> None:
        """uvicorn starts a request's task once its head is in. An inference request's is held instead, while the
        data received so far is parsed: when its whole body is there, it may be answered at once (`_answer_now`),
        but only after the loop turn that read it, as its task would have run: the event loop reads every
        connection that is ready before it runs what their data started, so a request read in the same turn counts
        as in progress (`in_progress`) when the application decides whether this one is alone. Answered in the
        read's own callback, each of 32 clients' requests found itself alone and ran inline, one after another
        (default model at c=32: 169 against 226 req/s)."""
        if (
            self._completing_head
            and self.direct is not None
            and not cycle.waiting_for_100_continue  # its client waits for the task's `100 Continue`
            and match_inference(*_route(cycle)) is not None
        ):
            self._held = (cycle, app)
        else:
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._held is not None and len(self._held[0].body) > HIGH_WATER_LIMIT:
            self._release()  # a large body: read by the ASGI path as it comes, within the body limit

    def on_message_complete(self) -> None:
        super().on_message_complete()
        held = self._unhold()
        if held is None:
            return
        if LimitedHttpProtocol.in_progress > 1:  # not alone: the ASGI path, as at once as uvicorn would start it
            super()._start_asgi_task(*held)
        else:  # once this loop turn's other connections are read: a request among them is in progress too
            self.loop.call_soon(self._answer_or_start, *held)

    def _answer_or_start(self, cycle: RequestResponseCycle, app) -> None:
        if cycle.disconnected or self.transport.is_closing():
            return  # its client left meanwhile (connection_lost counted it out)
        if not self._answer_now(cycle):
            super()._start_asgi_task(cycle, app)

    def _unhold(self) -> tuple[RequestResponseCycle, object] | None:
        held, self._held = self._held, None
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        return held

    def _release(self) -> None:
        """The held request's task starts: its body is left to the ASGI path, which reads it with its limits."""
        held = self._unhold()
        if held is not None and not self.transport.is_closing():
            super()._start_asgi_task(*held)

    def _answer_now(self, cycle: RequestResponseCycle) -> bool:
        """Answer a held request whose body is complete without a task or the ASGI app, if the application can
        (`direct`); as uvicorn would have: its default headers, `connection: close` unless kept alive, then the
        connection's bookkeeping of a completed response. False: it takes the ASGI path."""
        if len(cycle.body) > self.limits.max_body_bytes:
            return False  # the ASGI path answers 413
        response = self.direct(*_route(cycle), cycle.scope["headers"], bytes(cycle.body))
        if response is None:
            return False
        head = [STATUS_LINE[response.status_code]]
        for name, value in (*cycle.default_headers, *response.raw_headers):
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n" if cycle.keep_alive else b"connection: close\r\n\r\n")
        self.transport.write_now(b"".join(head) + response.body)
        cycle.response_started = cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()
        return True

    def _head_too_large(self) -> HeadersTooLargeError:
        return HeadersTooLargeError(f"request headers are over the limit of {self.limits.max_header_bytes} bytes")

    def _stop(self, refusal: ServiceError) -> None:
        """Stop the parser (inside its callback); uvicorn then calls send_400_response, which answers `refusal`."""
        self._refusal = refusal
        raise refusal

    def send_400_response(self, msg: str) -> None:
        if self._refusal is None:
            return super().send_400_response(msg)
        self._refuse()

    def _refuse(self) -> None:
        """Answer the refusal, then read and drop what the client still sends for LINGER_S before closing."""
        self.transport.write(raw_error_response(self._refusal))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def _route(cycle: RequestResponseCycle) -> tuple[str, str]:
    return cycle.scope["method"], cycle.scope["path"]


class _ReusableAddressSockets:
    """The `socket` module as Ray's http_util sees it, except that its sockets reuse their address."""

    def __getattr__(self, name: str):
        return getattr(socket, name)

    @staticmethod
    def socket(*args, **kwargs) -> socket.socket:
        sock = socket.socket(*args, **kwargs)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock


def install(limits: RequestLimits, watch_disconnects: bool = False, fast_app=None, direct=None) -> None:
    """From now on, HTTP servers that Serve starts in this process use LimitedHttpProtocol with `limits`, on a
    listening socket with SO_REUSEADDR: Ray 2.60 binds without it, so after a crash the connections' TIME_WAIT
    keep a restarted replica off its port (Serve then blocks that port for good). `watch_disconnects`: the protocol,
    not Serve, cancels a request whose client went away (the ingress replica's own server: two tasks per request
    fewer; py-spy, small model at c=32: Serve's wrapper went from 11 % to 7 % of the ingress's CPU). `fast_app`
    (with watch_disconnects): the application the inference routes go to directly (LimitedHttpProtocol._in_task);
    `direct` (with fast_app): what answers an inference request at once when it can (LimitedHttpProtocol.direct)."""
    from ray.serve._private import http_util

    LimitedHttpProtocol.limits = limits
    LimitedHttpProtocol.watch_disconnects = watch_disconnects
    LimitedHttpProtocol.fast_app = fast_app if watch_disconnects else None
    LimitedHttpProtocol.direct = direct if LimitedHttpProtocol.fast_app is not None else None
    LimitedHttpProtocol.counts_arrivals = watch_disconnects and os.environ.get(DIRECT_INGRESS) == "1"
    uvicorn.config.HTTP_PROTOCOLS["auto"] = PROTOCOL  # what uvicorn.Config(http="auto"), Serve's choice, loads
    http_util.socket = _ReusableAddressSockets()


def requests_in_progress() -> int | None:
    """Requests this process's own HTTP server has begun (head read) and not answered yet, every connection's, as
    soon as their bytes were read; None unless this process is a direct-ingress replica serving HTTP itself (then
    a request arriving through Ray is not seen until its handler runs)."""
    return LimitedHttpProtocol.in_progress if LimitedHttpProtocol.counts_arrivals else None


def installed() -> bool:
    return uvicorn.config.HTTP_PROTOCOLS["auto"] == PROTOCOL


class ClosedProxy:
    """Serve's proxy when the ingress replica listens itself (direct ingress): every request gets a JSON 404 naming
    the API's port, so the proxy's own port (Serve needs one) is no second way in."""

    def __init__(self, app, api_port: str) -> None:
        self.api_port = api_port

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = NotServedHereError(f"nothing is served on this port; the API is on port {self.api_port}")
            await error_response(error)(scope, receive, send)


def proxy_callback() -> list:
    """RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: Serve calls it before starting an HTTP server, in its proxy and in
    a direct-ingress replica. The proxy serves every application, so it keeps the default limits; with direct
    ingress (API_PORT set), it refuses every request."""
    if installed():  # the ingress replica's own server: the application's limits are in place
        return []
    install(RequestLimits())
    api_port = os.environ.get(API_PORT)
    return [Middleware(ClosedProxy, api_port=api_port)] if api_port else []


def proxy_env(api_port: int | None) -> dict[str, str]:
    """The environment (set before Ray starts) that makes Serve's proxy call `proxy_callback`; `api_port`: the port
    the ingress replica listens on itself, with direct ingress."""
    env = dict(PROXY_CALLBACK)
    if api_port is not None:
        env[API_PORT] = str(api_port)
    return env
