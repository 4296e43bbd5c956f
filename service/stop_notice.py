"""The local launcher's word to its serving processes that the server stops. Each serving process connects to the
launcher's Unix socket at start (its path in the ingress's user_config); a stop is one line on every connection,
`stop <until>`, read at once by the process's event loop. Serve's own way in, a redeploy of the user_config, reaches
a process in ~1.5 s, a few processes at a time, while readiness must turn 503 in every process at once. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)
SOCKET_NAME = "stop.sock"
SEND_TIMEOUT_S = 0.2  # a process that does not read its notice this soon is left to Serve's redeploy


class StopNotices:
    """The launcher's end: a Unix socket in a private folder, a daemon thread taking each serving process's
    connection, and `send`, which tells every process connected (restarted ones too) when the stop must end."""

    def __init__(self) -> None:
        self._folder = tempfile.mkdtemp(prefix="mha-serving-")  # 0700: only this user's processes reach it
        self.path = os.path.join(self._folder, SOCKET_NAME)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="stop-notices", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._connections.append(connection)

    def send(self, until: float) -> int:
        """`stop <until>` (a time.time()) to every serving process connected; how many took it."""
        line = f"stop {until!r}\n".encode()
        delivered = 0
        with self._lock:
            self._connections = [c for c in self._connections if _open(c)]  # a replaced process's: gone
            for connection in self._connections:
                connection.settimeout(SEND_TIMEOUT_S)
                with contextlib.suppress(OSError):  # a process that ended meanwhile
                    connection.sendall(line)
                    delivered += 1
        return delivered

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for connection in self._connections:
                connection.close()
        shutil.rmtree(self._folder, ignore_errors=True)


def _open(connection: socket.socket) -> bool:
    """Whether the serving process at the other end still holds its connection (it never writes: EOF means gone)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


async def listen(path: str, stop: Callable[[float], Awaitable[object]]) -> None:
    """A serving process's end: connect to the launcher's socket and, on its notice, run `stop(until)`. Returns when
    the launcher goes away without one; a socket that cannot be reached is logged (Serve's redeploy still drains)."""
    try:
        reader, writer = await asyncio.open_unix_connection(path)
    except OSError as exc:
        logger.warning("no stop notices from the launcher (%s: %s); a stop reaches this process later", path, exc)
        return
    try:
        line = await reader.readline()
        words = line.split()
        if len(words) == 2 and words[0] == b"stop":
            await stop(float(words[1]))
    finally:
        writer.close()
