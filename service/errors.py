"""Typed service errors, each with its HTTP status; `responses.py` maps them to `{"error": ...}` in one place.

No torch here.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: `status` is the HTTP status code the ingress answers with."""

    status = 500

    def headers(self) -> dict[str, str] | None:
        """Extra response headers (e.g. Retry-After); none by default."""
        return None

    def __reduce__(self):
        # Pickled as it is (its message and attributes), not by calling its class again with its message: errors
        # cross Ray calls from a model's deployment, and several are built from values other than their message.
        return _restored, (type(self), self.args, self.__dict__)


def _restored(cls: type[ServiceError], args: tuple, state: dict) -> ServiceError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


def prefixed(error: ServiceError, what: str) -> ServiceError:
    """The same error (its class, status and attributes) with its message after `what`: "prompt 2: ..."."""
    return _restored(type(error), (f"{what}: {error}", *error.args[1:]), dict(error.__dict__))


class BadRequestError(ServiceError):
    """400: the request is malformed or breaks the model's contract (names, dtypes, shapes, ids, lengths)."""

    status = 400


class BodyTooLargeError(ServiceError):
    """413: the request body is over the configured limit."""

    status = 413

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"request body of {size} bytes is over the limit of {limit} bytes")

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the rest of the body is not read: it must not be parsed as a request


class BodyTimeoutError(ServiceError):
    """408: the request body did not arrive within the configured time (a slow or stalled client)."""

    status = 408

    def __init__(self, limit_s: float, arrived: int) -> None:
        super().__init__(f"the request body did not arrive within {limit_s:g} s ({arrived} bytes read)")

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}  # the rest of the body may still be coming: do not read it as a request


class HeadTimeoutError(ServiceError):
    """408: the request line and headers did not arrive within the configured time (a slow or stalled client)."""

    status = 408

    def __init__(self, limit_s: float, arrived: int) -> None:
        super().__init__(f"the request head did not arrive within {limit_s:g} s ({arrived} bytes read)")

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class HeadersTooLargeError(ServiceError):
    """431: the request line and headers are over the configured size, or there are too many headers."""

    status = 431

    @classmethod
    def too_large(cls, limit: int) -> HeadersTooLargeError:
        return cls(f"request headers are over the limit of {limit} bytes")

    @classmethod
    def too_many(cls, limit: int) -> HeadersTooLargeError:
        return cls(f"more than {limit} request headers")

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class UnauthorizedError(ServiceError):
    """401: an administrative request (the model repository API) without its token."""

    status = 401


class ConflictError(ServiceError):
    """409: the request conflicts with how the service is configured (a route targets the model, say)."""

    status = 409


class RepositoryError(BadRequestError):
    """400: a model the repository could not load (Triton answers a failed load so); the message says why."""


class ModelNotFoundError(ServiceError):
    """404: no model of that name is configured."""

    status = 404


class NotReadyError(ServiceError):
    """503: the model is loading, failed to load (the message says why), or the server is shutting down."""

    status = 503


class RetryLaterError(ServiceError):
    """503 with Retry-After: a passing condition; the answer says when to try again."""

    status = 503
    retry_after_s = 1

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class OverCapacityError(RetryLaterError):
    """503: the server's or the model's bounded queue is full; retry later."""

    @classmethod
    def in_flight(cls, limit: int) -> OverCapacityError:
        return cls(f"the server is over capacity ({limit} inference requests in progress); retry later")

    @classmethod
    def generation_in_flight(cls, limit: int) -> OverCapacityError:
        return cls(
            f"the server is over capacity for generation ({limit} generation requests in progress, "
            "limits.max_generation_in_flight); retry later"
        )


class TooManyConnectionsError(OverCapacityError):
    """503: the ingress replica holds its limit of connections; this one is refused and closed."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the server holds its limit of {limit} connections; retry later")

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "Connection": "close"}


class ModelQueueFullError(OverCapacityError):
    """503: one model's bounded queue (its batcher's, the ingress's coalescer's or its replica's) is full."""

    def __init__(self, model: str) -> None:
        super().__init__(f"model {model!r} is over capacity (its queue is full); retry later")


class ReplicaLostError(RetryLaterError):
    """503: the model's replica died while answering (Serve starts another); retry later."""

    def __init__(self, model: str) -> None:
        super().__init__(f"the replica of model {model!r} stopped while answering (Serve starts another); retry")


class UnknownServiceError(ServiceError):
    """404: a health check of a service this server does not serve."""

    status = 404


class NotServedError(ServiceError):
    """501: an operation this server does not serve (e.g. a gRPC health Watch)."""

    status = 501


class ModelFileError(ValueError):
    """A model folder is missing, corrupt or breaks the contract; the deployment reports it instead of serving."""


class BackendError(RuntimeError):
    """The requested ORT backend cannot be honoured here; the message says why (never a silent CPU fallback)."""


class SamplingParamsError(BadRequestError, ValueError):
    """400: a generation request's sampling parameters are out of range; the message names the value."""


class PromptError(BadRequestError):
    """400: a generation prompt that is empty, holds token ids outside the vocabulary, or is text for a model that
    takes token ids only."""


class ContextLengthError(BadRequestError):
    """400: a generation request's prompt plus max_tokens is over the model's context length (both numbers said)."""

    def __init__(self, model: str, prompt_tokens: int, max_tokens: int, context: int) -> None:
        super().__init__(
            f"model {model!r}: the prompt's {prompt_tokens} tokens + max_tokens {max_tokens} = "
            f"{prompt_tokens + max_tokens} tokens, over its context length of {context} tokens"
        )


class QueueTimeoutError(OverCapacityError):
    """503 with Retry-After: a generation request waited in its model's queue past `queue_timeout_s` for room in
    the KV cache; nothing was generated."""

    def __init__(self, model: str, waited_s: float, limit_s: float) -> None:
        super().__init__(
            f"model {model!r} is over capacity: the request waited {waited_s:.1f} s for room in its KV cache "
            f"(queue_timeout_s {limit_s:g}); retry later"
        )


class GenerationFailedError(ServiceError):
    """500: a decoding step of the model failed; every sequence in that step ends with this error."""
