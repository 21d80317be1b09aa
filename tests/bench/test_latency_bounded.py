"""bench/latency_bounded.py's split of server / ideal into own speed and scheduling (its report module's)."""

from __future__ import annotations

import argparse

import pytest

from bench._latency_bounded_report import ideal_qps, own_speed_split


def test_own_speed_splits_the_gap_to_the_ideal_server() -> None:
    args = argparse.Namespace(p99_ms=[60.0])

    def run(offline: float, own: float, qps: float) -> dict:
        best = {"concurrency": 8, "items_per_s": own, "cpu_ms_per_query": {"cards (dense)": 10.0, "other": 1.0}}
        return {"offline": {"best_items_per_s": offline},
                "servers": {"sixfold": {"bounds": {60.0: {"max_qps": qps, "queries": 200, "at_ceiling": False}},
                                        "saturation": {"steps": [best], "best": best}},
                            "mlserver": {"skipped": "not installed"}}}

    runs = [run(40_000, 20_000, 20.0), run(40_000, 22_000, 25.0), run(38_000, 24_000, 30.0)]
    split = own_speed_split(runs, args, {60.0: [ideal_qps(r["offline"], 60.0) for r in runs]})
    assert list(split) == ["sixfold"]  # a skipped server has no own speed
    e = split["sixfold"]
    assert e["items_per_s"] == 22_000 and e["of_offline"] == pytest.approx(0.55)
    assert e["cpu_ms_per_query"] == {"cards (dense)": 10.0, "other": 1.0}
    own = e["ideal_qps"][60.0]
    assert 0 < own < ideal_qps(runs[1]["offline"], 60.0)  # slower than offline: a lower ideal
    assert e["of_ideal"][60.0] < 1.0
    ratio = e["of_ideal_own"][60.0]
    assert ratio["low"] == ratio["high"] and 0 < ratio["low"] < 2
