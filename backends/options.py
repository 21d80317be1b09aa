"""Checking backend options: a misspelt option is an error, not a silently ignored default."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sixfold.backends.api import BackendError

__all__ = ["reject_unknown", "int_option", "bool_option", "parse_option", "load_options_file"]


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


def bool_option(backend: str, option: str, value: Any) -> bool:
    """``value`` as a bool (``true``/``false`` from the command line), or BackendError quoting it."""
    if not isinstance(value, bool):
        raise BackendError(f"backend {backend}: option {option} must be true or false, got {value!r}")
    return value


def parse_option(text: str) -> tuple[str, Any]:
    """``k=v`` -> (k, v), v read as JSON when it parses (``3``, ``true``, ``["A"]``, ``{"hang": true}``), else a string."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise ValueError(f"a backend option is KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def load_options_file(path: str) -> dict[str, Any]:
    """A JSON object of backend options; a top-level "description" is documentation and is dropped."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: an options file holds a JSON object, got {type(data).__name__}")
    data.pop("description", None)
    return data
