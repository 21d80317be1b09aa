"""Two models in one server: a backlog on one never delays the other (no head-of-line blocking)."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import tritonclient.grpc as grpcclient

from sixfold import models
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from tests.conftest import triton_inputs

ROWS = 500


def _served(name: str, seed: int, card, metrics: ServerMetrics):
    _, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=seed, cards=1, card_spec=card)
    return load_partitioned(partitioned, backend="simcard", metrics=metrics, name=name, host_dense_max_rows=0,
                            batching=BatchingConfig(max_batch_rows=4, max_queue_delay_microseconds=0))


def test_a_backlogged_model_does_not_delay_another():
    metrics = ServerMetrics()
    fast_card = load_spec("m2-card")
    fast_model = _served("fast", 1, fast_card, metrics)
    flops = fast_model.plan.partition("dense").flops_per_item
    # A card so slow that one 4-item batch of rm1 takes ~0.25 s.
    slow_card = dataclasses.replace(fast_card, name="crawl", efficiency=1.0,
                                    peak_flops={k: flops * 4 / 0.25 for k in fast_card.peak_flops})
    core = InferenceCore([_served("slow", 0, slow_card, metrics), fast_model])
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=ROWS), seed=3).make(4)
    with BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None), metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        client.infer("fast", triton_inputs(grpcclient, request))  # warm

        def call(name: str) -> float:
            own = grpcclient.InferenceServerClient(server.url)
            t0 = time.perf_counter()
            own.infer(name, triton_inputs(grpcclient, request), client_timeout=60)
            own.close()
            return time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=12) as pool:
            slow = [pool.submit(call, "slow") for _ in range(10)]  # ~2.5 s of backlog on one card
            time.sleep(0.3)
            fast = [call("fast") for _ in range(10)]  # meanwhile, one at a time
            slow_latencies = [f.result(timeout=60) for f in slow]
    assert max(slow_latencies) > 1.5  # the backlog was real
    assert np.median(fast) < 0.15, fast  # and the other model did not wait behind it
