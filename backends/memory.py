"""Device-memory arithmetic shared by backends: human byte counts, the "does it fit" check, and
one ledger of what every loaded model holds on each card.

Every refusal quotes both numbers ("partition dense needs 21.3 GiB; device
m2-card has 16.0 GiB free"), so an operator can act on the message alone.

Why a process-wide ledger (``CARDS``): each served model gets its own backend instance, so a
budget kept inside a backend resets per model; two models reserving 9 GB each on one 16 GiB card
both loaded (issue 32.2). The ledger is fed by what each loaded executable says it holds
(``Executable.memory_bytes()``), per physical card, for every model and version in the process.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from sixfold.backends.api import DoesNotFit, PartitionArtifact
from sixfold.backends.spec import DeviceSpec

__all__ = ["format_bytes", "check_fits", "CardLedger", "CARDS"]

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


@dataclass(frozen=True)
class _Hold:
    holder: str
    nbytes: int


class CardLedger:
    """Bytes held on each physical card by every loaded model, in one place for the process.

    A card is known by its device name (``SPEC/CARD``, as the server names each card of a plan:
    ``m2-card/card0``) and its capacity is its spec's ``memory_bytes``. ``reserve`` refuses a hold
    that would take a card past its capacity, naming the card, the holder and the bytes of every
    hold already there; ``release`` gives holds back (a model unloaded).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cards: dict[str, dict[int, _Hold]] = {}
        self._next = 0

    def reserve(self, device: DeviceSpec, holder: str, nbytes: int) -> int:
        """Hold ``nbytes`` on ``device`` for ``holder`` (e.g. "model rm2 version 1"); returns the hold's id.

        Raises DoesNotFit when the card's holds would exceed its memory.
        """
        with self._lock:
            holds = self._cards.setdefault(device.name, {})
            used = sum(h.nbytes for h in holds.values())
            if used + nbytes > device.memory_bytes:
                need, free = _pair(nbytes, max(0, device.memory_bytes - used))
                others = "; ".join(f"{h.holder} holds {format_bytes(h.nbytes)}" for h in holds.values())
                raise DoesNotFit(f"card {device.name} ({format_bytes(device.memory_bytes)}): {holder} needs {need} "
                                 f"there, but only {free} is free ({others or 'nothing else holds it'})")
            self._next += 1
            holds[self._next] = _Hold(holder, int(nbytes))
            return self._next

    def release(self, *holds: int) -> None:
        """Give back holds (ids from ``reserve``); an id already given back is ignored."""
        with self._lock:
            for cards in self._cards.values():
                for hold in holds:
                    cards.pop(hold, None)

    def held(self, card: str) -> dict[str, int]:
        """Bytes held on ``card`` (a device name), per holder."""
        with self._lock:
            out: dict[str, int] = {}
            for hold in self._cards.get(card, {}).values():
                out[hold.holder] = out.get(hold.holder, 0) + hold.nbytes
            return out


CARDS = CardLedger()
"""The process's ledger: every model the server loads reserves its cards' bytes here."""
