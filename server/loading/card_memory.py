"""A served model's card memory, held in the process-wide ledger (``sixfold.backends.memory.CARDS``).

Each loaded lane's executables say what they hold (``memory_bytes()``); those bytes are reserved
on their physical cards for the model version, next to every other model's, so two models that
together exceed a card are refused at load (naming the card, the model and the bytes) instead of
both reaching READY on an over-committed card (issue 32.2). The holds go back when the version's
runtime closes (unloaded, replaced, or the server stopping), or when it is collected unclosed.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from sixfold.backends.api import Executable
from sixfold.backends.memory import CARDS, CardLedger

from sixfold.server.execution.runtime import PlanRuntime

__all__ = ["reserve_cards", "hold_until_closed", "card_bytes"]


def _stages(lane: Executable) -> list[Executable]:
    return list(getattr(lane, "stages", None) or [lane])


def reserve_cards(lanes: Sequence[Executable], holder: str, ledger: CardLedger = CARDS) -> list[int]:
    """Reserve each lane stage's ``memory_bytes()`` on its card for ``holder``; all or nothing (DoesNotFit)."""
    holds: list[int] = []
    try:
        for lane in lanes:
            for stage in _stages(lane):
                holds.append(ledger.reserve(stage.device, holder, int(stage.memory_bytes())))
    except BaseException:
        ledger.release(*holds)
        raise
    return holds


def hold_until_closed(runtime: PlanRuntime, holds: list[int], ledger: CardLedger = CARDS) -> None:
    """Give ``holds`` back when ``runtime`` closes, or is collected without closing."""
    release = weakref.finalize(runtime, ledger.release, *holds)
    runtime.on_close.append(release)


def card_bytes(lanes: Sequence[Executable]) -> dict[str, int]:
    """Bytes each card holds for these lanes, by the plan's card id (``card0``...)."""
    out: dict[str, int] = {}
    for lane in lanes:
        for stage in _stages(lane):
            card = stage.device.name.rsplit("/", 1)[-1]
            out[card] = out.get(card, 0) + int(stage.memory_bytes())
    return out
