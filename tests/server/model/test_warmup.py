"""Synthetic batches through a model before it is served (sixfold.server.model.warmup): sizes, inputs, no statistics."""

from __future__ import annotations

import numpy as np
import tritonclient.grpc as tc

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.model.warmup import synthetic_batch, warmup_rows
from tests.conftest import triton_inputs


def _served(max_batch_rows: int = 300):
    model, partitioned = partition_builtin("rm2", max_rows=500, seed=1, cards=2)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics,
                              batching=BatchingConfig(max_batch_rows=max_batch_rows))
    return model, served, metrics


def test_sizes_reach_the_largest_batch_and_inputs_follow_the_plans_pooling() -> None:
    assert warmup_rows(1024) == (1, 16, 64, 256, 1024)
    assert warmup_rows(100) == (1, 16, 64, 100)
    assert warmup_rows(1) == (1,)
    _, served, _ = _served()
    batch = synthetic_batch(served, 7)
    pooling = served.plan.tables["pooling"]
    assert batch["dense_features"].shape == (7, 256) and batch["dense_features"].dtype == np.float32
    assert batch["sparse_lengths"].shape == (7, 32) and batch["sparse_lengths"].dtype == np.int32
    np.testing.assert_array_equal(batch["sparse_lengths"][3], np.rint(pooling).astype(np.int32))
    assert batch["sparse_indices"].shape == (int(batch["sparse_lengths"].sum()),) and not batch["sparse_indices"].any()
    served.runtime.close()


def test_a_served_model_is_warm_before_the_first_request_and_counts_no_request() -> None:
    model, served, metrics = _served()
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None), metrics) as bg:
        assert served.warmed_up
        cards = [card.stats() for card in served.runtime.cards]
        assert sum(s.batches for s in cards) >= 4  # every size reached a card (or was split over both)
        with tc.InferenceServerClient(bg.url) as client:
            stats = client.get_inference_statistics("rm2", as_json=True)["model_stats"][0]
            assert int(stats.get("inference_count") or 0) == 0 and int(stats.get("execution_count") or 0) == 0
            request = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=500), seed=2).make(5)
            scores = client.infer("rm2", triton_inputs(tc, request)).as_numpy("scores")
            stats = client.get_inference_statistics("rm2", as_json=True)["model_stats"][0]
            assert int(stats["inference_count"]) == 5  # the real request, and only it
    import torch
    with torch.inference_mode():
        expected = model(*[torch.from_numpy(request[k]) for k in ("dense_features", "sparse_lengths",
                                                                  "sparse_indices")]).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-5)


def test_no_warmup_leaves_the_model_cold() -> None:
    _, served, metrics = _served()
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                          metrics):
        assert not served.warmed_up
        assert sum(card.stats().batches for card in served.runtime.cards) == 0
