"""Graceful stop of a local server: readiness answers 503 at once, inference requests in progress finish within the
drain period, then the embedded Ray goes down with everything in it (Serve's own shutdown took 3-30 s). No torch.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time

POLL_S = 0.05
CALL_TIMEOUT_S = 2.0
GCS_CHECK_S = 0.1  # while draining, how often to check that Ray's GCS is still there
SHUTDOWN_WITHOUT_GCS_S = 2.0


def drain(app_name: str, period_s: float, ingress: str = "ingress") -> tuple[int, float]:
    """Tell the app's ingress to drain, then wait until it has no inference request in progress or `period_s` has
    passed; (requests still in progress at the end, seconds waited; -1: unknown). A second Ctrl-C or SIGTERM ends
    the wait. Bounded even when Ray's control processes are gone (a SIGTERM to every process of the server, as
    systemd's KillMode=control-group sends it, reaches Ray's GCS too, and every call to it would then wait 60 s for a
    reconnect)."""
    start = time.monotonic()
    outcome: list[int] = []
    worker = threading.Thread(
        target=lambda: outcome.append(_drain_or_say_why(app_name, ingress, start + period_s)), daemon=True
    )
    worker.start()
    try:
        while worker.is_alive() and time.monotonic() - start < period_s + 2 * CALL_TIMEOUT_S:
            worker.join(GCS_CHECK_S)
            if worker.is_alive() and not gcs_reachable():
                print(
                    "mha-serving: Ray's GCS is gone (the signal reached Ray's own processes too; under systemd set "
                    "KillMode=mixed); not draining",
                    file=sys.stderr,
                )
                return -1, time.monotonic() - start
    except KeyboardInterrupt:
        print("mha-serving: stopping without waiting for requests in progress", file=sys.stderr)
        return -1, time.monotonic() - start
    if not outcome:
        print(
            f"mha-serving: the ingress did not answer within {time.monotonic() - start:.0f} s; stopping",
            file=sys.stderr,
        )
        return -1, time.monotonic() - start
    return outcome[0], time.monotonic() - start


def gcs_reachable(timeout_s: float = 0.5) -> bool:
    """Whether this driver's Ray GCS accepts a connection (it answers at once on loopback, or is gone)."""
    import ray

    host, _, port = ray.get_runtime_context().gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _drain_or_say_why(app_name: str, ingress: str, deadline: float) -> int:
    try:
        return asyncio.run(_drain(app_name, ingress, deadline))
    except Exception as exc:  # the ingress is gone or does not answer: nothing left to drain there
        print(f"mha-serving: could not drain the ingress ({type(exc).__name__}: {exc}); stopping", file=sys.stderr)
        return -1


async def _drain(app_name: str, ingress: str, deadline: float) -> int:
    from ray import serve

    handle = serve.get_deployment_handle(ingress, app_name)  # Serve's handles here need a running event loop
    left = await asyncio.wait_for(_call(handle.drain), CALL_TIMEOUT_S)
    while left > 0 and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
        left = await asyncio.wait_for(_call(handle.in_flight), CALL_TIMEOUT_S)
    return left


async def _call(method) -> int:
    return await method.remote()


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
