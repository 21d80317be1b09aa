"""Checking backend options: a misspelt option is an error, not a silently ignored default."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .api import BackendError

__all__ = ["reject_unknown", "int_option"]


def reject_unknown(backend: str, options: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise BackendError naming the unknown options and the known ones."""
    known = sorted(known)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise BackendError(f"backend {backend}: unknown option(s) {', '.join(unknown)}; "
                           f"known: {', '.join(known) or 'none'}")


def int_option(backend: str, option: str, value: Any, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``, or BackendError quoting it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BackendError(f"backend {backend}: option {option} must be an int >= {minimum}, got {value!r}")
    return value
