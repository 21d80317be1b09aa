"""The simulator prices a lone query as served: its stages plus the serving path (gRPC, decode .. encode)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from sixfold.partitioner.pricing.served_latency import ServedLatency, ServingPath
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.simulate.cli import main
from sixfold.simulate.engine import ServingSettings, simulate
from sixfold.simulate.traffic import Arrivals

from tests.simulate.factories import linear_platform

HOST = (0.2e-3, 2e-6)
CARD = (0.5e-3, 10e-6)


def _lone(items: int) -> Arrivals:
    return Arrivals(np.asarray([0.0]), np.asarray([items]), np.asarray([items]), 1.0, 1e-3)


def test_the_serving_path_beyond_the_front_end_is_added_to_each_answered_request() -> None:
    settings = ServingSettings(batching=BatchingConfig(max_queue_work_ms=0.0, max_queue_delay_microseconds=0),
                               min_split_rows=0, host_dense_max_rows=0)
    bare = linear_platform(host=HOST, card=CARD, per_request_s=50e-6)
    path = ServingPath(1e-3, 2e-6, "test", per_id_s=1e-9)
    priced = dataclasses.replace(bare, serving_path=path)
    stages = 50e-6 + HOST[0] + HOST[1] * 200 + CARD[0] + CARD[1] * 200
    assert simulate(bare, _lone(200), settings=settings).latency_ms["max"] == pytest.approx(stages * 1e3, abs=1e-9)
    # the front end's 50 us is part of the path: charged once, not twice
    expected = stages - 50e-6 + path.seconds(200, bare.ids_per_item)
    got = simulate(priced, _lone(200), settings=settings).latency_ms["max"]
    assert got == pytest.approx(expected * 1e3, abs=1e-9)


def test_run_on_this_host_agrees_with_the_plans_lone_query_price(tmp_path) -> None:
    """``sixfold-simulate run`` of lone queries and the plan's ``ServedLatency`` price the same thing alike."""
    from sixfold.simulate.platform import build_platform
    from sixfold.partitioner.pricing.served_latency import load_serving_path

    out = tmp_path / "run.json"
    assert main(["run", "--model", "tiny", "--cards", "2", "--query-size", "fixed:200", "--qps", "20",
                 "--arrival", "constant", "--duration", "1", "--warmup", "0.1", "--quiet", "--json", str(out)]) == 0
    p50 = json.loads(out.read_text())["results"][0]["runs"][0]["latency_ms"]["p50"]
    platform = build_platform("tiny", cards=2, card_spec="m2-card", host_spec="auto", serving_path=load_serving_path())
    lone = dataclasses.replace(ServedLatency.from_dict(platform.plan.estimates.served),
                               ids_per_item=platform.ids_per_item)
    assert p50 == pytest.approx(lone.seconds(200) * 1e3, rel=0.25)
