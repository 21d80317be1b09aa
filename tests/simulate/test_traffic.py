"""Simulated traffic: loadgen's models with shared random numbers across rates, traces and recordings."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold import models
from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.recording import save_recording
from sixfold.simulate.traffic import Traffic, parse_traffic


def test_two_rates_share_their_random_numbers() -> None:
    traffic = parse_traffic("poisson", "mlperf")
    slow, fast = traffic.draw(100.0, 50.0, 2.0, seed=4), traffic.draw(200.0, 25.0, 2.0, seed=4)
    n = min(len(slow), len(fast))
    assert np.allclose(slow.offsets[:n], 2 * fast.offsets[:n])  # the same gaps, scaled
    assert np.array_equal(slow.items[:n], fast.items[:n])
    assert np.array_equal(slow.ids, np.rint(slow.items * 2.0).astype(np.int64))


def test_a_trace_is_replayed_at_its_own_rate_or_scaled(tmp_path) -> None:
    path = tmp_path / "times.txt"
    path.write_text("0\n0.01\n0.02\n0.05\n0.1\n")
    traffic = parse_traffic(f"trace:{path}", "fixed:10")
    assert traffic.own_rate == pytest.approx(40.0)
    own = traffic.draw(None, 1.0, 1.0)
    assert own.offsets[:5].tolist() == pytest.approx([0, 0.01, 0.02, 0.05, 0.1])
    faster = traffic.draw(400.0, 1.0, 1.0)
    assert len(faster) == 10 * len(own)
    assert faster.offsets[:5].tolist() == pytest.approx([0, 0.001, 0.002, 0.005, 0.01])


def test_a_recording_brings_its_times_sizes_and_ids(tmp_path) -> None:
    gen = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=1000), seed=1)
    pool = (gen.make(3), gen.make(7))
    record = RunRecord(np.asarray([0.0, 0.5, 1.0, 2.0]), np.asarray([3, 7, 3, 7]))
    path = save_recording(tmp_path / "run.npz", record, np.asarray([0, 1, 0, 1]), pool, {"mode": "open"})
    traffic = Traffic.from_recording(str(path))
    arrivals = traffic.draw(None, 2.5, 99.0)
    assert arrivals.offsets.tolist() == [0.0, 0.5, 1.0, 2.0]
    assert arrivals.items.tolist() == [3, 7, 3, 7]
    assert arrivals.ids.tolist() == [pool[0]["sparse_indices"].size, pool[1]["sparse_indices"].size] * 2
    with pytest.raises(ValueError, match="--replay"):
        Traffic.from_recording(str(tmp_path / "missing.npz"))
