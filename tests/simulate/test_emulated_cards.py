"""sixfold-simulate prices emulated cards at this host's speed (the server's split, the cores shared)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sixfold.backends.emulation_calibrate import EmulationCalibration
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.simulate.cli import main
from sixfold.simulate.engine import ServingSettings, simulate
from sixfold.simulate.platform import EmulatedStage, build_platform
from sixfold.simulate.traffic import Arrivals

# one core's worth shared (k / sharing = 1), 4 ms a call at 128 rows alone: far slower than an m2-card
CAL = EmulationCalibration(rows=(1, 128), seconds=(1e-3, 4e-3), flops_per_item=1e3,
                           sharing=(1.0, 2.0, 3.0), usable_cores=2, source="test")
SETTINGS = ServingSettings(batching=BatchingConfig(max_queue_work_ms=0.0, max_queue_delay_microseconds=0),
                           host_dense_max_rows=0)


def _lone(items: int) -> Arrivals:
    return Arrivals(np.asarray([0.0]), np.asarray([items]), np.asarray([items]), 1.0, 1e-3)


def test_a_split_lone_query_waits_for_its_last_part_priced_with_all_parts_sharing_the_cores(tmp_path,
                                                                                             monkeypatch) -> None:
    # NOTE: a cache of its own: a server an earlier test started may have timed tiny's partitions at load, and the
    # simulator prices from that timing when it finds it (loaded_stages), not from the calibration given here
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    spec = build_platform("tiny", cards=6, host_spec="host-cpu")
    emulated = build_platform("tiny", cards=6, host_spec="host-cpu", emulation=CAL)
    assert all(isinstance(lane[0], EmulatedStage) for lane in emulated.lanes) and emulated.emulated is not None
    assert "emulated cards priced at this host's speed" in emulated.describe()
    flops = emulated.lanes[0][0].cost.flops_per_item
    spec_part = spec.lanes[0][0].seconds(128)
    # 768 items: 6 parts of 128 at once; the last one dispatched sees all 6 computing (6 x, one core)
    part = max(spec_part, CAL.alone_seconds(flops, 128) * 6)
    got = simulate(emulated, _lone(768), settings=SETTINGS).latency_ms["max"]
    base = simulate(spec, _lone(768), settings=SETTINGS).latency_ms["max"]
    assert got - base == pytest.approx((part - spec_part) * 1e3, rel=1e-6)
    # 100 items: not split, one card alone
    got = simulate(emulated, _lone(100), settings=SETTINGS).latency_ms["max"]
    base = simulate(spec, _lone(100), settings=SETTINGS).latency_ms["max"]
    one = max(spec.lanes[0][0].seconds(100), CAL.alone_seconds(flops, 100))
    assert got - base == pytest.approx((one - spec.lanes[0][0].seconds(100)) * 1e3, rel=1e-6)


def test_the_output_says_how_the_cards_were_priced_and_spec_only_is_the_what_if(tmp_path) -> None:
    out = tmp_path / "run.json"
    common = ["run", "--model", "tiny", "--cards", "2", "--query-size", "fixed:200", "--qps", "5", "--arrival",
              "constant", "--duration", "0.5", "--warmup", "0.1", "--quiet", "--json", str(out)]
    assert main(common) == 0
    assert json.loads(out.read_text())["cards_priced"].startswith("cards emulated on this host's cores")
    assert main([*common, "--spec-only"]) == 0
    said = json.loads(out.read_text())["cards_priced"]
    assert "at their spec (--spec-only)" in said and "what-if of cards not bought yet" in said
    assert main([*common, "--host-spec", "host-cpu"]) == 0
    assert "--host-spec host-cpu: another host" in json.loads(out.read_text())["cards_priced"]
