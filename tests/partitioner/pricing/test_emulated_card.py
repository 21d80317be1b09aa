"""Emulated cards priced at this host's speed: the rule with exact numbers from a given calibration."""

from __future__ import annotations

import pytest

from sixfold.backends.emulation_calibrate import EmulationCalibration
from sixfold.partitioner.pricing.emulated_card import EmulatedCards, emulated_lone_query
from sixfold.partitioner.pricing.served_latency import ServedLatency, ServingPath

# the calibration graph: 1e6 FLOPs a row; 1 ms a call at 1 row, 2 ms at 65, 3 ms at 129 (alone), and 40 ms at
# 257, a call another process slowed down
CAL = EmulationCalibration(rows=(1, 65, 129, 257), seconds=(1e-3, 2e-3, 3e-3, 40e-3), flops_per_item=1e6,
                           sharing=(1.0, 2.0, 3.0, 4.0), usable_cores=2, source="test")


def test_a_call_alone_is_linear_in_its_rows_scaled_by_the_partitions_flops() -> None:
    assert CAL.seconds_per_row == pytest.approx(1e-3 / 64)  # the median slope: the slowed call is left out
    assert CAL.alone_seconds(1e6, 1) == pytest.approx(1e-3)
    assert CAL.alone_seconds(1e6, 33) == pytest.approx(1.5e-3)
    assert CAL.alone_seconds(3e6, 65) == pytest.approx(6e-3)  # three times the FLOPs a row
    assert CAL.alone_seconds(1e6, 257) == pytest.approx(5e-3)  # not the slowed 40 ms
    plumbing = EmulationCalibration(CAL.rows, CAL.seconds, 1e6, CAL.sharing, 2, call_overhead_s=1e-4)
    assert plumbing.alone_seconds(1e6, 65) == pytest.approx(2.1e-3)  # simcard's own hand-off, once a call


def test_sharing_is_time_slicing_over_the_fitted_cores() -> None:
    # k / sharing = 1.0 at k = 2, 3 and 4: one core's worth is left to the cards on this (busy) host
    assert CAL.effective_cores == pytest.approx(1.0)
    assert [CAL.sharing_factor(k) for k in (1, 2, 6)] == [1.0, 2.0, 6.0]
    quiet = EmulationCalibration((1, 2), (1e-3, 2e-3), 1e6, (1.0, 1.0, 1.5, 2.0, 2.5, 3.0), 2)
    assert quiet.effective_cores == pytest.approx(2.0) and quiet.sharing_factor(6) == pytest.approx(3.0)
    # never more cores than the process may use, never fewer than one
    assert EmulationCalibration((1, 2), (1e-3, 2e-3), 1e6, (1.0, 1.0, 1.0), 2).effective_cores == 2.0
    assert EmulationCalibration((1, 2), (1e-3, 2e-3), 1e6, (1.0, 9.0), 2).effective_cores == 1.0


def test_a_lone_query_splits_as_the_server_splits_and_waits_for_its_slowest_part() -> None:
    cards = EmulatedCards(CAL, cards=6, min_split_rows=64)
    assert [cards.parts(r) for r in (1, 127, 128, 200, 700)] == [1, 1, 2, 3, 6]
    spec = lambda rows: 0.0  # noqa: E731 - a spec far faster than the emulation
    assert cards.lone_seconds(1e6, 100, spec) == pytest.approx(CAL.alone_seconds(1e6, 100))
    # 129 items: 2 parts of 65 rows at once, sharing 2 -> 2 ms x 2
    assert cards.lone_seconds(1e6, 129, spec) == pytest.approx(4e-3)
    # 390 items: 6 parts of 65 rows, each 2 ms alone x 6 sharing one core
    assert cards.lone_seconds(1e6, 390, spec) == pytest.approx(12e-3)
    # the spec is the floor: an emulated card never answers before its modelled time
    assert cards.lone_seconds(1e6, 390, lambda rows: 0.5) == 0.5
    assert EmulatedCards(CAL, 6, splittable=False).parts(700) == 1
    with pytest.raises(ValueError, match="cards >= 1"):
        EmulatedCards(CAL, 0)


def test_the_plans_lone_query_gets_the_emulated_dense_term_and_says_where_it_is_from() -> None:
    lone = ServedLatency(host=((1, 1e-4), (1024, 1e-3)), dense=((1, 1e-4), (1024, 2e-3)),
                         serving=ServingPath(1e-3, 0.0, "test"))
    cards = EmulatedCards(CAL, cards=6)
    priced = emulated_lone_query(lone, cards, 1e6)
    assert priced.terms(1)["dense"] == pytest.approx(1e-3)  # alone, 1 row: slower than the spec's 0.1 ms
    assert priced.terms(1024)["dense"] == pytest.approx(cards.lone_seconds(1e6, 1024, lambda r: 0.0))
    assert priced.terms(500)["host"] == lone.terms(500)["host"]  # the host and the serving path are kept
    assert "emulated cards" in priced.describe(16)
    assert ServedLatency.from_dict(priced.to_dict()) == priced
    with pytest.raises(ValueError, match="flops_per_item"):
        emulated_lone_query(lone, cards, 0.0)


def test_a_damaged_calibration_is_refused() -> None:
    with pytest.raises(ValueError, match="emulation calibration"):
        EmulationCalibration.from_dict({"rows": [1], "seconds": [1e-3], "flops_per_item": 1e6, "sharing": [1.0],
                                        "usable_cores": 2})
