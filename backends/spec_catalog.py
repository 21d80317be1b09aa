"""Named device specs from every source, in one catalog: sixfold's files, vendor packages, backends.

A name given as ``--card-spec NAME`` (or ``load_spec(NAME)``) is looked up here.
Three sources, read once per process (``catalog(reload=True)`` re-reads):

1. ``built-in``: the JSON files shipped in ``backends/specs/``;
2. entry points of group ``sixfold.device_specs`` (a vendor's pip package
   declares ``[project.entry-points."sixfold.device_specs"] mycard = "mycard_sixfold:SPECS"``).
   The target is a ``DeviceSpec``, a dict of its fields, a path to a JSON file
   or to a folder of them, a list of any of these, or a function of no
   arguments returning any of these;
3. ``devices()`` of every usable registered backend (``sixfold.backends``),
   instantiated without options.

A spec is known by its ``name`` field. The same name from two sources with
different figures is a conflict: asking for it is refused with both sources
named (the same figures twice, e.g. a package that ships a spec and also
returns it from ``devices()``, are one spec). An unknown name is refused with
every known name and where it came from. A source that fails (an import
error, a bad JSON file, ``devices()`` raising) is logged, kept as a problem
(``problems()``, shown by ``describe_specs``) and skipped: it never stops the
server, as with backends (``sixfold.backends.registry``).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, replace
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from sixfold.backends.host.calibrate import auto_host_spec
from sixfold.backends.registry import discover
from sixfold.backends.spec import SPEC_DIR, DeviceSpec

__all__ = ["SPECS_GROUP", "SpecEntry", "SpecConflict", "UnknownSpec", "catalog", "catalog_from", "problems",
           "resolve_spec", "load_spec", "describe_specs"]

log = logging.getLogger(__name__)

SPECS_GROUP = "sixfold.device_specs"


@dataclass(frozen=True)
class SpecEntry:
    """One named spec and where it came from; ``conflicts`` lists other sources giving other figures."""

    name: str
    spec: DeviceSpec
    source: str
    conflicts: tuple[tuple[str, DeviceSpec], ...] = ()


class SpecConflict(ValueError):
    """Two sources give different specs under one name."""


class UnknownSpec(FileNotFoundError):
    """No source gives a spec of that name (a FileNotFoundError, as ``load_spec`` always raised)."""


def _same(a: DeviceSpec, b: DeviceSpec) -> bool:
    return replace(a, description="") == replace(b, description="")


def _specs_in(obj: Any, where: str) -> list[DeviceSpec]:
    """The DeviceSpecs an entry point's target stands for (see the module docstring)."""
    if isinstance(obj, DeviceSpec):
        return [obj]
    if isinstance(obj, dict):
        return [DeviceSpec.from_dict(obj)]
    if isinstance(obj, (str, Path)) or hasattr(obj, "read_text"):
        path = obj if hasattr(obj, "read_text") else Path(obj)
        if path.is_dir():
            return [spec for child in sorted(path.iterdir(), key=lambda p: p.name)
                    if child.name.endswith(".json") for spec in _specs_in(child, where)]
        try:
            return [DeviceSpec.from_dict(json.loads(path.read_text()))]
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(f"{path}: {exc}") from None
    if isinstance(obj, (list, tuple)):
        return [spec for item in obj for spec in _specs_in(item, where)]
    if callable(obj):
        return _specs_in(obj(), where)
    raise TypeError(f"{where} is {obj!r}: expected a DeviceSpec, a dict, a JSON path or folder, a list of "
                    f"these, or a function returning them")


def _builtin() -> list[tuple[str, DeviceSpec]]:
    out = []
    for path in sorted(SPEC_DIR.glob("*.json")):
        out.append((f"sixfold {path.relative_to(SPEC_DIR.parent.parent).as_posix()}", DeviceSpec.from_dict(json.loads(path.read_text()))))
    return out


def _from_entry_points(eps: Iterable[EntryPoint], issues: list[str]) -> list[tuple[str, DeviceSpec]]:
    out = []
    for ep in eps:
        dist = getattr(getattr(ep, "dist", None), "name", None)
        where = f"entry point {ep.name} = {ep.value} ({SPECS_GROUP}" + (f", package {dist})" if dist else ")")
        try:
            specs = _specs_in(ep.load(), where)
        except Exception as exc:  # a broken vendor package must not take the server down
            log.error("device specs from %s skipped: %s: %s", where, type(exc).__name__, exc)
            issues.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        out.extend((where, spec) for spec in specs)
    return out


