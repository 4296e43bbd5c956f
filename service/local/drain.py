"""Graceful stop of a local server: every serving process's readiness answers 503 at once, inference requests in
progress finish within the drain period, then the embedded Ray goes down with everything in it (Serve's own shutdown
took 3-30 s). No torch.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from service.config import AppConfig
from service.local.supervisor import STOP_SIGNALS
from service.stop_notice import StopNotices

CALL_TIMEOUT_S = 2.0  # Serve's own share of a drain: applying the config to every replica, reporting back
GCS_CHECK_S = 0.1  # while draining, how often to check that Ray's GCS is still there
SHUTDOWN_WITHOUT_GCS_S = 2.0
_STOPPED_AGAIN = threading.Event()  # a stop signal after the first: the drain's wait ends


class StopSignal(KeyboardInterrupt):
    """The first stop signal, raised in the server's main thread. A subclass: CPython ends a `python -m` process with
    SIGINT at exit (status 130) once a plain KeyboardInterrupt has left code that exec() or eval() ran from a string,
    even one caught later, and it checks for that exact type. A stop during the start report's imports (dataclasses
    make their methods so) turned a clean drain into 130."""


def stop_signals_interrupt() -> None:
    """From now on the first SIGTERM or SIGINT raises StopSignal out of whatever the main thread runs (a start still
    in progress too); the next ones only end the drain."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    later_stops_end_the_drain()
    raise StopSignal


def later_stops_end_the_drain() -> None:
    """From the first stop signal on, a SIGTERM or SIGINT only sets a flag that the drain's wait polls. Raised as
    KeyboardInterrupt it would land wherever the main thread was, before the wait too: Ray then shut down under the
    drain's own Serve calls, and the server died ("the core worker has already been shutdown")."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: _STOPPED_AGAIN.set())


def drain_and_stop(app_name: str, config: AppConfig, notices: StopNotices) -> None:
    """The server's stop, once a stop signal came: drain, then end the embedded Ray; exits at once where Ray's GCS
    went down with the signal (Ray's own exit hook would wait on it again)."""
    later_stops_end_the_drain()  # already, where the first came through the launcher's handler
    print(f"\nmha-serving: draining (up to {config.limits.drain_s:g} s)...", file=sys.stderr, flush=True)
    left, waited = drain(app_name, config.limits.drain_s, config, notices)
    _ignore_stop_signals()
    unfinished = ", requests may have been unfinished" if left else ""
    print(f"mha-serving: drained in {waited:.1f} s{unfinished}; shutting down", file=sys.stderr, flush=True)
    stopped = stop_ray()
    _ignore_stop_signals()  # again: with its failure-signal handler (the user's choice) Ray resets SIGTERM
    if not stopped:
        sys.stdout.flush()
        os._exit(0)


def _ignore_stop_signals() -> None:
    """Past the drain the server is stopping anyway: a later SIGTERM or SIGINT (a third Ctrl-C, a repeating stopper)
    would interrupt Ray's shutdown and end the server with 130, Ray half stopped. The supervisor still kills a server
    that outlives its stop deadline."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def drain(app_name: str, period_s: float, config: AppConfig, notices: StopNotices) -> tuple[int, float]:
    """Tell every serving process of the app to stop (Ingress.stop: readiness 503 at once, requests in progress
    answered, then its ports and connections closed), then wait until each has or `period_s` has passed; (0 when all
    stopped in time, -1 when not or unknown; seconds waited). A second Ctrl-C or
    SIGTERM ends the wait. Bounded even when Ray's control processes are gone (a SIGTERM to every process of the
    server, as systemd's KillMode=control-group sends it, reaches Ray's GCS too, and every call to it would then wait
    60 s for a reconnect)."""
    start = time.monotonic()
    outcome: list[int] = []
    until = time.time() + period_s
    told = notices.send(until)  # every serving process connected stops now, each on its own
    stop = threading.Event()
    worker = threading.Thread(
        target=lambda: outcome.append(_drain_or_say_why(app_name, config, until, stop, told)), daemon=True
    )
    worker.start()
    while worker.is_alive() and time.monotonic() - start < period_s + 2 * CALL_TIMEOUT_S:
        worker.join(GCS_CHECK_S)
        if _STOPPED_AGAIN.is_set():
            print("mha-serving: stopping without waiting for requests in progress", file=sys.stderr)
            return _abandoned(worker, stop, start)
        if worker.is_alive() and not gcs_reachable():
            print(
                "mha-serving: Ray's GCS is gone (the signal reached Ray's own processes too; under systemd set "
                "KillMode=mixed); not draining",
                file=sys.stderr,
            )
            return _abandoned(worker, stop, start)
    if not outcome:
        print(
            f"mha-serving: the ingress did not answer within {time.monotonic() - start:.0f} s; stopping",
            file=sys.stderr,
        )
        return _abandoned(worker, stop, start)
    return outcome[0], time.monotonic() - start


def _abandoned(worker: threading.Thread, stop: threading.Event, start: float) -> tuple[int, float]:
    """Stop the drain's worker before Ray goes down: a Serve call it made after `ray.shutdown` would start a new
    Ray (Serve connects on demand) while this one stops. It ends within its call in progress, if any."""
    stop.set()
    worker.join(CALL_TIMEOUT_S)
    return -1, time.monotonic() - start


def gcs_reachable(timeout_s: float = 0.5) -> bool:
    """Whether this driver's Ray GCS accepts a connection (it answers at once on loopback, or is gone)."""
    import ray

    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _drain_or_say_why(app_name: str, config: AppConfig, until: float, stop: threading.Event, told: int) -> int:
    """Redeploys of the ingress's user_config, each applied in place to every replica (about 1.5 s each, measured):
    where the stop notice may not have reached every serving process, a first starts the stop in each (Serve
    reconfigures a few replicas at a time, so a reconfigure that waited would leave the others serving meanwhile),
    then one waits in each for its stop, up to `until` everywhere."""
    from service import serve_control

    deadline = time.monotonic() + (until - time.time()) + CALL_TIMEOUT_S
    replicas = config.ingress.scaling().get("num_replicas")
    keys = ("drain_until",) if replicas is not None and told >= replicas else ("stopping_until", "drain_until")
    try:
        for key in keys:
            if stop.is_set():
                return -1
            serve_control.update_ingress(app_name, {key: until})
            if not serve_control.wait_running(app_name, poll_s=0.05, deadline=deadline, stop=stop):
                return -1
        return 0
    except Exception as exc:  # the ingress is gone or does not answer: nothing left to drain there
        print(f"mha-serving: could not drain the ingress ({type(exc).__name__}: {exc}); stopping", file=sys.stderr)
        return -1


def stop_ray() -> bool:
    """End the embedded Ray (and every Serve replica in it); False when it could not in time. With its GCS gone (a
    signal to every process of the server), Ray's driver shutdown waits on it for ~8 s (measured): it gets
    SHUTDOWN_WITHOUT_GCS_S, and the caller should then exit at once (Ray's exit hook would wait again); the replicas
    end with their raylet."""
    import ray

    if not ray.is_initialized():
        return True
    if gcs_reachable():
        ray.shutdown()
        return True
    worker = threading.Thread(target=ray.shutdown, daemon=True)
    worker.start()
    worker.join(SHUTDOWN_WITHOUT_GCS_S)
    return not worker.is_alive()
