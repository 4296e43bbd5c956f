"""The TCP sockets a process holds, from /proc/PID/fd and /proc/net/tcp{,6}: where each listens or is connected,
and in which state. No torch.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness.processes import descriptors

LISTEN = "0A"  # /proc/net/tcp's st column


@dataclass(frozen=True)
class TcpSocket:
    address: str  # local, e.g. "127.0.0.1" or "::1"
    port: int  # local
    state: str  # /proc/net/tcp's st column, hex: LISTEN for a listening socket
    pid: int  # the process holding it

    @property
    def listening(self) -> bool:
        return self.state == LISTEN


def tcp_sockets(pids: list[int]) -> list[TcpSocket]:
    """Every TCP socket (IPv4 and IPv6) one of `pids` holds open."""
    owner = {}
    for pid in pids:
        try:
            links = descriptors(pid)
        except OSError:  # gone meanwhile
            continue
        owner.update({int(link[8:-1]): pid for link in links if link.startswith("socket:[")})
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            inode = int(fields[9])
            if inode not in owner:
                continue
            address, port = fields[1].split(":")
            raw = bytes.fromhex(address)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # /proc prints 32-bit words
            found.append(TcpSocket(socket.inet_ntop(family, raw), int(port, 16), fields[3], owner[inode]))
    return found
