"""Readiness tells the truth (issues 32.1 and 31.5): a version is ready only while it can answer now.

Real pieces: the zoo's tiny model partitioned as a two-stage pipeline on 4 simulated cards (two
lanes), cards that fail every batch (the simcard ``crash_after: 0`` fault, a dead card), a real
server over gRPC and REST asked by stock tritonclient, its grpc.health.v1 service and /metrics.
Before: every warm-up batch failed, yet the server answered ready while every request got
``UNAVAILABLE all 2 cards unhealthy``; and a model failing at 1 item was "served unwarmed" and ready.
"""

from __future__ import annotations

import logging
import time
import urllib.request
from collections.abc import Callable, Mapping

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tc
import tritonclient.http as th
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.backends.api import Arrays, Executable
from sixfold.backends.builtin.simcard import SimCardBackend
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.errors import Unavailable
from sixfold.server.execution.dense_loader import PipelineExecutable, load_dense
from sixfold.server.execution.runtime import PlanRuntime
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository
from sixfold.server.model.served import ServedModel
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig, DynamicBatcher
from tests.conftest import triton_inputs

DEAD = {"faults": {"crash_after": 0}}  # every batch fails, on every card, after every restart too


@pytest.fixture(scope="module")
def pipelined():
    return partition_builtin("tiny", seed=3, cards=4, strategy="pipeline", stages=2)


def _request(items: int, seed: int = 1) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("tiny"), seed=seed).make(items)


def _expected(model, request: Mapping[str, np.ndarray]) -> np.ndarray:
    with torch.inference_mode():
        return model(*[torch.from_numpy(request[k]) for k in (models.DENSE, models.LENGTHS, models.INDICES)]).numpy()


def _until(predicate: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.05)


