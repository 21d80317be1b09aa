"""bench/latency_breakdown.py's timeline: the slowest request after the warmup and its neighbours, drawn."""

from __future__ import annotations

import struct

from bench.latency_breakdown import breakdown, plot_timeline


def _record(t0: float, rows: int, host_s: float, host_wait_s: float = 0.0, card_wait_s: float = 0.0) -> list[float]:
    decoded, queued = t0 + 0.001, t0 + 0.0015
    queue_s, card_s = 0.002, 0.003
    done = queued + queue_s + host_s + card_s + 0.0002
    return [t0, decoded, queued, queue_s, host_s, card_s, done, done + 0.0001, rows, rows, 1, 0, host_wait_s, card_wait_s]


def test_the_timeline_centres_on_the_slowest_request_after_the_warmup(tmp_path) -> None:
    records = [_record(0.0, 700, 0.5)]  # the slowest of all, but in the warmup
    records += [_record(1.0 + 0.05 * i, 200, 0.01) for i in range(20)]
    records[12] = _record(records[12][0], 700, 0.09, host_wait_s=0.04, card_wait_s=0.002)  # the slowest after it
    png = tmp_path / "timeline.png"
    slowest = plot_timeline(records, png, warmup_s=0.5, window_ms=120, title="test")
    assert slowest["items"] == 700 and abs(slowest["at_s"] - records[12][0]) < 1e-9
    assert slowest["requests_drawn"] == 5  # itself and two each side, 50 ms apart
    header = png.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24])[0] > 600
    stats = breakdown(records)
    assert stats["host_wait"]["p99"] > 30 and stats["slowest_1pct_rows"] == 700
    assert stats["card_wait"]["p99"] > 1.5 and stats["card_wait"]["p50"] == 0
    older = breakdown([record[:13] for record in records])  # a tree before card waits were stamped
    assert older["card_wait"]["p99"] == 0 and older["host_wait"]["p99"] > 30
