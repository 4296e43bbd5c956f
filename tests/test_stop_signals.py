"""Every way an operator stops `mha-serving serve` drains it: SIGTERM or SIGINT (Ctrl-C) to its whole process group,
as `kill -- -PGID`, `timeout` and a terminal send them, as well as SIGTERM to its PID alone (tests/test_reliability.py);
and a SIGKILLed launcher takes the server with it. The supervisor's own rules first, over a stand-in server; then the
real one. Real processes and signals, loopback only, bounded; each test prints what it measured."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.harness.processes import signal_all
from benchmarks.harness.server import ServerProcess
from loadtest.http_client import post_bytes

SLOW = "mha-h4-d32"
WINDOW_S = 2.0  # SLOW's batch window: the requests in progress take two (Serve sends SLOW's replica 4 at a time)
DRAIN_S = 8.0  # limits.drain_s's default
IN_FLIGHT = 8


# A stand-in server: says its PID and session, then prints each signal it gets; the Nth SIGTERM (argv[1]; 0: none)
# ends it with status argv[2]. With argv[3], it first starts a grandchild (`sleep`) in its own process group.
STAND_IN = """
import os, signal, subprocess, sys, time
from service.local import supervisor

supervisor.die_with_supervisor()
stops, code = int(sys.argv[1]), int(sys.argv[2])
grandchild = subprocess.Popen(["sleep", "60"]).pid if len(sys.argv) > 3 else 0
seen = []

def on_signal(signum, frame):
    seen.append(signum)
    print(signal.Signals(signum).name, flush=True)
    if signum == signal.SIGTERM and seen.count(signum) == stops:
        sys.exit(code)

signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGHUP, on_signal)
print(os.getpid(), os.getsid(0), grandchild, flush=True)
while True:
    time.sleep(1)
"""


class Supervised:
    """`with Supervised(...) as s:` a supervisor (in a session of its own, as a shell starts a job) over STAND_IN."""

    def __init__(self, stops: int, code: int = 0, grandchild: bool = False, stop_within_s: float = 10) -> None:
        server = [sys.executable, "-c", STAND_IN, str(stops), str(code), *(["grandchild"] if grandchild else [])]
        launcher = "import sys; from service.local.supervisor import supervise; sys.exit(supervise(%r, %r))"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", launcher % (server, stop_within_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.errors = ""
        pid, sid, grandchild_pid = (int(x) for x in self.proc.stdout.readline().split())
        self.server, self.server_session, self.grandchild = pid, sid, grandchild_pid

    def __enter__(self) -> Supervised:
        return self

    def lines(self) -> list[str]:
        """The stand-in's output after its first line, once the supervisor has exited (within 10 s)."""
        out, self.errors = self.proc.communicate(timeout=10)
        return out.split()

    def __exit__(self, *exc) -> None:
        signal_all([self.proc.pid, self.server, *([self.grandchild] if self.grandchild else [])], signal.SIGKILL)
        self.proc.wait(10)


def test_a_sigint_to_the_launchers_group_reaches_the_server_as_one_sigterm_and_its_status_is_the_launchers():
    with Supervised(stops=1, code=0) as s:
        assert s.server_session == s.server != os.getsid(s.proc.pid)  # a session (and process group) of its own
        os.killpg(s.proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's foreground process group
        assert s.lines() == ["SIGTERM"] and s.proc.returncode == 0


def test_a_second_stop_signal_is_forwarded_again_and_sighup_is_passed_on():
    with Supervised(stops=2, code=3) as s:
        for signum in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            os.kill(s.proc.pid, signum)
            time.sleep(0.3)  # the supervisor forwards within POLL_S
        assert s.lines() == ["SIGHUP", "SIGTERM", "SIGTERM"] and s.proc.returncode == 3


def test_stop_signals_past_the_second_are_not_forwarded():
    with Supervised(stops=3, stop_within_s=1.5) as s:  # a stand-in that would end at a third SIGTERM
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGTERM):
            os.kill(s.proc.pid, signum)
            time.sleep(0.2)
        assert s.lines() == ["SIGTERM", "SIGTERM"] and s.proc.returncode == 1  # killed at its stop time


def test_a_server_ended_by_a_signal_is_named_and_the_status_is_128_plus_its_number():
    with Supervised(stops=1) as s:
        os.kill(s.server, signal.SIGKILL)  # not a stop the supervisor sent: an OOM kill, say
        assert s.lines() == [] and s.proc.returncode == 128 + signal.SIGKILL
        assert "the server process ended on SIGKILL" in s.errors


# The server's handler for its first stop signal, then three more signals sent while it is busy elsewhere (as a
# repeating stopper sends them while the drain starts): only the first may interrupt it.
AFTER_THE_FIRST_STOP = """
import os, signal, time
from service.local import drain

drain.stop_signals_interrupt()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
except KeyboardInterrupt:
    print("first: interrupted", flush=True)
for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
    os.kill(os.getpid(), signum)
time.sleep(0.2)
print("later: the drain's wait ends", drain._STOPPED_AGAIN.is_set(), flush=True)
"""


