"""Statistics of a run record: nearest-rank percentiles, the measured window, the timeline."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.loadgen import RunRecord
from sixfold.loadgen.stats import percentiles, timeline, window_stats


def test_percentiles_are_nearest_rank():
    values = np.arange(1, 1001, dtype=float)  # 1..1000
    p = percentiles(values)
    assert p == {"p50": 500.0, "p90": 900.0, "p95": 950.0, "p99": 990.0, "p999": 999.0, "max": 1000.0}


def test_percentiles_of_nothing_are_none():
    assert percentiles(np.array([np.nan]))["p99"] is None


def make_record() -> RunRecord:
    """4 s at 10 q/s; second 2's requests took 300 ms, the rest 10 ms; one error at t=3.5."""
    due = np.arange(40) / 10
    record = RunRecord(due, np.full(40, 5))
    for i, t in enumerate(due):
        record.mark_sent(i, t + 0.001)
        if i == 35:
            record.mark_error(i, t + 0.01, "unavailable")
        else:
            record.mark_ok(i, t + (0.3 if 2 <= t < 3 else 0.01))
    return record


def test_window_stats():
    stats = window_stats(make_record(), 1.0, 3.0, lag_threshold_ms=5.0)
    assert stats["requests"] == {"scheduled": 30, "sent": 30, "ok": 29, "errors": 1, "unsent": 0}
    assert stats["latency_ms"]["p50"] == pytest.approx(10.0)
    assert stats["latency_ms"]["max"] == pytest.approx(300.0)
    assert stats["achieved_qps"] == pytest.approx(29 / 3, rel=1e-3)
    assert stats["items_per_s"] == pytest.approx(29 * 5 / 3, rel=1e-3)
    assert stats["send_lag_ms"]["max"] == pytest.approx(1.0) and stats["send_lag_ms"]["late"] == 0
    assert stats["errors_by_reason"] == {"unavailable": 1}
    assert stats["query_size"]["mean"] == 5


def test_timeline_puts_the_stall_on_its_second():
    rows = timeline(make_record(), 0.0, 4.0)
    assert [r["t"] for r in rows] == [0, 1, 2, 3]
    assert [r["sent"] for r in rows] == [10, 10, 10, 10]
    assert rows[2]["p50_ms"] == pytest.approx(300.0) and rows[1]["p99_ms"] == pytest.approx(10.0)
    assert rows[3]["errors"] == 1 and rows[3]["ok"] == 9
