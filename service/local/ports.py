"""Where a local server listens: the API on --host, and every port Ray and Serve open on loopback unless --host
asks for more; free-port checks on the address each port really uses. No torch.
"""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path

LOOPBACK = "127.0.0.1"
EVERYWHERE = "0.0.0.0"


class PortError(RuntimeError):
    """A port the server needs is taken or cannot be bound on its address (one line for the user)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ray_host(host: str) -> str:
    """The address Ray's own ports (metrics among them) listen on when the API listens on `host`."""
    return LOOPBACK if is_loopback(host) else EVERYWHERE


def check_port(host: str, port: int, what: str, flag: str) -> None:
    """PortError unless `port` can be bound on `host` (on 0.0.0.0: free on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortError(
                f"{what} port {port} on {host} is in use or not available ({exc.strerror}); pass {flag}"
            ) from None


# Ports chosen now and bound later by another process (Serve's proxy, a test cluster's Ray) come from here: above
# Ray's worker ports (10002-19999 by default) and below the kernel's ephemeral range, from which every socket bound
# to port 0 and every outgoing connection takes its port. A port from the ephemeral range could be taken meanwhile:
# a Serve replica's gRPC server (bound to port 0) once took the port chosen for a test cluster's proxy.
CHOSEN_PORTS = (20000, 32767)
_chosen: set[int] = set()  # handed out by this process: never twice


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for port 0 and outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = LOOPBACK) -> int:
    """A port that can be bound on `host` now, outside the ephemeral range where it can (see CHOSEN_PORTS)."""
    low, high = CHOSEN_PORTS[0], min(CHOSEN_PORTS[1], ephemeral_ports()[0] - 1)
    for port in random.sample(range(low, high + 1), min(200, max(0, high - low + 1))):
        if port in _chosen:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _chosen.add(port)
        return port
    with socket.socket() as s:  # none free there (or no room below the ephemeral range): the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]
