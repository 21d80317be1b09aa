"""Domain errors of the serving core, each with the gRPC status it maps to (in one place)."""

from __future__ import annotations

import grpc

__all__ = ["ServingError", "InvalidInput", "ModelNotFound", "Unavailable", "Overloaded", "DeadlineExceeded", "InternalError",
           "Unauthenticated"]


class ServingError(Exception):
    """An error a client should see; ``code`` is its gRPC status, ``reason`` a metrics label."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(ServingError):
    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "invalid_input"


class ModelNotFound(ServingError):
    code = grpc.StatusCode.NOT_FOUND
    reason = "model_not_found"


class Unavailable(ServingError):
    code = grpc.StatusCode.UNAVAILABLE
    reason = "unavailable"


class Overloaded(ServingError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "overloaded"


class DeadlineExceeded(ServingError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "deadline"


class InternalError(ServingError):
    code = grpc.StatusCode.INTERNAL
    reason = "backend"


class Unauthenticated(ServingError):
    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "unauthenticated"
