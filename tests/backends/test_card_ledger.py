"""backends.memory.CardLedger: one count of each card's bytes for every model in the process (issue 32.2)."""

from __future__ import annotations

import pytest

from sixfold.backends.api import DoesNotFit
from sixfold.backends.memory import CardLedger
from sixfold.backends.spec import DeviceSpec

GIB = 1 << 30


def _card(name: str) -> DeviceSpec:
    return DeviceSpec(name=name, memory_bytes=16 * GIB, peak_flops={"fp32": 1e12}, memory_bandwidth=1e11,
                      link_bandwidth=1e10, link_latency_s=1e-5)


def test_holds_add_up_per_card_and_an_overcommit_names_card_holder_and_bytes() -> None:
    ledger = CardLedger()
    card0, card1 = _card("m2-card/card0"), _card("m2-card/card1")
    first = ledger.reserve(card0, "model a version 1", 9 * GIB)
    ledger.reserve(card1, "model b version 1", 9 * GIB)  # another card: its own 16 GiB
    with pytest.raises(DoesNotFit, match=r"^card m2-card/card0 \(16\.0 GiB\): model b version 1 needs 9\.0 GiB "
                                         r"there, but only 7\.0 GiB is free \(model a version 1 holds 9\.0 GiB\)$"):
        ledger.reserve(card0, "model b version 1", 9 * GIB)
    assert ledger.held("m2-card/card0") == {"model a version 1": 9 * GIB}
    ledger.release(first, first)  # twice: the second is ignored
    assert ledger.held("m2-card/card0") == {}
    ledger.reserve(card0, "model b version 1", 9 * GIB)
    assert ledger.held("m2-card/card0") == {"model b version 1": 9 * GIB}
