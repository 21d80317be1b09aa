"""Domain errors of the serving core, each with the gRPC status it maps to (in one place)."""

from __future__ import annotations

import grpc

__all__ = ["clip", "clip_names", "ServingError", "InvalidInput", "ModelNotFound", "Unavailable", "Overloaded", "DeadlineExceeded", "InternalError",
           "Unauthenticated"]


CLIP_CHARS = 256
"""At most this many characters of a client's string are echoed in an error message."""


def clip(text: object, limit: int = CLIP_CHARS) -> str:
    """A client's string (a name, a key, a value's repr) for an error message: at most ``limit``
    characters, else its start, an ellipsis and its full length. A 100,000-character model name
    must come back as the real error, not as a status message too large for gRPC's trailers."""
    text = text if isinstance(text, str) else str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def clip_names(names: object, most: int = 8) -> str:
    """Client-given names as a list for an error message: each clipped, at most ``most`` of them."""
    names = list(names)  # type: ignore[call-overload]
    shown = ", ".join(repr(clip(n)) for n in names[:most])
    more = f", ... ({len(names)} in all)" if len(names) > most else ""
    return f"[{shown}{more}]"


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
