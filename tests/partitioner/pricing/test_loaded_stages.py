"""The served model's own partitions timed at load (real ONNX Runtime, real host lookups on the tiny model), cached
by the plan's fingerprint and the machine, and priced by the plan line and the simulator."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from sixfold.backends.emulation_calibrate import EmulationCalibration
from sixfold.partitioner.pricing.emulated_card import EmulatedCards
from sixfold.partitioner.pricing.loaded_stages import (HOST_ROWS, StageTiming, _at_once, load_stage_timing,
                                                       plan_fingerprint, save_stage_timing, served_stage_timing,
                                                       stage_timing_file)
from sixfold.partitioner.pricing.served_latency import PRICE_ROWS, _interpolate

# a calibration whose FLOPs-scaled price is far from anything real (10 s a call): the timed figures must win
CAL = EmulationCalibration(rows=(1, 2), seconds=(10.0, 10.0), flops_per_item=1.0, sharing=(1.0, 2.0), usable_cores=2,
                           source="test", call_overhead_s=1e-5)


@pytest.fixture(scope="module")
def tiny():
    from sixfold.server.loading.loader import load_builtin
    from sixfold.server.observability.metrics import ServerMetrics
    from sixfold.server.scheduling.batcher import BatchingConfig

    served = load_builtin("tiny", max_rows=None, seed=0, cards=2, backend="simcard", card_spec="m2-card",
                          metrics=ServerMetrics(), batching=BatchingConfig(max_queue_delay_microseconds=0))
    yield served
    served.runtime.close()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    return tmp_path


def _cards(served, cards: int = 2) -> EmulatedCards:
    return EmulatedCards(CAL, cards, served.runtime.min_split_rows)


def test_at_once_is_the_wall_time_of_parts_run_together() -> None:
    took = _at_once(lambda n: time.sleep(n / 1000), [20, 40, 30], nice=None)
    assert 0.039 <= took < 0.5  # the slowest part, not the sum (0.09 s) and not nothing


def test_the_tiny_models_loaded_partitions_are_timed_and_cached(tiny, cache) -> None:
    cards = _cards(tiny)
    t0 = time.perf_counter()
    timing = served_stage_timing("tiny", tiny.plan, tiny.runtime, cards, PRICE_ROWS)
    took = time.perf_counter() - t0
    assert timing is not None and took < 30
    assert [r for r, _ in timing.dense] == list(PRICE_ROWS)
    assert [r for r, _ in timing.host] == list(HOST_ROWS)
    assert all(0 < s < 1.0 for _, s in (*timing.dense, *timing.host, *timing.alone))
    assert timing.host[-1][1] > timing.host[0][1]  # 1,024 items' lookups take longer than one item's
    assert timing.dense[-1][1] > timing.dense[0][1]
    assert len(timing.sharing) == 2 and timing.sharing[0] == 1.0 and timing.sharing[1] >= 1.0
    path = stage_timing_file(timing.fingerprint)
    assert path.parent == cache and json.loads(path.read_text())["fingerprint"] == timing.fingerprint
    # a hit: the file as it is, nothing timed again
    mtime = path.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = served_stage_timing("tiny", tiny.plan, tiny.runtime, cards, PRICE_ROWS)
    assert again == timing and path.stat().st_mtime_ns == mtime and time.perf_counter() - t0 < 0.5
    # a different plan (one card, not two) is another fingerprint: timed anew, in a file of its own
    one = served_stage_timing("tiny", tiny.plan, tiny.runtime, _cards(tiny, 1), PRICE_ROWS)
    assert one.fingerprint != timing.fingerprint and stage_timing_file(one.fingerprint).exists()
    assert load_stage_timing(timing.fingerprint) == timing


def test_a_file_of_another_fingerprint_or_damaged_is_not_used(cache) -> None:
    timing = StageTiming("aaaa", dense=((1, 1e-3), (2, 2e-3)))
    path = save_stage_timing(timing)
    assert load_stage_timing("aaaa") == timing
    assert load_stage_timing("bbbb", path) is None  # another plan's figures
    path.write_text("{not json")
    assert load_stage_timing("aaaa") is None


def test_the_fingerprint_follows_what_the_timing_depends_on(tiny) -> None:
    dense = next(p for p in tiny.plan.partitions if p.kind == "dense")
    base = plan_fingerprint("tiny", dense, tiny.plan.tables, 2, 64, True)
    assert base == plan_fingerprint("tiny", dense, dict(tiny.plan.tables), 2, 64, True)
    rows = dict(tiny.plan.tables, rows=[r * 2 for r in tiny.plan.tables["rows"]])
    assert len({base, plan_fingerprint("tiny", dense, rows, 2, 64, True),
                plan_fingerprint("tiny", dense, tiny.plan.tables, 6, 64, True),
                plan_fingerprint("tiny", dense, tiny.plan.tables, 2, 0, True),
                plan_fingerprint("rm2", dense, tiny.plan.tables, 2, 64, True)}) == 5


def test_the_plan_line_prices_the_timed_partitions(tiny, cache, monkeypatch) -> None:
    from sixfold.server.cli import _lone_query

    monkeypatch.setenv("SIXFOLD_CALIBRATE_SECONDS", "1")  # the emulated cards' hand-off, measured in the cache

    lone = _lone_query(tiny, tiny.plan)
    timing = served_stage_timing("tiny", tiny.plan, tiny.runtime, _cards(tiny), PRICE_ROWS)
    assert "as the served partition ran here" in lone.dense_source and "timed at load" in lone.host_source
    timed = dataclasses.replace(_cards(tiny), timing=timing)
    for rows in PRICE_ROWS:
        assert lone.terms(rows)["host"] == pytest.approx(_interpolate(timing.host, rows), rel=1e-6)
        # the timed figure plus simcard's hand-off (the spec's time the floor): never a calibration's guess
        assert timed._timed(rows) <= lone.terms(rows)["dense"] < 1.0


def test_the_simulator_prices_the_same_plan_with_the_servers_timing(tiny, cache) -> None:
    from sixfold.simulate.platform import TimedStage, build_platform

    timing = served_stage_timing("tiny", tiny.plan, tiny.runtime, _cards(tiny), PRICE_ROWS)
    platform = build_platform("tiny", cards=2, emulation=CAL)
    assert isinstance(platform.host, TimedStage) and platform.host.points == timing.host
    assert platform.emulated.timing == timing
    lane = platform.lanes[0][0]
    assert lane.seconds(100) < 1.0  # the timed part, not the calibration's 10 s
    # with no timing for the plan, the calibration prices it (the spec-only what-if takes neither)
    stage_timing_file(timing.fingerprint).unlink()
    assert build_platform("tiny", cards=2, emulation=CAL).emulated.timing is None
    assert build_platform("tiny", cards=2).emulated is None


def test_the_emulated_price_of_a_lone_query_is_the_timed_one() -> None:
    timing = StageTiming("x", dense=((1, 1e-3), (128, 4e-3), (512, 8e-3)), alone=((1, 1e-3), (64, 2e-3)),
                         sharing=(1.0, 1.5))
    cards = dataclasses.replace(EmulatedCards(CAL, 2, 64), timing=timing)
    spec = lambda rows: 0.0  # noqa: E731
    assert cards.lone_seconds(1.0, 1, spec) == pytest.approx(1e-3 + 1e-5)
    assert cards.lone_seconds(1.0, 320, spec) == pytest.approx(6e-3 + 1e-5)
    assert cards.part_seconds(1.0, 64, 1, spec) == pytest.approx(2e-3 + 1e-5)  # alone
    assert cards.part_seconds(1.0, 64, 2, spec) == pytest.approx(4e-3 + 1e-5)  # the last of a 128-item query's parts
    assert cards.part_seconds(1.0, 20, 2, spec) == pytest.approx(
        (1e-3 + 1e-3 * 19 / 63) * 1.5 + 1e-5)  # two 20-row parts: a batch the router would not split; alone x sharing
    assert cards.lone_seconds(1.0, 1, lambda rows: 5.0) == 5.0  # the spec stays the floor
