"""A real sixfold server (rm2, 6 simulated cards) on a free loopback port, shared by a module's tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from tests.conftest import free_port

MAX_ROWS = 2000


class Served:
    def __init__(self, model, background: BackgroundServer, metrics_port: int) -> None:
        self.model, self.background, self.metrics_port = model, background, metrics_port

    @property
    def url(self) -> str:
        return self.background.url

    @property
    def http_url(self) -> str:
        """``HOST:PORT`` of the same server's KServe v2 REST endpoint."""
        return self.background.http_url

    def expected(self, request: dict[str, np.ndarray]) -> np.ndarray:
        """The unpartitioned model's scores for ``request``."""
        with torch.inference_mode():
            return self.model(*[torch.from_numpy(request[k]) for k in
                                ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


@pytest.fixture(scope="package")
def served_rm2():
    model, partitioned = partition_builtin("rm2", max_rows=MAX_ROWS, seed=3, cards=6)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics,
                              batching=BatchingConfig(max_batch_rows=1024, max_queue_delay_microseconds=2000))
    metrics_port = free_port()
    background = BackgroundServer(InferenceCore([served]),
                                  ServerConfig(grpc_port=0, http_port=0, metrics_port=metrics_port), metrics).start()
    try:
        yield Served(model, background, metrics_port)
    finally:
        background.stop()
