"""A model's own shape error never takes a card out of rotation (issue 31).

Real pieces: rm1's dense ONNX exported with a fixed batch dimension (4 items, as a static export
makes it), so every batch of another size passes the server's request checks and then fails in
ONNX Runtime (INVALID_ARGUMENT on dense_features) on every card and on the host fallback alike;
simulated cards running it on ONNX Runtime; real loopback gRPC with the stock tritonclient. A card
that fails on its own (flaky.json's crash) is still taken out.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig
from tests.conftest import triton_inputs

FIXED_ITEMS = 4


def _static_batch(partitioned) -> None:
    """Fix the dense partition's ``dense_features`` batch dimension at FIXED_ITEMS (a static export)."""
    artifact = partitioned.artifacts[DENSE_PARTITION]
    graph = onnx.load_from_string(artifact.payload)
    (dense,) = [i for i in graph.graph.input if i.name == "dense_features"]
    dense.type.tensor_type.shape.dim[0].dim_value = FIXED_ITEMS
    partitioned.artifacts[DENSE_PARTITION] = dataclasses.replace(artifact, payload=graph.SerializeToString())


def _request(rows: int, seed: int) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=seed).make(rows)


@pytest.mark.parametrize("cards, host_dense_max_rows", [(3, 0), (1, -1)],
                         ids=["second-card-confirms", "host-fallback-confirms"])
def test_a_batch_the_model_cannot_take_is_invalid_argument_and_every_card_stays(cards, host_dense_max_rows) -> None:
    model, partitioned = partition_builtin("rm1", max_rows=300, seed=4, cards=cards)
    _static_batch(partitioned)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=BatchingConfig(max_batch_rows=64),
                              host_dense_max_rows=host_dense_max_rows)
    runtime = served.runtime
    assert (runtime.host_dense is not None) == (host_dense_max_rows != 0)
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                          metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        for seed, rows in enumerate((3, 5, 1, 7, 2, 6)):  # one at a time: each request is its own batch
            with pytest.raises(InferenceServerException) as info:
                client.infer("rm1", triton_inputs(grpcclient, _request(rows, seed)), client_timeout=20)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
            assert "dense_features" in info.value.message() and "INVALID_ARGUMENT" in info.value.message(), \
                info.value.message()
            assert runtime.router.healthy == list(range(cards)), runtime.paths()
        assert runtime._probe is None  # a restarted card is never probed with a batch no card can take
        request = _request(FIXED_ITEMS, 99)  # the size the model takes: answered, on a card still in rotation
        scores = client.infer("rm1", triton_inputs(grpcclient, request)).as_numpy("scores")
    with torch.inference_mode():
        expected = model(*(torch.from_numpy(request[k]) for k in
                           ("dense_features", "sparse_lengths", "sparse_indices"))).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    assert runtime.card_state == ["healthy"] * cards
    assert not any(kind == "error" for _, kind in runtime.fault_counts), runtime.fault_counts
    assert metrics.registry.get_sample_value("sixfold_inference_request_failure_total",
                                             {"model": "rm1", "reason": "invalid_input"}) == 6
    runtime.close()


def test_a_card_failing_on_its_own_is_still_taken_out() -> None:
    _, partitioned = partition_builtin("rm1", max_rows=300, seed=4, cards=2)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", backend_options={"faults": {"crash_after": 0}},
                              metrics=metrics, batching=BatchingConfig(max_batch_rows=64), host_dense_max_rows=0)
    runtime = served.runtime
    runtime.reload_card = None  # no restarts: the verdict stays visible
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                          metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            client.infer("rm1", triton_inputs(grpcclient, _request(3, 0)), client_timeout=20)
    # each card's crash names the card: not the same failure, so both are the cards' fault
    assert info.value.status() == "StatusCode.UNAVAILABLE", info.value
    assert "batch failed on 2 card(s): card" in info.value.message(), info.value.message()
    assert runtime.router.healthy == [] and all(s.startswith("failed") for s in runtime.card_state), runtime.card_state
    runtime.close()


def test_with_one_card_and_no_host_fallback_the_card_judges_itself_on_a_batch_it_answered_before() -> None:
    """No second path: the lone card runs an item of a batch it answered before; answering it keeps it in."""
    model, partitioned = partition_builtin("rm1", max_rows=300, seed=4, cards=1)
    _static_batch(partitioned)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=BatchingConfig(max_batch_rows=64),
                              host_dense_max_rows=0)
    runtime = served.runtime
    assert runtime.host_dense is None
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                          metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        good = _request(FIXED_ITEMS, 98)  # answered first: the batch the card is judged by
        client.infer("rm1", triton_inputs(grpcclient, good))
        for seed, rows in enumerate((3, 5, 1)):
            with pytest.raises(InferenceServerException) as info:
                client.infer("rm1", triton_inputs(grpcclient, _request(rows, seed)), client_timeout=20)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT", info.value
            message = info.value.message()
            assert "card0, the only path" in message and "dense_features" in message, message
            assert runtime.router.healthy == [0] and runtime.card_state == ["healthy"], runtime.card_state
        request = _request(FIXED_ITEMS, 99)
        scores = client.infer("rm1", triton_inputs(grpcclient, request)).as_numpy("scores")
    with torch.inference_mode():
        expected = model(*(torch.from_numpy(request[k]) for k in
                           ("dense_features", "sparse_lengths", "sparse_indices"))).numpy()
    np.testing.assert_allclose(scores, expected, rtol=1e-4, atol=1e-5)
    assert not any(kind == "error" for _, kind in runtime.fault_counts), runtime.fault_counts
    runtime.close()


def test_with_one_card_and_no_host_fallback_a_card_that_fails_its_own_probe_is_taken_out_once() -> None:
    _, partitioned = partition_builtin("rm1", max_rows=300, seed=4, cards=1)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", backend_options={"faults": {"crash_after": 1}},
                              metrics=metrics, batching=BatchingConfig(max_batch_rows=64), host_dense_max_rows=0)
    runtime = served.runtime
    runtime.reload_card = None  # no restarts: the verdict stays visible
    with BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                          metrics) as server:
        client = grpcclient.InferenceServerClient(server.url)
        client.infer("rm1", triton_inputs(grpcclient, _request(3, 0)))  # its one good batch
        with pytest.raises(InferenceServerException) as info:
            client.infer("rm1", triton_inputs(grpcclient, _request(3, 1)), client_timeout=20)
    assert info.value.status() == "StatusCode.UNAVAILABLE", info.value
    assert runtime.router.healthy == [] and runtime.card_state[0].startswith("failed"), runtime.card_state
    assert runtime.fault_counts == {(0, "error"): 1}, runtime.fault_counts  # the batch's failure, not also the probe's
    runtime.close()
