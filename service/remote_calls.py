"""Calls to a model's own Serve deployment, and the one mapping of Ray's exceptions to service errors: a full queue
is a 503 (ModelQueueFullError), a replica that died while answering a 503 to retry (ReplicaLostError), a service
error the replica raised is itself. No torch.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, RequestCancelledError

from service.errors import ModelQueueFullError, ReplicaLostError, ServiceError

T = TypeVar("T")


class CallCancelled(Exception):
    """The call was cancelled from this side (its response's `cancel()`)."""


async def answer_of(model: str, call: Awaitable[T]) -> T:
    """The answer of a call to `model`'s deployment (a DeploymentResponse), Ray's failures as service errors."""
    try:
        return await call
    except BackPressureError as exc:  # every replica's queue is full (max_queued_requests)
        raise ModelQueueFullError(model) from exc
    except RequestCancelledError as exc:
        raise CallCancelled(model) from exc
    except RayActorError as exc:  # the replica died: Serve starts another, the request may be retried
        raise ReplicaLostError(model) from exc
    except RayTaskError as exc:  # a service error the replica raised: its own message and status, not Ray's traceback
        if isinstance(exc.cause, ServiceError):
            raise exc.cause from None
        raise
