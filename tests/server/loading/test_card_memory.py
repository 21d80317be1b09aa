"""One device-memory ledger for the process (issue 32.2): two models that together exceed a card are refused.

Before, each model's backend instance kept its own budget, so two models reserving 9 GB each on one
16 GiB card both reached READY. Real pieces: the zoo's tiny model partitioned onto 2 simulated
cards of a spec with room for one copy of its dense part and a half, loaded as two models.
"""

from __future__ import annotations

import dataclasses
import gc

import pytest

from sixfold.backends.api import DoesNotFit
from sixfold.backends.memory import CARDS, format_bytes
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig


@pytest.fixture(scope="module")
def one_and_a_half():
    """tiny on 2 cards that hold 1.5 copies of its dense part each."""
    _, probe = partition_builtin("tiny", seed=0, cards=2, compile=False)
    dense = probe.plan.partition(DENSE_PARTITION).param_bytes
    spec = dataclasses.replace(load_spec("m2-card"), name="half-card", memory_bytes=dense * 3 // 2)
    return partition_builtin("tiny", seed=0, cards=2, card_spec=spec)[1], dense


def _load(partitioned, name: str):
    return load_partitioned(partitioned, backend="simcard", metrics=ServerMetrics(), name=name,
                            batching=BatchingConfig(max_batch_rows=32))


def test_a_second_model_that_would_overfill_a_card_is_refused_naming_card_model_and_bytes(one_and_a_half) -> None:
    partitioned, dense = one_and_a_half
    first = _load(partitioned, "first")
    try:
        assert CARDS.held("half-card/card0") == {"model first version 1": dense}
        assert first.parameters["sixfold.card_memory_bytes"] == f"card0={dense},card1={dense}"
        with pytest.raises(DoesNotFit) as refused:
            _load(partitioned, "second")
        text = str(refused.value)
        assert text == (f"card half-card/card0 ({format_bytes(dense * 3 // 2)}): model second version 1 needs "
                        f"{format_bytes(dense)} there, but only {format_bytes(dense * 3 // 2 - dense)} is free "
                        f"(model first version 1 holds {format_bytes(dense)})"), text
        assert CARDS.held("half-card/card0") == {"model first version 1": dense}  # nothing of the refused one stays
    finally:
        first.runtime.close()
    assert CARDS.held("half-card/card0") == {}  # unloading gives the card back
    second = _load(partitioned, "second")
    try:
        assert CARDS.held("half-card/card1") == {"model second version 1": dense}
    finally:
        second.runtime.close()


def test_a_model_collected_without_closing_gives_its_cards_back(one_and_a_half) -> None:
    partitioned, dense = one_and_a_half
    model = _load(partitioned, "dropped")
    assert CARDS.held("half-card/card1") == {"model dropped version 1": dense}
    for card in model.runtime.cards:
        card.close()
    del model
    gc.collect()
    assert CARDS.held("half-card/card1") == {}
