"""Admission before a request's message is read: refuse when every served model would refuse it anyway.

Under overload most requests are refused by the batchers' bounds (work, count, bytes). A transport that
reads and decodes a large message only to have it refused spends the CPU that serving needs: at 3x rm2's
capacity of MLPerf-sized queries (8.6 MB each) on one core, the answered rate fell to 0.58 of capacity.
The model a message is for is inside it, so before reading the transport can only ask whether every
model's batcher would refuse any request now (``DynamicBatcher.refusal_before_read``); when they all
would, the request is refused at once, its bytes never read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["refusal_for_unread"]


def refusal_for_unread(models: Iterable[Any], timeout_s: float | None = None, reading: int = 0) -> str | None:
    """The refusal every model in ``models`` (served models, each with a ``batcher``) would give any request
    now, with ``reading`` admitted requests still being read; None as soon as one might admit it, or has no
    batcher that can say (nothing is refused unread)."""
    reason = None
    for model in models:
        check = getattr(getattr(model, "batcher", None), "refusal_before_read", None)
        if check is None:
            return None
        reason = check(timeout_s, reading)
        if reason is None:
            return None
    return reason