def _from_backends(issues: list[str]) -> list[tuple[str, DeviceSpec]]:
    out = []
    for info in discover().values():
        if not info.usable or info.cls is None:
            continue
        where = f"backend {info.name}.devices() ({info.value})"
        try:
            devices = info.cls().devices()
            specs = _specs_in(list(devices), where)
        except Exception as exc:
            log.error("device specs from %s skipped: %s: %s", where, type(exc).__name__, exc)
            issues.append(f"{where}: {type(exc).__name__}: {exc}")
            continue
        out.extend((where, spec) for spec in specs)
    return out


def catalog_from(sources: Iterable[tuple[str, DeviceSpec]]) -> dict[str, SpecEntry]:
    """Merge ``(source, spec)`` pairs by spec name; the first source of a name is its entry's ``source``."""
    found: dict[str, SpecEntry] = {}
    for source, spec in sources:
        entry = found.get(spec.name)
        if entry is None:
            found[spec.name] = SpecEntry(spec.name, spec, source)
        elif not _same(entry.spec, spec) and source not in (s for s, _ in entry.conflicts):
            log.error("device spec %r given differently by %s and %s", spec.name, entry.source, source)
            found[spec.name] = replace(entry, conflicts=entry.conflicts + ((source, spec),))
    return dict(sorted(found.items()))


_lock = threading.Lock()
_cache: tuple[dict[str, SpecEntry], list[str]] | None = None


def _load(reload: bool) -> tuple[dict[str, SpecEntry], list[str]]:
    global _cache
    with _lock:
        if _cache is None or reload:
            issues: list[str] = []
            pairs = _builtin() + _from_entry_points(entry_points(group=SPECS_GROUP), issues)
            pairs += _from_backends(issues)
            _cache = (catalog_from(pairs), issues)
        return _cache


def catalog(reload: bool = False) -> dict[str, SpecEntry]:
    """Every named spec, by name (read once per process; ``reload=True`` re-reads)."""
    return dict(_load(reload)[0])


def problems(reload: bool = False) -> list[str]:
    """Sources that failed to give specs, and why."""
    return list(_load(reload)[1])


def _known(entries: dict[str, SpecEntry]) -> str:
    return "; ".join(f"{e.name} ({e.source})" for e in entries.values()) or "none"


def resolve_spec(name: str) -> DeviceSpec:
    """The spec called ``name``; UnknownSpec lists what exists, SpecConflict names both sources."""
    entries = catalog()
    entry = entries.get(name)
    if entry is None:
        issues = problems()
        raise UnknownSpec(f"no device spec {name!r}; known specs: {_known(entries)}"
                          + (f"; sources that failed: {'; '.join(issues)}" if issues else "")
                          + "; or give a path to a JSON file")
    if entry.conflicts:
        others = " and ".join(source for source, _ in entry.conflicts)
        raise SpecConflict(f"device spec {name!r} is given differently by {entry.source} and {others}; "
                           f"refusing to guess: uninstall or rename one, or pass a JSON file path")
    return entry.spec


def describe_specs() -> str:
    """A plain-text table of the named specs: name, kind, memory, source (conflicts and failures below)."""
    entries = catalog()
    rows = [("NAME", "KIND", "MEMORY", "SOURCE")]
    rows += [(e.name, e.spec.kind, f"{e.spec.memory_bytes / 2**30:.1f} GiB", e.source) for e in entries.values()]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    lines = []
    for row in rows:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3])
        entry = entries.get(row[0])
        for source, _ in entry.conflicts if entry else ():
            lines.append(f"    CONFLICT: also given, differently, by {source}")
    lines += [f"  failed: {issue}" for issue in problems()]
    return "\n".join(lines)


def load_spec(name_or_path: str | Path) -> DeviceSpec:
    """A named spec (``m2-card``, or one a vendor package ships), any JSON file by path, or ``auto``:
    this host, calibrated on first use and cached per machine (``sixfold.backends.host.calibrate.auto_host_spec``).

    A value ending in ``.json``, holding a path separator, or naming an
    existing file is a path; anything else is a name, looked up in
    ``sixfold.backends.spec_catalog`` (sixfold's files, the ``sixfold.device_specs``
    entry points, the registered backends' ``devices()``).
    """
    text = str(name_or_path)
    if text == "auto":  # this machine, calibrated once and cached (sixfold.backends.host.calibrate.auto_host_spec)
        return auto_host_spec()
    path = Path(name_or_path)
    if not (text.endswith(".json") or "/" in text or "\\" in text or path.is_file()):
        return resolve_spec(text)
    if not path.is_file():
        raise FileNotFoundError(f"no device spec file {text!r}")
    return DeviceSpec.from_dict(json.loads(path.read_text()))
