"""Card names: /metrics, logs and client texts name the plan's physical cards, and a pipeline lane as a replica.

Real pieces: rm2 partitioned as a 3-stage pipeline over 6 cards (2 replicas: cards 0,1,2 and 3,4,5),
its stages on simulated cards with the injected fault of backends/specs/faults/flaky.json (every
batch fails after a count), served over real loopback gRPC with the stock tritonclient; rm1's
tables sharded onto the cards (``--sparse-on-cards table``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.placement.sharding import shard_tables
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig
from tests.conftest import triton_inputs

FAULTS = Path(__file__).resolve().parents[3] / "backends" / "specs" / "faults" / "flaky.json"


@pytest.fixture(scope="module")
def rm2_pipeline():
    model, partitioned = partition_builtin("rm2", max_rows=50, seed=1, cards=6, strategy="pipeline", stages=3)
    plan = partitioned.plan
    assert plan.strategy == "pipeline" and len(plan.dense_stages()) == 3
    return model, partitioned


def _replica_cards(plan) -> dict[int, list[str]]:
    """The plan's cards of each pipeline replica, in stage order."""
    stages = plan.dense_stages()
    by_replica: dict[int, dict[str, str]] = {}
    for p in plan.placements:
        if p.partition in stages:
            by_replica.setdefault(p.replica, {})[p.partition] = p.device
    return {r: [placed[s] for s in stages] for r, placed in by_replica.items()}


def _request(rows: int, seed: int) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("rm2", max_rows=50), seed=seed).make(rows)


def _expected(model, request) -> np.ndarray:
    with torch.inference_mode():
        return model(*(torch.from_numpy(request[k]) for k in
                       ("dense_features", "sparse_lengths", "sparse_indices"))).numpy()


def test_a_failing_pipeline_names_its_replicas_and_their_plan_cards(rm2_pipeline) -> None:
    _, partitioned = rm2_pipeline
    replicas = _replica_cards(partitioned.plan)
    assert replicas == {0: ["card0", "card1", "card2"], 1: ["card3", "card4", "card5"]}, replicas
    faults = {**json.loads(FAULTS.read_text())["faults"], "crash_after": 0}  # the dying card, dead from the start
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", backend_options={"faults": faults}, metrics=metrics,
                              batching=BatchingConfig(max_batch_rows=64), host_dense_max_rows=0,
                              card_timeout_floor_s=0.3)
    assert served.runtime.host_dense is None  # no host fallback: clients see the cards' texts
    assert [served.runtime.lane_name(i) for i in range(2)] == ["replica 0 (cards 0,1,2)", "replica 1 (cards 3,4,5)"]
    errors = []
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                          metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for seed in range(3):  # the first batch fails on both replicas; then neither is in rotation
            with pytest.raises(InferenceServerException) as info:
                client.infer("rm2", triton_inputs(grpcclient, _request(3, seed)), client_timeout=20)
            errors.append(info.value)
    assert all(e.status() == "StatusCode.UNAVAILABLE" for e in errors), errors
    first = errors[0].message()
    assert first.startswith("batch failed on 2 replica(s): "), first
    for r, cards in replicas.items():
        assert f"replica {r} (cards {','.join(c.removeprefix('card') for c in cards)}) failed" in first, first
    assert "card1 failed" not in first and "card0 failed" not in first, first  # no lane counted as a card
    assert "all 2 replicas unhealthy: replica 0 (cards 0,1,2) " in errors[-1].message(), errors[-1].message()
    sample = metrics.registry.get_sample_value
    for r, cards in replicas.items():
        for card in cards:  # each physical card of the failed replica, labelled with its replica
            assert sample("sixfold_card_faults_total",
                          {"model": "rm2", "card": card, "lane": f"replica{r}", "kind": "error"}) >= 1, (r, card)
    labelled = {(s.labels["card"], s.labels["lane"]) for family in metrics.registry.collect()
                if family.name == "sixfold_card_faults" for s in family.samples if s.name.endswith("_total")}
    assert labelled == {(c, f"replica{r}") for r, cards in replicas.items() for c in cards}, labelled
    served.runtime.close()


def test_a_healthy_pipeline_reports_rows_and_lag_per_plan_card(rm2_pipeline) -> None:
    model, partitioned = rm2_pipeline
    replicas = _replica_cards(partitioned.plan)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics,
                              batching=BatchingConfig(max_batch_rows=64), host_dense_max_rows=0)
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                          metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for seed in range(6):
            request = _request(5, seed)
            scores = client.infer("rm2", triton_inputs(grpcclient, request)).as_numpy("scores")
            np.testing.assert_allclose(scores, _expected(model, request), rtol=1e-4, atol=2e-5)
        series = {family.name: {(s.labels["card"], s.labels.get("lane")) for s in family.samples}
                  for family in metrics.registry.collect()
                  if family.name in ("sixfold_card_outstanding_rows", "sixfold_simcard_lag_seconds")}
    served.runtime.close()
    rows = series["sixfold_card_outstanding_rows"]
    assert rows and rows <= {(c, f"replica{r}") for r, cards in replicas.items() for c in cards}, rows
    for card, lane in rows:  # a replica's series cover all of its cards
        assert {(c, lane) for c in replicas[int(lane.removeprefix("replica"))]} <= rows, rows
    lag = series["sixfold_simcard_lag_seconds"]
    assert {c for c, _ in lag} == {c for c, _ in rows}, (lag, rows)  # per physical card, not per lane


def test_table_shards_on_cards_name_their_physical_card(tmp_path) -> None:
    model, partitioned = partition_builtin("rm1", max_rows=2000, seed=2, cards=6)
    shard_tables(partitioned, "table")  # what --sparse-on-cards table does
    plan = partitioned.plan
    on_cards = sorted({s.device for s in plan.shards if s.device != "host"})
    assert len(on_cards) >= 2, on_cards
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics,
                              batching=BatchingConfig(max_queue_delay_microseconds=500))
    stage = served.runtime.host
    assert sorted(stage.cards) == on_cards
    for device, executable in stage.cards.items():
        card = executable.artifact.card
        assert card is not None, device
        assert card.name == device and card.spec == plan.device(device).spec.name, (device, card)
        assert executable.device.name == card.device_name, (executable.device.name, card)
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=2000), seed=4).make(9)
    with torch.inference_mode():
        expected = model(*(torch.from_numpy(request[k]) for k in
                           ("dense_features", "sparse_lengths", "sparse_indices"))).numpy()
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None), metrics) as server:
        scores = grpcclient.InferenceServerClient(server.url).infer(
            "rm1", triton_inputs(grpcclient, request)).as_numpy("scores")
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)
    served.runtime.close()
