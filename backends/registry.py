"""Backend discovery through Python entry points (group ``sixfold.backends``), in one loader.

Modelled on vLLM's plugin loader (``vllm/plugins/__init__.py``): a vendor ships a
pip package declaring

    [project.entry-points."sixfold.backends"]
    mycard = "mycard_sixfold:MyCardBackend"

and sixfold finds it; the built-ins register the same way. The loader runs once
per process (``discover(reload=True)`` re-reads, for tests). The environment
variable ``SIXFOLD_BACKENDS`` (comma-separated names) limits which plugins are
imported; the others are listed as "filtered". A plugin that fails to import,
is not a Backend subclass, declares a Backend API major other than this
sixfold's (``Backend.api_version`` against ``BACKEND_API_VERSION``), or raises
from ``available()`` is logged and skipped, and the reason is kept so
``get_backend`` and ``describe`` can say why.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Literal

from sixfold.backends.api import BACKEND_API_VERSION, Backend, BackendError, api_version_problem, parse_api_version

__all__ = [
    "ENTRY_POINT_GROUP", "BACKENDS_ENV", "Status", "BackendInfo", "BackendNotFound",
    "discover", "discover_from", "get_backend", "describe", "parse_allowlist",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sixfold.backends"
BACKENDS_ENV = "SIXFOLD_BACKENDS"

Status = Literal["ok", "unavailable", "failed", "filtered"]


@dataclass(frozen=True)
class BackendInfo:
    """What the loader learned about one registered backend."""

    name: str
    """The entry point's name: what ``get_backend`` and ``--backend`` take."""
    value: str
    """Where it points ("package.module:Class")."""
    cls: type[Backend] | None
    """The class; None when it failed to load or was filtered out."""
    status: Status
    """"ok"; "unavailable" (``available()`` said no); "failed" (import or type error, another Backend API
    major, ``available()`` raised); "filtered" (SIXFOLD_BACKENDS)."""
    reason: str = ""
    """Why it is not "ok" (empty when it is)."""

    @property
    def usable(self) -> bool:
        return self.status == "ok" and self.cls is not None

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(self.cls.formats) if self.cls is not None else ()


class BackendNotFound(BackendError, KeyError):
    """``get_backend`` was asked for a backend that is not registered or not usable here.

    Both a BackendError and a KeyError, so callers catching either see it.
    """

    def __str__(self) -> str:  # KeyError would repr() the message, quotes and all
        return str(self.args[0]) if self.args else ""


_lock = threading.Lock()
_cache: dict[str, BackendInfo] | None = None


def parse_allowlist(raw: str | None) -> frozenset[str] | None:
    """Names in a SIXFOLD_BACKENDS value; None (everything allowed) when it is unset or blank."""
    names = frozenset(n.strip() for n in (raw or "").split(",") if n.strip())
    return names or None


def _inspect(ep: EntryPoint) -> BackendInfo:
    """Import one entry point and classify it; never raises."""
    try:
        obj = ep.load()
    except Exception as exc:  # a broken plugin must not take the server down
        log.exception("backend plugin %s (%s) failed to load", ep.name, ep.value)
        return BackendInfo(ep.name, ep.value, None, "failed", f"import failed: {type(exc).__name__}: {exc}")
    if not (isinstance(obj, type) and issubclass(obj, Backend)):
        reason = f"{ep.value} is {obj!r}, not a subclass of sixfold.backends.api.Backend"
        log.error("backend plugin %s skipped: %s", ep.name, reason)
        return BackendInfo(ep.name, ep.value, None, "failed", reason)
    declared = getattr(obj, "api_version", None)
    if problem := api_version_problem(declared):
        reason = f"{ep.value}: {problem}"
        log.error("backend plugin %s skipped: %s", ep.name, reason)
        return BackendInfo(ep.name, ep.value, None, "failed", reason)
    if parse_api_version(declared) > parse_api_version(BACKEND_API_VERSION):
        log.warning("backend plugin %s is written against Backend API %s, newer than this sixfold's %s: "
                    "it may use what this sixfold lacks", ep.name, declared, BACKEND_API_VERSION)
    if getattr(obj, "name", ep.name) != ep.name:
        log.warning("backend plugin %s: class %s says name=%r; it is registered as %r",
                    ep.name, obj.__qualname__, getattr(obj, "name", None), ep.name)
    try:
        ok, why = obj.available()
    except Exception as exc:
        log.exception("backend plugin %s: available() raised", ep.name)
        return BackendInfo(ep.name, ep.value, None, "failed", f"available() raised {type(exc).__name__}: {exc}")
    if not ok:
        log.info("backend %s is unavailable here: %s", ep.name, why)
        return BackendInfo(ep.name, ep.value, obj, "unavailable", why or "available() returned False")
    return BackendInfo(ep.name, ep.value, obj, "ok")