def _health(url: str) -> int:
    with grpc.insecure_channel(url) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def _gauges(port: int, name: str) -> dict[str, float]:
    """``name``'s samples on the /metrics page: labels text -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
        lines = page.read().decode().splitlines()
    return {line[len(name) + 1:].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in lines if line.startswith(name + "{")}


def _card_health(port: int) -> dict[str, float]:
    return {labels.split('card="')[1].split('"')[0]: value
            for labels, value in _gauges(port, "sixfold_card_healthy").items()}


def _readiness(bg: BackgroundServer, model: str) -> tuple[bool, bool, bool, bool, int]:
    """(gRPC server ready, gRPC model ready, REST server ready, REST model ready, grpc.health status)."""
    with tc.InferenceServerClient(bg.url) as g, th.InferenceServerClient(bg.http_url) as h:
        return (g.is_server_ready(), g.is_model_ready(model), h.is_server_ready(), h.is_model_ready(model),
                _health(bg.url))


NOT_READY = (False, False, False, False, health_pb2.HealthCheckResponse.NOT_SERVING)
READY = (True, True, True, True, health_pb2.HealthCheckResponse.SERVING)


def _config() -> ServerConfig:
    return ServerConfig(grpc_port=0, http_port=0, metrics_port=0, readiness_interval_s=0.05)


def test_cards_all_dead_and_no_host_fallback_is_not_ready_and_ready_again_when_a_card_is_back(pipelined, caplog,
                                                                                               tmp_path) -> None:
    model, partitioned = pipelined
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", backend_options=DEAD, metrics=metrics,
                              batching=BatchingConfig(max_batch_rows=64), host_dense_max_rows=0)
    assert served.runtime.host_dense is None and len(served.runtime.cards) == 2  # two pipeline lanes
    served.runtime.restart_backoff_s = 0.05  # dead cards are retried quickly (the test's time bound)
    caplog.set_level(logging.WARNING)
    core = InferenceCore([served])
    core.control = ModelControl(core, ModelRepository(tmp_path), load_partitioned)  # RepositoryIndex says it too
    with BackgroundServer(core, _config(), metrics) as bg:
        assert not served.warmup_failed  # the cards failed, not the model: readiness follows the cards
        _until(lambda: _readiness(bg, "tiny") == NOT_READY)
        with tc.InferenceServerClient(bg.url) as client, pytest.raises(InferenceServerException) as refused:
            client.infer("tiny", triton_inputs(tc, _request(3)))
        assert "UNAVAILABLE" in str(refused.value.status()) and "unhealthy" in refused.value.message()
        assert _card_health(bg.server.metrics_port) == {"card0": 0.0, "card1": 0.0, "card2": 0.0, "card3": 0.0}
        assert _gauges(bg.server.metrics_port, "sixfold_model_ready") == {'model="tiny",version="1"': 0.0}
        assert "model tiny version 1 is not ready: no path can answer a batch" in caplog.text
        with tc.InferenceServerClient(bg.url) as client:
            [entry] = client.get_model_repository_index(as_json=True)["models"]
        assert entry["state"] == "UNAVAILABLE" and "no path can answer a batch" in entry["reason"], entry
        assert "no host fallback" in caplog.text

        healthy, reload_lane = load_dense(served.plan, lambda p: partitioned.artifact_for(p, SimCardBackend()),
                                          SimCardBackend())
        for lane in healthy:
            lane.close()
        served.runtime.reload_card = reload_lane  # the dead cards are replaced: their next restart works
        _until(lambda: _readiness(bg, "tiny") == READY)
        request = _request(5)
        with tc.InferenceServerClient(bg.url) as client:
            scores = client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores")
        np.testing.assert_allclose(scores, _expected(model, request), rtol=1e-5, atol=1e-5)
        assert 1.0 in _card_health(bg.server.metrics_port).values()
        assert _gauges(bg.server.metrics_port, "sixfold_model_ready") == {'model="tiny",version="1"': 1.0}
        with tc.InferenceServerClient(bg.url) as client:
            [entry] = client.get_model_repository_index(as_json=True)["models"]
        assert entry["state"] == "READY", entry
        assert "model tiny version 1 is ready again" in caplog.text


def test_a_pipeline_whose_cards_all_die_is_answered_by_its_whole_dense_chain_on_the_host(pipelined) -> None:
    model, partitioned = pipelined
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", backend_options=DEAD, metrics=metrics,
                              batching=BatchingConfig(max_batch_rows=64))
    fallback = served.runtime.host_dense
    assert isinstance(fallback, PipelineExecutable) and len(fallback.stages) == 2
    assert served.runtime.host_dense_max_rows == 0  # a fallback only: small batches stay on the cards
    with BackgroundServer(InferenceCore([served]), _config(), metrics) as bg:
        assert _readiness(bg, "tiny") == READY
        with tc.InferenceServerClient(bg.url) as client:
            for items in (1, 7, 40):
                request = _request(items, seed=items)
                scores = client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores")
                np.testing.assert_allclose(scores, _expected(model, request), rtol=1e-5, atol=1e-5)
        assert served.runtime.host_fallbacks >= 3 and not served.runtime.router.healthy


class FailsAtOneItem(Executable):
    """The real host stage, failing a lone item as a model with a batch-size guard does (issue 31.5)."""

    def __init__(self, inner: Executable) -> None:
        super().__init__(inner.artifact, inner.device)
        self.inner = inner

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        if inputs["sparse_lengths"].shape[0] == 1:
            raise RuntimeError("Expected input at *args[1].shape[0] to be >= 2, but got 1")
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()
        super().close()


def _fails_at_one_item(partitioned, metrics: ServerMetrics, version: str = "1") -> ServedModel:
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, version=version,
                              batching=BatchingConfig(max_batch_rows=64))
    runtime = served.runtime
    served.runtime = PlanRuntime(FailsAtOneItem(runtime.host), runtime.cards, host_dense=runtime.host_dense,
                                 host_dense_max_rows=0)
    served.batcher = DynamicBatcher(served.run_batch, BatchingConfig(max_batch_rows=64), max_inflight=3)
    return served


def test_a_model_that_fails_at_one_item_is_never_ready_and_the_log_says_why(pipelined, caplog) -> None:
    model, partitioned = pipelined
    metrics = ServerMetrics()
    served = _fails_at_one_item(partitioned, metrics)
    caplog.set_level(logging.WARNING)
    with BackgroundServer(InferenceCore([served]), _config(), metrics) as bg:
        assert "batch of 1 items failed" in served.warmup_failed
        assert _readiness(bg, "tiny") == NOT_READY
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("model tiny version 1 is not ready: its warm-up batch of 1 items failed" in e and ">= 2" in e
                   for e in errors), errors
        assert "serving it unwarmed" not in caplog.text


async def test_a_repository_load_whose_warm_up_fails_is_refused_and_the_old_version_keeps_serving(
        pipelined, tmp_path) -> None:
    _, partitioned = pipelined
    metrics = ServerMetrics()
    (tmp_path / "tiny" / "1").mkdir(parents=True)
    (tmp_path / "tiny" / "1" / "plan.json").write_text(partitioned.plan.to_json())
    good = load_partitioned(partitioned, backend="simcard", metrics=metrics, name="tiny", version="1",
                            batching=BatchingConfig(max_batch_rows=64))
    core = InferenceCore([good])
    control = ModelControl(core, ModelRepository(tmp_path), lambda repo, name, version: _fails_at_one_item(
        partitioned, metrics, version))
    (tmp_path / "tiny" / "2").mkdir()
    (tmp_path / "tiny" / "2" / "plan.json").write_text(partitioned.plan.to_json())
    try:
        with pytest.raises(Unavailable, match=r"failed to load model 'tiny': version 2: warm-up batch of 1 items "
                                              r"failed \(.*>= 2"):
            await control.load("tiny")
        assert core.model("tiny") is good and core.model_ready("tiny")
        assert [(s.version, s.state) for s in control.index()] == [("1", "READY")]
    finally:
        await good.batcher.close()
        good.runtime.close()
