"""bench.serialized_load: a pool serialized once, sent as it is over real gRPC, offered vs sent reported.

Against a real server (rm1 on onnxruntime, 127.0.0.1): the pooled bytes are the ModelInferRequests
of the sizes drawn; an open loop sends every scheduled request and counts answers and
RESOURCE_EXHAUSTED refusals apart; two sender processes split a rate and their records merge.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from bench.serialized_load import OK, REFUSED, build_pool, open_loop, run_senders, summarize_sends
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.transport.limits import TransportLimits

MIB = 1 << 20


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=300, cards=1)


def _server(rm1, **config) -> BackgroundServer:
    _, partitioned = rm1
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="onnxruntime", metrics=metrics, batching=BatchingConfig())
    return BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, **config), metrics)


def test_the_pool_is_serialized_once_and_every_scheduled_request_is_sent_and_answered(rm1) -> None:
    with _server(rm1) as server:
        pool = build_pool(server.url, "rm1", size=4, query_size="uniform:20-60", seed=3)
        assert len(pool.payloads) == 4 and list(pool.items) == sorted(pool.items)
        for payload, items in zip(pool.payloads, pool.items):
            request = service_pb2.ModelInferRequest.FromString(payload)
            assert request.model_name == "rm1" and [list(i.shape) for i in request.inputs][0][0] == items
        sends = asyncio.run(open_loop(server.url, pool, qps=40, duration_s=2.0, seed=1))
        summary = summarize_sends(sends, 40, 2.0)
        assert summary["scheduled"] > 40 and summary["sent"] == summary["scheduled"] and summary["skipped"] == 0
        assert summary["ok"] == summary["sent"] and summary["refused"] == 0 and not summary["other_errors"]
        assert set(np.unique(sends.items)) <= set(pool.items.tolist())
        assert np.all(sends.done[sends.outcome == OK] >= sends.sent[sends.outcome == OK])


def test_refusals_are_counted_apart_and_two_senders_split_the_rate(rm1) -> None:
    """A 1 MiB receive budget and ~1.3 MB requests in a burst: some answered, some RESOURCE_EXHAUSTED, nothing else;
    then two sender processes at 30 q/s in all send what was scheduled, merged into one record."""
    with _server(rm1, limits=TransportLimits(receive_bytes=1 * MIB), max_message_bytes=4 * MIB) as server:
        big = build_pool(server.url, "rm1", size=2, query_size="fixed:250", seed=4)
        assert MIB < big.mean_bytes < 4 * MIB
        burst = asyncio.run(open_loop(server.url, big, qps=400, duration_s=0.5, seed=2))
        summary = summarize_sends(burst, 400, 0.5)
        assert summary["ok"] > 0 and summary["refused"] > 0, summary
        assert summary["ok"] + summary["refused"] == summary["sent"] and not summary["other_errors"]
        assert np.all(np.isin(burst.outcome[~np.isnan(burst.sent)], [OK, REFUSED]))
    with _server(rm1) as server:
        sends = run_senders(server.url, "rm1", 30, 2.0, senders=2, pool_size=3, query_size="uniform:5-20", seed=5)
        summary = summarize_sends(sends, 30, 2.0)
        assert 20 < summary["scheduled"] < 120 and summary["sent"] == summary["scheduled"]
        assert summary["ok"] == summary["sent"], summary
