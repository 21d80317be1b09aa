"""Splitting across host cores only where the halves were measured to finish sooner (the cpu layout)."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.execution.lane_split import SPLIT_PROBE_ROWS, SplitDecision, decide, measure_split
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchInfo, BatchingConfig


def test_the_split_starts_where_the_halves_win_at_every_larger_size() -> None:
    whole = {16: 1.0, 32: 2.0, 64: 4.0, 128: 8.0, 256: 16.0}
    assert decide(whole, {16: 1.5, 32: 2.5, 64: 3.0, 128: 5.0, 256: 9.0}) == 32  # from 64 items: halves of 32
    assert decide(whole, {16: 0.5, 32: 2.5, 64: 5.0, 128: 9.0, 256: 9.0}) == 128  # a small win below a loss counts not
    assert decide(whole, {16: 1.5, 32: 2.5, 64: 5.0, 128: 9.0, 256: 16.5}) == 0  # never: the largest lost
    assert decide(whole, {r: 0.97 * t for r, t in whole.items()}) == 0  # within the noise margin: no win
    assert decide({}, {}) == 0


def test_the_decision_says_its_rule_and_the_times_it_rests_on() -> None:
    text = SplitDecision(64, {128: 8e-3}, {128: 5e-3}).describe()
    assert text == "split batches of >= 128 items across cores (measured whole / halved: 128: 8.00 / 5.00 ms)"
    assert SplitDecision(0, why="one lane: nothing to split over").describe() == \
        "never split a batch across cores (one lane: nothing to split over)"


def test_one_lane_has_nothing_to_split_over() -> None:
    _, partitioned = partition_builtin("rm1", max_rows=300, seed=1, cards=1)
    from sixfold.backends.registry import get_backend
    spec = partitioned.plan.device("card0").spec
    lane = get_backend("onnxruntime").load(partitioned.artifact_for("dense", get_backend("onnxruntime")), spec)
    try:
        decision = measure_split([lane], {}, 512)
    finally:
        lane.close()
    assert decision.min_split_rows == 0 and "one lane" in decision.why


def test_lanes_on_host_measure_the_split_at_load_and_serve_exact_scores() -> None:
    model, partitioned = partition_builtin("rm1", max_rows=300, seed=1, cards=2)
    served = load_partitioned(partitioned, backend="onnxruntime", metrics=ServerMetrics(),
                              batching=BatchingConfig(), max_card_rows=256, min_split_rows=8, lanes_on_host=True)
    try:
        decision = served.split_decision
        assert sorted(decision.whole_s) == sorted(decision.halves_s)
        assert set(decision.whole_s) <= set(SPLIT_PROBE_ROWS) and len(decision.whole_s) >= 3
        assert all(t > 0 for t in [*decision.whole_s.values(), *decision.halves_s.values()])
        assert decision.min_split_rows == decide(decision.whole_s, decision.halves_s)
        runtime = served.runtime
        assert runtime.min_split_rows == decision.min_split_rows  # measured, not the 8 passed in
        assert runtime.max_card_rows is None  # a core takes any batch: no split forced by size
        assert served.parameters["sixfold.layout"] == "cpu"
        assert served.parameters["sixfold.min_split_rows"] == str(decision.min_split_rows)
        request = models.RequestGenerator.for_config(model.config, seed=5).make(300)
        scores = asyncio.run(runtime.run(request, BatchInfo(rows=300, requests=1)))["scores"]
        with torch.inference_mode():
            expected = model(*[torch.from_numpy(request[k]) for k in
                               ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()
        np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
    finally:
        served.runtime.close()