def test_after_the_first_stop_signal_the_next_ones_end_the_drain_and_interrupt_nothing_else():
    """Raised as KeyboardInterrupt, a second SIGTERM before the drain's wait began ended the server with Ray shut down
    under the drain's own Serve calls (1 run in 14 of the SIGHUP-and-stop test in test_launcher.py, on busy cores)."""
    done = subprocess.run([sys.executable, "-c", AFTER_THE_FIRST_STOP], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["first: interrupted", "later: the drain's wait ends True"]


# A server's main module (run with -m, as the launcher runs it) stopped while exec() runs a string, as dataclasses and
# namedtuple do on import, then ending as the server does after its drain.
STOPPED_IN_EXEC = """
import os, signal, threading
from service.local import drain

drain.stop_signals_interrupt()
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
try:
    exec("while True: pass")
except KeyboardInterrupt as stop:
    print(type(stop).__name__, flush=True)
raise SystemExit(0)
"""


def test_a_stop_that_lands_in_code_run_from_a_string_still_ends_the_server_with_status_0(tmp_path):
    """With a plain KeyboardInterrupt, CPython killed such a process with SIGINT at exit (the launcher reported 130
    after a clean drain: CI saw it when the stop landed in the start report's imports)."""
    (tmp_path / "stopped_in_exec.py").write_text(STOPPED_IN_EXEC)
    done = subprocess.run(  # -m finds the module in its working folder
        [sys.executable, "-m", "stopped_in_exec"], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert (done.returncode, done.stdout.split()) == (0, ["StopSignal"]), done.stderr[-2000:]


def test_a_server_still_running_past_its_stop_time_is_killed_with_its_process_group():
    with Supervised(stops=0, grandchild=True, stop_within_s=1) as s:
        start = time.monotonic()
        os.kill(s.proc.pid, signal.SIGTERM)
        assert s.lines() == ["SIGTERM"] and s.proc.returncode == 1
        assert 1 <= time.monotonic() - start < 3
        assert _still_running([s.server, s.grandchild], time.monotonic() + 2) == []


def test_a_server_ends_with_its_sigkilled_supervisor():
    with Supervised(stops=1) as s:
        os.kill(s.proc.pid, signal.SIGKILL)
        assert _still_running([s.server], time.monotonic() + 2) == []


def server_config(models_dir: Path) -> dict:
    """SLOW in a deployment of its own, so that its requests cross Ray between two replicas, as a GPU model's do."""
    slow = {"batch_wait_timeout_s": WINDOW_S, "max_batch_size": 2 * IN_FLIGHT, "max_queued_requests": 2 * IN_FLIGHT}
    slow["placement"] = "deployment"
    return {"models_dir": str(models_dir), "backend": "cpu", "overrides": {SLOW: slow}, "limits": {"drain_s": DRAIN_S}}


@pytest.mark.serve
@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_whole_process_group_drains_every_request_in_progress(tiny_models_dir, signum):
    """IN_FLIGHT requests wait in SLOW's batch window when the signal reaches every process of the launcher's group:
    readiness turns 503, each request still gets its 200, and every process of the server is gone in time."""
    with ServerProcess(server_config(tiny_models_dir)) as server:
        try:
            inflight = _send_in_flight(server.port)
            tree = server.processes()
            start = time.monotonic()
            os.killpg(tree[0], signum)  # started in a session of its own: its process group is its PID
            readiness, ready_s = _readiness_during_drain(server.port)
            codes = [_status(sock) for sock in inflight]
            stop_s = _exited(server, start, DRAIN_S + 5)
            left = _still_running(tree, start + DRAIN_S + 5)
        finally:
            signal_all(server.processes(), signal.SIGKILL)
        log = server.log()
    print(
        f"\n{signal.Signals(signum).name} to the process group: readiness {readiness} after {ready_s * 1e3:.0f} ms, "
        f"{codes.count(200)}/{IN_FLIGHT} in progress answered 200, exit after {stop_s:.1f} s, {len(left)} left"
    )
    assert codes == [200] * IN_FLIGHT, (codes, log[-2000:])
    assert readiness == 503, log[-2000:]
    assert server.returncode == 0 and "drained in" in log and "not draining" not in log, log[-2000:]
    assert not left, left


def _send_in_flight(port: int) -> list[socket.socket]:
    """IN_FLIGHT whole requests to SLOW, each on its own connection, read by the server and waiting in its window."""
    body = json.dumps({"text": "in flight"}).encode()
    socks = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(IN_FLIGHT)]
    for sock in socks:
        sock.sendall(post_bytes(f"/v1/models/{SLOW}/predict", body))
    time.sleep(0.5)
    return socks


def _readiness_during_drain(port: int) -> tuple[int | str, float]:
    """Readiness polled from the signal on: its first answer other than 200 (or why none came), and when."""
    start = time.monotonic()
    answer: int | str = "no answer other than 200 within 5 s"
    while time.monotonic() - start < 5:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2).status_code
        except httpx.HTTPError as exc:
            answer = type(exc).__name__
        if answer != 200:
            break
    return answer, time.monotonic() - start


def _status(sock: socket.socket) -> int | str:
    """The HTTP status of the one answer on `sock`, read whole; else what came instead."""
    with sock, sock.makefile("rb") as stream:
        try:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = stream.readline()
                if not line:
                    return f"closed after {head[:40]!r}"
                head += line
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            body = stream.read(length)
        except OSError as exc:
            return type(exc).__name__
    return int(head[9:12]) if len(body) == length else f"cut after {len(body)} of {length} bytes"


def _exited(server: ServerProcess, start: float, timeout_s: float) -> float:
    """Seconds from `start` until the launcher exited (nan past `timeout_s`)."""
    while server.returncode is None and time.monotonic() - start < timeout_s:
        time.sleep(0.05)
    return time.monotonic() - start if server.returncode is not None else float("nan")


def _still_running(pids: list[int], deadline: float) -> list[str]:
    """The command lines of `pids` still running at `deadline` (none once they are all gone)."""
    while (left := [pid for pid in pids if _running(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [_command_line(pid) for pid in left if _running(pid)]


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()[:80].replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone meanwhile)"


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
