"""Small batches run their dense part on the host CPU (DeepRecSys), by a fixed or a tuned row threshold.

Real pieces: rm1 partitioned by torch.export, its dense ONNX on onnxruntime with
the host spec, simulated cards (a throttled one via the simcard ``slow_factor`` fault).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from sixfold import models
from sixfold.backends.api import Arrays, Executable
from sixfold.backends.registry import get_backend
from sixfold.backends.builtin.simcard import SimCardBackend
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.server.loading.loader import load_host_stage
from sixfold.server.scheduling.batcher import BatchingConfig, BatchInfo, DynamicBatcher
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.model.served import ServedModel
from sixfold.server.execution.runtime import HostDenseTuner, PlanRuntime


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=300, seed=5, cards=2)


def _host_dense(partitioned) -> Executable:
    ort = get_backend("onnxruntime")
    plan = partitioned.plan
    return ort.load(partitioned.artifact_for(DENSE_PARTITION, ort), plan.device(plan.devices_of(HOST_PARTITION)[0]).spec)


def _runtime(rm1, *, slow_factor: float = 1.0, host_dense: Executable | None = None, **kwargs) -> PlanRuntime:
    _, partitioned = rm1
    spec = load_spec("m2-card")
    dense = partitioned.artifacts[DENSE_PARTITION]
    host = load_host_stage(partitioned, load_spec("host-cpu"))
    backend = SimCardBackend(faults={"slow_factor": slow_factor})
    cards = [backend.load(dense, dataclasses.replace(spec, name=f"m2/card{i}")) for i in range(2)]
    return PlanRuntime(host, cards, host_dense=host_dense or _host_dense(partitioned), **kwargs)


def _batch(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=seed).make(rows)


def _expected(rm1, batch) -> np.ndarray:
    model, _ = rm1
    with torch.inference_mode():
        return model(*[torch.from_numpy(batch[k]) for k in ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


def _card_batches(runtime: PlanRuntime) -> int:
    return sum(card.stats().batches for card in runtime.cards)


class SlowHost(Executable):
    """The real host dense executable, 30 ms slower a batch (a busy host CPU)."""

    def __init__(self, inner: Executable) -> None:
        super().__init__(inner.artifact, inner.device)
        self.inner = inner

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return self.inner.run(inputs)

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        await asyncio.sleep(0.03)
        return await self.inner.infer(inputs)


async def test_a_fixed_threshold_runs_small_batches_on_the_host_and_the_rest_on_cards(rm1) -> None:
    runtime = _runtime(rm1, host_dense_max_rows=16)
    for rows, on_host in ((1, True), (16, True), (17, False), (64, False)):
        batch, info = _batch(rows, seed=rows), BatchInfo()
        before = _card_batches(runtime)
        out = await runtime.run(batch, info)
        np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
        assert (info.timings["card"] < 0) == on_host and (info.timings.get("dense_on_host") == 1.0) == on_host
        assert _card_batches(runtime) - before == (0 if on_host else 1), rows
    assert runtime.host_dense_max_rows == 16
    runtime.close()


async def test_zero_turns_it_off_and_a_threshold_needs_an_executable(rm1) -> None:
    runtime = _runtime(rm1, host_dense_max_rows=0)
    info = BatchInfo()
    await runtime.run(_batch(1), info)
    assert info.timings["card"] >= 0 and runtime.host_dense_max_rows == 0 and runtime.host_dense_tuner is None
    runtime.close()
    _, partitioned = rm1
    host = load_host_stage(partitioned, load_spec("host-cpu"))
    with pytest.raises(ValueError, match="host_dense_max_rows=8 needs a host dense executable"):
        PlanRuntime(host, [host], host_dense=None, host_dense_max_rows=8)
    with pytest.raises(ValueError, match="-1 \\(auto\\), 0 \\(off\\)"):
        HostDenseTuner(-2)


async def test_a_failing_host_falls_back_to_a_card(rm1) -> None:
    class Broken(SlowHost):
        async def infer(self, inputs):
            raise RuntimeError("host CPU on fire")

    _, partitioned = rm1
    runtime = _runtime(rm1, host_dense=Broken(_host_dense(partitioned)), host_dense_max_rows=32)
    batch, info = _batch(4), BatchInfo()
    out = await runtime.run(batch, info)
    np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert info.timings["card"] >= 0
    runtime.close()


async def _drive(runtime: PlanRuntime, rounds: int, sizes=(2, 4, 8, 16, 32, 64)) -> None:
    batches = {rows: _batch(rows, seed=rows) for rows in sizes}
    for _ in range(rounds):
        for rows in sizes:
            await runtime.run(batches[rows], BatchInfo())


async def test_auto_moves_the_threshold_up_when_the_card_is_slow(rm1) -> None:
    # A throttled card (200x: ~10 ms for 8 rows) against onnxruntime on the host (well under 1 ms).
    runtime = _runtime(rm1, slow_factor=200.0, host_dense_max_rows=-1, host_dense_auto_limit=64,
                       host_dense_explore_every=4)
    assert runtime.host_dense_max_rows == 0  # auto starts on the cards and learns
    await _drive(runtime, rounds=8)
    assert runtime.host_dense_max_rows == 64, runtime.host_dense_tuner.snapshot()
    before = _card_batches(runtime)
    await _drive(runtime, rounds=4)
    # Now mostly on the host: only the exploring batches (1 in 4 per size) still go to a card.
    assert _card_batches(runtime) - before <= 6 * 4 // 4 + 1
    runtime.close()


async def test_auto_keeps_batches_on_the_cards_when_the_host_is_slower(rm1) -> None:
    _, partitioned = rm1
    runtime = _runtime(rm1, host_dense=SlowHost(_host_dense(partitioned)), host_dense_max_rows=-1,
                       host_dense_auto_limit=64, host_dense_explore_every=4)
    await _drive(runtime, rounds=6)
    snapshot = runtime.host_dense_tuner.snapshot()
    assert runtime.host_dense_max_rows == 0, snapshot
    assert all(snapshot["host_ms"][b] > snapshot["card_ms"][b] for b in snapshot["host_ms"]), snapshot
    runtime.close()


async def test_the_threshold_is_a_metric(rm1) -> None:
    model, partitioned = rm1
    metrics = ServerMetrics()
    runtime = _runtime(rm1, host_dense_max_rows=24)
    served = ServedModel(name="rm1", version="1", plan=partitioned.plan, runtime=runtime, batcher=None,  # type: ignore[arg-type]
                         metrics=metrics)
    served.batcher = DynamicBatcher(served.run_batch, BatchingConfig(), max_inflight=2)
    batch = _batch(8)
    out = await served.infer(batch, [])
    np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    sample = metrics.registry.get_sample_value
    assert sample("sixfold_host_dense_max_rows", {"model": "rm1"}) == 24
    assert sample("sixfold_host_dense_batches_total", {"model": "rm1"}) == 1
    await served.batcher.close()
    runtime.close()


async def test_without_onnxruntime_the_model_serves_with_no_host_dense_fallback(fresh_registry, monkeypatch, caplog):
    """The fallback is an optimisation: SIXFOLD_BACKENDS without onnxruntime turns it off, loudly."""
    from sixfold.backends import registry
    from sixfold.server.scheduling.batcher import BatchingConfig
    from sixfold.server.loading.loader import load_builtin
    from sixfold.server.observability.metrics import ServerMetrics

    monkeypatch.setenv(registry.BACKENDS_ENV, "host-embedding,simcard")
    registry.discover(reload=True)
    served = load_builtin("tiny", max_rows=None, seed=0, cards=1, backend="simcard", card_spec="m2-card",
                          metrics=ServerMetrics(), batching=BatchingConfig())
    try:
        assert served.runtime.host_dense is None and served.runtime.host_dense_max_rows == 0
        assert served.runtime.host.stage.check_ids is False  # the server validated every id before queueing
        assert "no dense fallback on the host CPU" in caplog.text and "onnxruntime" in caplog.text
        request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=2).make(3)
        outputs = await served.infer(request, ["scores"])
        assert outputs["scores"].shape == (3, 1) and np.isfinite(outputs["scores"]).all()
    finally:
        await served.batcher.close()
        served.runtime.close()
