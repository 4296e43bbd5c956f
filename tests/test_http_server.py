"""The ingress's HTTP protocol pieces that need no server: a response's writes coalesced into one send, and nothing
written is lost on close or EOF. The server itself runs in tests/test_reliability.py (direct ingress) and behind
Serve's proxy in every API test."""

from __future__ import annotations

import asyncio

from service.http_server import CoalescedWrites


class RecordingTransport(asyncio.Transport):
    """The socket's side of a transport: each `write` is one send."""

    def __init__(self) -> None:
        super().__init__()
        self.sends: list[bytes] = []
        self.closed = self.eof = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.sends.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def write_eof(self) -> None:
        self.eof = True


def test_a_head_and_body_written_in_one_loop_turn_leave_in_one_send():
    async def respond() -> list[bytes]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop())
        writes.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
        writes.write(b"{}")
        assert sent.sends == []  # held until the turn ends (or the response completes: flush)
        await asyncio.sleep(0)
        writes.write(b"next")  # a later turn: its own send
        await asyncio.sleep(0)
        return sent.sends

    assert asyncio.run(respond()) == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}", b"next"]


def test_close_and_eof_send_what_is_pending_first_and_a_closed_transport_gets_nothing():
    async def refuse() -> RecordingTransport:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop())
        writes.write(b"HTTP/1.1 413 ")
        writes.write_eof()
        assert sent.sends == [b"HTTP/1.1 413 "] and sent.eof
        writes.write(b"late")
        writes.close()
        writes.write(b"after close")
        await asyncio.sleep(0)  # the scheduled flush finds the transport closing: dropped, never raised
        return sent

    sent = asyncio.run(refuse())
    assert sent.sends == [b"HTTP/1.1 413 ", b"late"] and sent.closed


def test_a_flush_with_nothing_pending_sends_nothing():
    async def idle() -> list[bytes]:
        sent = RecordingTransport()
        writes = CoalescedWrites(sent, asyncio.get_running_loop())
        writes.flush()
        writes.write(b"x")
        writes.flush()  # what LimitedHttpProtocol.on_response_complete does
        await asyncio.sleep(0)  # the turn's scheduled flush: nothing left
        return sent.sends

    assert asyncio.run(idle()) == [b"x"]
