"""The operator's process of `mha-serving serve`: the server (its Ray, Serve and replicas) runs as a child in a session
of its own, so a signal to the operator's process group (Ctrl-C, `kill -- -PGID`, `timeout`) reaches this process
only, which forwards one SIGTERM (the server drains) and waits. Imports no Ray. No torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

SUPERVISOR_ENV = "MHA_SERVING_SUPERVISOR_PID"  # set for the server: its supervisor's PID
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.05  # how soon a signal received is forwarded
# Past drain_s, the server's own bounded steps (the drain's calls, Ray's shutdown) take up to ~8 s: only a server
# stuck beyond that is killed, with its whole process group.
STOP_MARGIN_S = 15.0
# The first stop drains, the second ends the drain; a third would reach the server while Ray shuts down, which a
# signal can only cut short.
MAX_STOPS_FORWARDED = 2
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def supervise(command: list[str], stop_within_s: float) -> int:
    """Run `command` (the server) in a new session until it exits; its exit status (128 + N if signal N ended it).
    SIGTERM or SIGINT: one SIGTERM forwarded, the server drains; another: forwarded again, it stops at once; more:
    not forwarded. SIGHUP: forwarded (reload). A server still running `stop_within_s` after the first stop is
    killed (status 1).

    The process's last act: once the server has ended, these signals are ignored (the interpreter's exit would put
    back their default, death), so that one arriving before this process exits cannot replace the server's status."""
    received: list[int] = []  # the handler only records: _wait forwards, so nothing is sent twice or lost
    for signum in (*STOP_SIGNALS, signal.SIGHUP):
        signal.signal(signum, lambda signum, _: received.append(signum))
    env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    server = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        return _wait(server, received, stop_within_s)
    finally:
        for signum in (*STOP_SIGNALS, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)


def _wait(server: subprocess.Popen, received: list[int], stop_within_s: float) -> int:
    forwarded, stops, stopping_since = 0, 0, None
    while (code := server.poll()) is None:
        for signum in received[forwarded:]:
            forwarded += 1
            if signum not in STOP_SIGNALS:
                server.send_signal(signum)
                continue
            stopping_since = stopping_since or time.monotonic()
            stops += 1
            if stops <= MAX_STOPS_FORWARDED:
                server.send_signal(signal.SIGTERM)
        if stopping_since is not None and time.monotonic() - stopping_since > stop_within_s:
            return _kill(server, time.monotonic() - stopping_since)
        time.sleep(POLL_S)
    if code < 0:  # a signal ended the server, not its own exit: say which (128 + N alone reads like an exit status)
        print(f"mha-serving: the server process ended on {signal.Signals(-code).name}", file=sys.stderr, flush=True)
        return 128 - code
    return code


def _kill(server: subprocess.Popen, waited_s: float) -> int:
    print(f"mha-serving: the server did not stop within {waited_s:.0f} s; killing it", file=sys.stderr, flush=True)
    # Its group (not yet reaped, so still its own) holds Ray's GCS and raylet; the replicas end with their raylet.
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()
    return 1


def is_server() -> bool:
    """Whether this process is the server a supervisor started (even one already gone: see die_with_supervisor)."""
    return SUPERVISOR_ENV in os.environ


def die_with_supervisor() -> None:
    """In the server: end when the supervisor ends, even by SIGKILL (Ray's processes end with the server, as Ray
    arranges); at once if it has already gone. Linux's parent-death signal, else a thread watching the parent."""
    parent = int(os.environ.pop(SUPERVISOR_ENV))  # not inherited by Ray's processes
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None:
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    armed = prctl is not None and prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    if os.getppid() != parent:  # gone already (before the signal was armed)
        os._exit(1)
    if not armed:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)  # the server's own session: itself and Ray's processes
