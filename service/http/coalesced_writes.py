"""A connection's transport for the ingress's own HTTP server: one send per event-loop turn (or per FLUSH_BYTES), a
close that lingers while the request still arrives, so the client reads the answer instead of a reset, and an abort
for a client that reads nothing. No torch.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable

LINGER_S = 2.0  # after a refusal, the rest of the request is read and dropped this long, so the client sees the answer
# Pending bytes past this are written at once, not at the end of the loop turn: the transport then pauses the protocol
# (asyncio's high-water mark is 64 KiB too) and uvicorn's next send waits for the client. Deferred whole, a stream whose
# events were all ready piled up here within one turn (16 MiB for a client that never read).
FLUSH_BYTES = 64 << 10


class CoalescedWrites:
    """A connection's transport, except that what is written within one event-loop turn goes out in one send:
    uvicorn writes a response's head and its body apart, two send syscalls where one does. Flushed when the
    response is complete, before a close or an EOF, once FLUSH_BYTES are pending, and at the end of the loop turn
    otherwise (a streamed body).
    A close while the request is still arriving (`still_reading`: an answer before its body, a 413 or 408) lingers:
    closed over unread bytes, the kernel resets the connection and the client may never read the answer, so the
    answer is sent whole with an EOF, and what still arrives is read and dropped for LINGER_S before the close."""

    def __init__(
        self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, still_reading: Callable[[], bool]
    ) -> None:
        self._transport, self._loop, self._still_reading = transport, loop, still_reading
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self.lingering = False

    def write(self, data: bytes) -> None:
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes > FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending, self._pending_bytes = [], 0
        if not self._transport.is_closing():
            self._transport.write(data)

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def close(self) -> None:
        self.flush()
        if self.lingering:
            return
        if self._still_reading() and self._transport.can_write_eof() and not self._transport.is_closing():
            self.linger(LINGER_S)
        else:
            self._transport.close()

    def linger(self, seconds: float) -> None:
        """Send what is written and an EOF, drop what arrives, close in `seconds` (sooner if the client closes)."""
        self.lingering = True
        self.write_eof()
        self._loop.call_later(seconds, self._transport.close)

    def abort(self) -> None:
        """Close at once, dropping what is pending here, in the transport and in the kernel (a reset): closed
        gracefully, the kernel would keep the socket until a client that reads nothing had read it all."""
        self._pending, self._pending_bytes = [], 0
        if (sock := self._transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # linger 0 s: a reset
        self._transport.abort()

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)
