"""The one adapter to uvicorn's internals, for the ingress's own server: its httptools protocol holding the head
limits while a head arrives (a pipelined one from its own first byte, refused after the answers before it) and the
connection cap at accept (no public uvicorn option bounds a head's size or time, and its `limit_concurrency` counts
only complete heads), counting requests in progress from their head (Load) and open connections, writing each
response in one send, noting when each request began to arrive and offering its application an abort (scope keys
ARRIVED and ABORT), and cancelling a request whose client went away; and a server that leaves the process's signals
to Ray. uvicorn and httptools are pinned to the tested range (pyproject.toml);
tests/test_head_limits.py and tests/test_slow_heads.py fail when a hook stops engaging. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Iterator

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service import limits as check
from service.config import RequestLimits
from service.errors import BadRequestError, HeadTimeoutError, ServiceError
from service.http.coalesced_writes import LINGER_S, CoalescedWrites
from service.http.connection_metrics import ConnectionMetrics
from service.load import Load
from service.responses import is_openai, raw_error_response

HEAD_CHECKED = "mha.head_checked"  # scope key: the head was held to the limits as it arrived
# scope key: time.perf_counter() when the request's first byte was parsed; time to first token and latency count from
# it (reading, parsing and queueing included), not from when a handler got the request
ARRIVED = "mha.arrived"
# scope key: a callable that ends the connection at once, dropping what is buffered, for an answer whose client reads
# nothing (a graceful close would wait for that client to read it all); uvicorn takes the answer as the client's going
ABORT = "mha.abort"
# After a 408 for a slow head or a 503 over the connection cap: no large body is on its way, and the descriptor must
# be free again soon (a slow head's connection is closed within header_timeout_s + 1 s).
SHORT_LINGER_S = 0.5
# While the server stops, a kept-alive connection is closed once it has been idle this long: its client may be
# sending its next request at this very moment (it is then answered with `Connection: close`); a client that sends
# back to back does so within milliseconds of its answer, so a close after this much silence cuts nothing sent.
STOP_IDLE_S = 0.5


def protocol(limits: RequestLimits, metrics: ConnectionMetrics, load: Load) -> functools.partial:
    """What `uvicorn.Config(http=...)` takes: the protocol class, bound to `limits`, counting into `metrics` and
    `load`."""
    return functools.partial(HeadLimitedProtocol, limits=limits, metrics=metrics, load=load)


class SignalFreeServer(uvicorn.Server):
    """uvicorn's server, except that it leaves signals alone: a replica's signals are Ray's."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request while its head arrives: a head (request line and headers)
    over `limits.max_header_bytes` or with more than `limits.max_headers` headers (431; nothing past the limit is
    kept), an `Expect: 100-continue` for a body over `limits.max_body_bytes` (413, before any `100 Continue`), or a
    head not complete within `limits.header_timeout_s` (408; silence is closed without an answer). A connection
    over `limits.max_connections` gets a 503 with Retry-After as soon as it is accepted."""

    def __init__(self, *args, limits: RequestLimits, metrics: ConnectionMetrics, load: Load, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.metrics, self.load = limits, metrics, load
        self._requests = 0  # this connection's requests counted in load.arrived (pipelined ones too), not answered
        self._head_timer: asyncio.TimerHandle | None = None  # armed while a head is awaited or arriving
        self._in_head = False  # a request head has begun and is not complete yet
        self._head_bytes = 0  # its bytes as parsed (request target, headers)
        self._arrived = 0  # bytes received while it was incomplete
        self._in_message = False  # the parser is inside a request (head or body)
        self._begun = 0  # requests begun within the read being parsed
        self._refusal: ServiceError | None = None
        self._deferred_linger: float | None = None  # a refusal waiting for the answers before it (pipelining)
        self._task: asyncio.Task | None = None  # the task running this connection's current request
        self._stopping = False  # the server stops: the next request is answered with `Connection: close`
        self._last_active = self.loop.time()  # when a byte last arrived or an answer was last completed
        self.app = self._noting_task(self.app)

    def _noting_task(self, app):
        async def noted(scope, receive, send) -> None:
            self._task = asyncio.current_task()
            await app(scope, receive, send)

        return noted

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = CoalescedWrites(transport, self.loop, lambda: self._in_message)  # type: ignore[assignment]
        self.metrics.open += 1
        # uvicorn's limit_concurrency is checked once a head is complete: slow heads never meet it, and it would
        # refuse the next request of a connection already open. The cap is held here, at accept.
        try:
            check.check_connections(self.metrics.open, self.limits)
        except ServiceError as refusal:
            self.metrics.refused += 1
            self._refusal = refusal
            self._refuse(SHORT_LINGER_S)
            return
        self._arm_head_timer()  # a connection that sends nothing is closed too

    def on_response_complete(self) -> None:
        self.transport.flush()
        self._last_active = self.loop.time()
        if self._requests > 0:
            self._requests -= 1
            self.load.arrived -= 1
        super().on_response_complete()
        if self._stopping:
            self._close_when_idle()
        if self._deferred_linger is not None and not self.transport.is_closing() and not self._answering():
            self._refuse(self._deferred_linger)

    def connection_lost(self, exc: Exception | None) -> None:
        """The client went away: a request still unanswered is cancelled (its batch slot freed, counted as 499)."""
        cycle, task = self.cycle, self._task
        self._disarm_head_timer()
        self.metrics.open -= 1
        self.load.arrived -= self._requests  # unanswered: no longer in progress
        self._requests = 0
        super().connection_lost(exc)
        if task is not None and cycle is not None and not cycle.response_complete and not task.done():
            task.cancel()

    def data_received(self, data: bytes) -> None:
        self._last_active = self.loop.time()
        if self._refusal is not None or self.transport.lingering:
            return  # the rest of a refused request: dropped
        continued, idle = self._in_head, not self._in_message
        self._begun = 0
        super().data_received(data)  # an error raised by a callback below ends up in send_400_response
        # The read is all the head's when it continues a head begun before it, or begins the only request in it on a
        # connection between requests. With pipelining it may also hold an earlier request's end, not the head's:
        # that head's bytes then count from its next read on (its complete header lines, as parsed, from the first).
        whole = (continued and not self._begun) or (idle and self._begun == 1)
        if self._in_head and self._refusal is None and whole:
            self._arrived += len(data)
            try:
                check.check_head_bytes(self._arrived, self.limits)
            except ServiceError as refusal:
                self._refusal = refusal
                self._refuse()
        # Armed after the parser has run, so a whole request in one read costs no timer. uvicorn stops its
        # keep-alive timer on any byte, even a bare CRLF that begins no request: the head's timer covers that too.
        if self._head_timer is None and self._refusal is None and (self._in_head or self._between_requests()):
            self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[ARRIVED] = time.perf_counter()  # type: ignore[typeddict-unknown-key]
        self._in_head, self._head_bytes, self._arrived = True, 0, 0
        self._in_message = True
        self._begun += 1

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        self._held(check.check_head_bytes, self._head_bytes)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._held(check.check_header_count, len(self.headers) + 1)
        self._head_bytes += len(name) + len(value) + check.HEAD_LINE_BYTES
        self._held(check.check_head_bytes, self._head_bytes)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        if self.expect_100_continue:  # refused before any `100 Continue`
            self._held(check.check_announced_body, dict(self.headers).get(b"content-length"))
        self.scope[HEAD_CHECKED] = True  # type: ignore[typeddict-unknown-key]
        cycle = self.cycle
        super().on_headers_complete()
        if self.cycle is not cycle:  # a request began (now, or queued behind a pipelined one)
            self.scope[ABORT] = functools.partial(self._abort, self.cycle)  # type: ignore[typeddict-unknown-key]
            self._requests += 1
            self.load.arrived += 1
            if self._stopping:
                self.cycle.keep_alive = False  # answered with `Connection: close`, then the connection closes

    def _held(self, limit_check, value) -> None:
        """Run one limit check inside a parser callback; a refusal stops the parser, and uvicorn then calls
        send_400_response, which answers it."""
        try:
            limit_check(value, self.limits)
        except ServiceError as refusal:
            self._refusal = refusal
            raise

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes its parser refuses (not HTTP/1.1, a malformed head or chunk): JSON, as every
        other error, instead of its plain-text 400."""
        if self._refusal is None:  # no large body is known to be on its way
            self._refusal = BadRequestError(f"{msg.rstrip('.')}: the bytes sent are not a valid HTTP/1.1 request")
            return self._refuse(SHORT_LINGER_S)
        self._refuse()

    def _refuse(self, linger_s: float = LINGER_S) -> None:
        """Answer the refusal, then read and drop what the client still sends for `linger_s` before closing (sooner
        if the client closes first). Behind requests of this connection still unanswered (pipelined), once their
        answers are out: answers keep their requests' order."""
        self._disarm_head_timer()
        if self._answering():
            self._deferred_linger = linger_s  # on_response_complete refuses once the last of those answers is out
            return
        self._deferred_linger = None
        target = getattr(self, "url", b"")  # the request target as far as it arrived (none before a request began)
        self.transport.write(raw_error_response(self._refusal, is_openai(target.decode("latin-1"))))
        if self.transport.can_write_eof():
            self.transport.linger(linger_s)
        else:
            self.transport.close()

    def _abort(self, cycle) -> None:
        """ABORT for `cycle`'s application: its answer ends unfinished and the connection is closed at once."""
        cycle.disconnected = True  # as when the client goes: no "returned without completing response" error
        self.transport.abort()

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown, for each open connection once the listener is closed. uvicorn's own closes an
        idle kept-alive connection at once, which resets the request its client may be sending on it right then.
        Here a request whose answer has not begun gets `Connection: close` and the connection closes after it; a
        connection between requests is closed once idle for STOP_IDLE_S, and a request that arrives before that is
        answered with `Connection: close` too."""
        self._stopping = True
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.response_started:
            cycle.keep_alive = False
        elif not self._answering():
            self._close_when_idle()

    def _close_when_idle(self) -> None:
        """Close the connection once no request is in progress or arriving and it has been silent STOP_IDLE_S."""
        if self.transport.is_closing() or self._answering() or self._in_message:
            return  # the request in progress is answered with `Connection: close`, or ends here
        silent = self.loop.time() - self._last_active
        if silent >= STOP_IDLE_S:
            self.transport.close()
        else:
            self.loop.call_later(STOP_IDLE_S - silent, self._close_when_idle)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _answering(self) -> bool:
        """Whether a request of this connection is unanswered: in progress, or queued behind one (pipelined)."""
        return bool(self.pipeline) or not self._between_requests()

    def _arm_head_timer(self) -> None:
        if not self.transport.is_closing():
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        """No complete head within header_timeout_s of the connection's start, or of the first byte after the last
        response: a 408 for a head begun (pipelined behind a request still unanswered: after its answer), a plain
        close for silence."""
        self._head_timer = None
        self.metrics.header_timeouts += 1
        if self._in_head:
            self._refusal = HeadTimeoutError(self.limits.header_timeout_s, self._arrived)
            self._refuse(SHORT_LINGER_S)
        else:
            self.transport.close()
