"""Tables on the cards (--sparse-on-cards), served over gRPC, answer like the all-host model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from sixfold import models
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.placement.sharding import shard_tables
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_from_repository, load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.repository import ModelRepository
from tests.conftest import triton_inputs

ROWS = 2000


@pytest.mark.parametrize("mode", ["table", "row", "column"])
def test_sharded_tables_serve_like_the_original_in_memory_and_from_a_repository(tmp_path, mode):
    model, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=2, cards=6)
    shard_tables(partitioned, mode)
    assert any(s.device != "host" for s in partitioned.plan.shards)
    write_artifacts(partitioned, tmp_path / "rm1" / "1")
    metrics = ServerMetrics()
    batching = BatchingConfig(max_queue_delay_microseconds=500)
    in_memory = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=batching, name="mem")
    from_disk = load_from_repository(ModelRepository(tmp_path), "rm1", "1", backend="simcard", metrics=metrics,
                                     batching=batching)
    assert type(from_disk.runtime.host).__name__ == "ShardedEmbeddingStage"
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=ROWS), seed=4).make(37)
    with torch.inference_mode():
        expected = model(*(torch.from_numpy(request[k]) for k in
                           ("dense_features", "sparse_lengths", "sparse_indices"))).numpy()
    core = InferenceCore([in_memory, from_disk])
    with BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None), metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for name in ("mem", "rm1"):
            scores = client.infer(name, triton_inputs(grpcclient, request)).as_numpy("scores")
            np.testing.assert_allclose(scores, expected, rtol=1e-5, atol=1e-6)


def test_a_pipelined_model_serves_from_a_repository_like_the_original(tmp_path):
    import dataclasses

    from sixfold.backends.spec_catalog import load_spec
    tiny = dataclasses.replace(load_spec("m2-card"), name="tiny", memory_bytes=400_000)
    model, partitioned = partition_builtin("rm2", max_rows=50, seed=1, cards=5, card_spec=tiny)
    assert partitioned.plan.strategy == "pipeline" and len(partitioned.plan.dense_stages()) > 1
    write_artifacts(partitioned, tmp_path / "rm2" / "1")
    metrics = ServerMetrics()
    served = load_from_repository(ModelRepository(tmp_path), "rm2", "1", backend="simcard", metrics=metrics,
                                  batching=BatchingConfig(max_queue_delay_microseconds=500))
    request = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=50), seed=4).make(20)
    with torch.inference_mode():
        expected = model(*(torch.from_numpy(request[k]) for k in
                           ("dense_features", "sparse_lengths", "sparse_indices"))).numpy()
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None), metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        scores = client.infer("rm2", triton_inputs(grpcclient, request)).as_numpy("scores")
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=2e-5)
