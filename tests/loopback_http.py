"""A real HTTP server on loopback for the tests of a client: http.server, a thread per connection, with the test's
own request handler."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler], **settings: object) -> Iterator[int]:
    """`handler` answering on a free loopback port (yielded) until the block ends; each of `settings` is set on the
    server, where a handler reads it (`self.server.NAME`)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    for name, value in settings.items():
        setattr(httpd, name, value)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1]
    finally:
        httpd.shutdown()
        httpd.server_close()