def discover_from(entries: Iterable[EntryPoint], allowlist: str | None = None) -> dict[str, BackendInfo]:
    """Classify ``entries`` (the testable core of ``discover``), importing only allowed ones.

    ``allowlist`` is a SIXFOLD_BACKENDS value; the first registration of a name wins.
    """
    allowed = parse_allowlist(allowlist)
    found: dict[str, BackendInfo] = {}
    for ep in entries:
        if ep.name in found:
            log.warning("backend %s registered twice (%s and %s); keeping the first",
                        ep.name, found[ep.name].value, ep.value)
            continue
        if allowed is not None and ep.name not in allowed:
            found[ep.name] = BackendInfo(ep.name, ep.value, None, "filtered",
                                         f"not in {BACKENDS_ENV}={','.join(sorted(allowed))}")
            continue
        found[ep.name] = _inspect(ep)
    if allowed is not None and (missing := sorted(allowed - set(found))):
        log.warning("%s names %s, but no such backend is registered; registered: %s",
                    BACKENDS_ENV, ", ".join(missing), ", ".join(sorted(found)) or "none")
    return dict(sorted(found.items()))


def discover(reload: bool = False) -> dict[str, BackendInfo]:
    """Every registered backend by name, loaded once per process (``reload=True`` re-reads)."""
    global _cache
    with _lock:
        if _cache is None or reload:
            _cache = discover_from(entry_points(group=ENTRY_POINT_GROUP), os.environ.get(BACKENDS_ENV))
        return dict(_cache)


def _listing(infos: dict[str, BackendInfo]) -> str:
    if not infos:
        return f"no backends are registered in entry point group {ENTRY_POINT_GROUP} (is sixfold installed?)"
    parts = [i.name if i.usable else f"{i.name} ({i.status}: {i.reason})" for i in infos.values()]
    return "registered: " + "; ".join(parts)


def get_backend(name: str, **options: Any) -> Backend:
    """Instantiate backend ``name`` with ``options``; BackendNotFound says what exists and why not."""
    infos = discover()
    info = infos.get(name)
    if info is None:
        raise BackendNotFound(f"no backend named {name!r}; {_listing(infos)}")
    if not info.usable or info.cls is None:
        raise BackendNotFound(f"backend {name!r} is {info.status}: {info.reason}; {_listing(infos)}")
    return info.cls(**options)


def describe() -> str:
    """A plain-text table of the registered backends (for ``sixfold-serve --list-backends``).

    Why a backend is not usable goes on its own indented line, so rows stay short. The last
    lines give this sixfold's Backend API version and the SIXFOLD_BACKENDS filter.
    """
    infos = discover()
    rows = [("NAME", "STATUS", "FORMATS", "ENTRY POINT")]
    rows += [(i.name, i.status, ",".join(i.formats) or "-", i.value) for i in infos.values()]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(rows[0], widths)) + "  " + rows[0][3]]
    for info, row in zip(infos.values(), rows[1:]):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
        if info.reason:
            lines.append(f"    {info.reason}")
    if not infos:
        lines.append(_listing(infos))
    lines.append(f"Backend API {BACKEND_API_VERSION}: a plug-in declaring another major version is refused")
    allowed = parse_allowlist(os.environ.get(BACKENDS_ENV))
    lines.append(f"{BACKENDS_ENV}={','.join(sorted(allowed))}" if allowed is not None
                 else f"{BACKENDS_ENV} is unset: every registered backend is loaded")
    return "\n".join(lines)
