"""The one mapping of typed service errors to gRPC status codes. No torch."""

from __future__ import annotations

import grpc

from service.errors import OverCapacityError, ServiceError

# HTTP status of a typed error -> gRPC status (OverCapacityError, a 503 in HTTP, is RESOURCE_EXHAUSTED: retry later)
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def status_of(exc: ServiceError) -> grpc.StatusCode:
    if isinstance(exc, OverCapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return CODES.get(exc.status, grpc.StatusCode.INTERNAL)
