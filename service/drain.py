"""Graceful stop of a local server: readiness answers 503 at once, inference requests in progress finish within the
drain period, then the embedded Ray goes down with everything in it (Serve's own shutdown took 3-30 s). No torch.
"""

from __future__ import annotations

import asyncio
import sys
import time

POLL_S = 0.05
CALL_TIMEOUT_S = 2.0


def drain(app_name: str, period_s: float, ingress: str = "ingress") -> tuple[int, float]:
    """Tell the app's ingress to drain, then wait until it has no inference request in progress or `period_s` has
    passed; (requests still in progress at the end, seconds waited). A second Ctrl-C or SIGTERM ends the wait."""
    start = time.monotonic()
    try:
        left = asyncio.run(_drain(app_name, ingress, start + period_s))
    except KeyboardInterrupt:
        print("mha-serving: stopping without waiting for requests in progress", file=sys.stderr)
        left = -1
    except Exception as exc:  # the ingress is gone or does not answer: nothing left to drain there
        print(f"mha-serving: could not drain the ingress ({type(exc).__name__}: {exc}); stopping", file=sys.stderr)
        left = -1
    return left, time.monotonic() - start


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


def stop_ray() -> None:
    """End the embedded Ray (and every Serve replica in it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
