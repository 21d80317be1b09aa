"""Device-memory arithmetic shared by backends: human byte counts and the "does it fit" check.

Every refusal quotes both numbers ("partition dense needs 21.3 GiB; device
m2-card has 16.0 GiB free"), so an operator can act on the message alone.
"""

from __future__ import annotations

from sixfold.backends.api import DoesNotFit, PartitionArtifact
from sixfold.backends.spec import DeviceSpec

__all__ = ["format_bytes", "check_fits"]

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit that keeps it >= 1, one decimal ("21.3 GiB", "512 B")."""
    for unit, size in _UNITS:
        if abs(nbytes) >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{int(nbytes)} B"


def _pair(a: int, b: int) -> tuple[str, str]:
    # NOTE: 16.04 GiB vs 16.0 GiB both print "16.0 GiB"; a refusal that reads
    # "needs 16.0 GiB; has 16.0 GiB free" helps nobody, so fall back to bytes.
    fa, fb = format_bytes(a), format_bytes(b)
    if fa == fb and a != b:
        return f"{fa} ({a} B)", f"{fb} ({b} B)"
    return fa, fb


def check_fits(artifact: PartitionArtifact, device: DeviceSpec, free_bytes: int | None = None,
               detail: str = "") -> None:
    """Raise DoesNotFit when ``artifact``'s weights exceed ``free_bytes`` (default: all of the device).

    ``detail`` is appended to the message (e.g. what already holds the memory).
    """
    free = device.memory_bytes if free_bytes is None else free_bytes
    if artifact.param_bytes > free:
        need, have = _pair(artifact.param_bytes, free)
        raise DoesNotFit(f"partition {artifact.name} needs {need}; device {device.name} has {have} free{detail}")
