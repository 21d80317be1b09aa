"""Card health: hang deadlines from the cost model, hedged copies, the host-dense fallback, faults counted.

Real pieces: rm1 partitioned by torch.export, its dense ONNX on simulated cards
(with injected faults) and on onnxruntime for the host; the server tests go
over real loopback gRPC with the stock tritonclient.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
import torch
import tritonclient.grpc.aio as tca
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.backends.builtin.simcard import SimCardBackend, service_seconds
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig, BatchInfo
from sixfold.server.execution.card_health import CardDeadlines, CardHang, NoHealthyCardLeft, expected_card_seconds
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_from_repository, load_host_stage, load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.repository import ModelRepository
from sixfold.server.execution.runtime import PlanRuntime
from tests.backends.factories import FakeClock, batch, device, mlp
from tests.conftest import triton_inputs

ATOL = 1e-5


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=300, seed=4, cards=3)


def _request(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=seed).make(rows)


def _expected(rm1, request) -> np.ndarray:
    model, _ = rm1
    with torch.inference_mode():
        return model(*[torch.from_numpy(request[k]) for k in ("dense_features", "sparse_lengths",
                                                              "sparse_indices")]).numpy()


def _cards(rm1, faults: list[dict], spec=None) -> list:
    _, partitioned = rm1
    spec = spec or load_spec("m2-card")
    dense = partitioned.artifacts[DENSE_PARTITION]
    return [SimCardBackend(faults=f).load(dense, dataclasses.replace(spec, name=f"m2/card{i}"))
            for i, f in enumerate(faults)]


def _runtime(rm1, cards, **kwargs) -> PlanRuntime:
    _, partitioned = rm1
    kwargs.setdefault("host_dense_max_rows", 0)  # the host answers only when the cards cannot
    return PlanRuntime(load_host_stage(partitioned, load_spec("host-cpu")), cards, **kwargs)


async def _until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _idle(runtime: PlanRuntime) -> bool:
    return all(load.outstanding_rows == 0 and load.outstanding_batches == 0 and load.outstanding_s == 0
               for load in runtime.router.loads)


def test_deadlines_are_a_multiple_of_the_expected_time_between_a_floor_and_a_cap() -> None:
    d = CardDeadlines(multiple=10, floor_s=0.5, cap_s=30, hedge_fraction=0.25)
    assert d.hang_after(1e-4) == 0.5 and d.hang_after(0.2) == pytest.approx(2.0) and d.hang_after(9.0) == 30
    assert d.hedge_after(0.2) == pytest.approx(0.5) and CardDeadlines(hedge_fraction=0).hedge_after(1.0) is None
    assert CardDeadlines(multiple=0, floor_s=30).hang_after(5.0) == 30  # the old fixed 30 s timeout
    with pytest.raises(ValueError, match="card_timeout_floor_s \\(--card-timeout-floor-ms\\) must be .* got -1"):
        CardDeadlines(floor_s=-1)
    with pytest.raises(ValueError, match="hang deadline would be 0"):
        CardDeadlines(multiple=0, floor_s=0)
    with pytest.raises(ValueError, match="hedge_fraction must be in \\[0, 1\\)"):
        CardDeadlines(hedge_fraction=1.0)


def test_the_expected_time_is_what_the_simulated_card_charges(rm1) -> None:
    card = _cards(rm1, [{}])[0]
    _, partitioned = rm1
    host = load_host_stage(partitioned, load_spec("host-cpu"))
    request = _request(64)
    inputs = {**request, **host.run({n: request[n] for n in host.input_names})}
    inputs = {n: inputs[n] for n in card.input_names}
    outputs = card.run(inputs)
    charged = service_seconds(card.device, card.artifact, 64, sum(a.nbytes for a in inputs.values()),
                              sum(a.nbytes for a in outputs.values()))
    assert expected_card_seconds(card, 64, inputs) == pytest.approx(charged, rel=1e-9)
    throttled = _cards(rm1, [{"slow_factor": 3.0}])[0]  # a card's own model of its time is what counts
    assert expected_card_seconds(throttled, 64, inputs) == pytest.approx(3 * charged, rel=1e-9)
    throttled.close()
    card.close()
    host.close()


async def test_a_stalled_simcard_answers_late_through_its_clock() -> None:
    clock = FakeClock()
    model = mlp()
    exe = SimCardBackend(clock=clock, sleep=clock.sleep, faults={"crash_after": 1, "stall_s": 2.5}).load(
        model.artifact(flops_per_item=1e6), device())
    await exe.infer(batch(model, 1))
    await exe.infer(batch(model, 1))
    assert clock.sleeps[1] == 2.5 and exe.stats().batches == 2  # stalled, then served
    exe.close()
    with pytest.raises(Exception, match="faults.stall_s must be a number >= 0"):
        SimCardBackend(faults={"stall_s": -1})


async def test_a_hung_card_is_detected_at_its_derived_deadline_not_the_fixed_cap(rm1) -> None:
    # A slow spec: this batch's expected card time is 0.1 s, so the deadline is 4 x 0.1 s (floor 0.05, cap 30).
    request = _request(5, seed=1)
    m2 = load_spec("m2-card")
    flops = rm1[1].artifacts[DENSE_PARTITION].flops_per_item * 5
    slow = dataclasses.replace(m2, peak_flops={"fp32": flops / (0.1 * m2.efficiency)})
    runtime = _runtime(rm1, _cards(rm1, [{"hang": True}, {}], spec=slow), card_timeout_multiple=4,
                       card_timeout_floor_s=0.05, hedge_fraction=0)
    runtime.router.loads[1].last_used = 10  # card0 is the first pick
    t0 = time.perf_counter()
    out = await asyncio.wait_for(runtime.run(request, BatchInfo()), 10)
    elapsed = time.perf_counter() - t0
    np.testing.assert_allclose(out["scores"], _expected(rm1, request), atol=ATOL)
    # card0 hangs for 0.4 s (+ the 0.1 s expected on it), then card1 answers in its 0.1 s
    assert 0.45 <= elapsed < 2.0, elapsed
    assert runtime.fault_counts == {(0, "hang"): 1} and not runtime.router.loads[0].healthy
    assert runtime.card_state[0].startswith("hung (> 0.4")
    assert _idle(runtime)
    runtime.close()


async def test_a_stalled_batch_is_answered_by_a_hedged_copy_and_the_slow_card_stays_in(rm1) -> None:
    # card0 answers 0.8 s late; its deadline is the 2 s floor, the hedge point a tenth of it.
    runtime = _runtime(rm1, _cards(rm1, [{"stall_s": 0.8}, {}, {}]), card_timeout_floor_s=2.0, hedge_fraction=0.1)
    runtime.router.loads[1].last_used = runtime.router.loads[2].last_used = 10
    request = _request(7, seed=2)
    t0 = time.perf_counter()
    out = await asyncio.wait_for(runtime.run(request, BatchInfo()), 10)
    elapsed = time.perf_counter() - t0
    np.testing.assert_allclose(out["scores"], _expected(rm1, request), atol=ATOL)
    assert elapsed < 0.7, elapsed  # before card0's stall ends: the copy answered
    assert (runtime.hedges, runtime.hedge_wins) == (1, 1)
    assert runtime.router.loads[0].outstanding_batches == 1  # card0 still works on the copy no one waits for
    await _until(lambda: _idle(runtime), timeout=5)
    assert runtime.fault_counts == {(0, "late"): 1} and runtime.router.healthy == [0, 1, 2]
    runtime.close()


async def test_a_hedged_card_that_then_passes_its_deadline_is_taken_out(rm1) -> None:
    runtime = _runtime(rm1, _cards(rm1, [{"hang": True}, {}]), card_timeout_floor_s=0.4)
    runtime.router.loads[1].last_used = 10
    request = _request(3, seed=3)
    t0 = time.perf_counter()
    out = await asyncio.wait_for(runtime.run(request, BatchInfo()), 10)
    assert time.perf_counter() - t0 < 0.35  # the hedge at 0.1 s answered
    np.testing.assert_allclose(out["scores"], _expected(rm1, request), atol=ATOL)
    assert runtime.router.loads[0].healthy
    await _until(lambda: not runtime.router.loads[0].healthy, timeout=5)  # its own deadline passed
    assert runtime.fault_counts == {(0, "late"): 1, (0, "hang"): 1}
    assert _idle(runtime)
    runtime.close()


async def test_every_card_out_without_a_host_fallback_fails_fast_naming_each_card(rm1) -> None:
    runtime = _runtime(rm1, _cards(rm1, [{"crash_after": 0}, {"hang": True}]), card_timeout_floor_s=0.3,
                       hedge_fraction=0)
    runtime.router.loads[1].last_used = 10  # card0 first: it fails, the retry on card1 hangs
    with pytest.raises(CardHang, match="batch failed on 2 card\\(s\\): card0 failed .*crashed.*; card1 hung") as info:
        await asyncio.wait_for(runtime.run(_request(2), BatchInfo()), 10)
    assert info.value.reason == "card_hang"
    t0 = time.perf_counter()
    with pytest.raises(NoHealthyCardLeft, match="all 2 cards unhealthy: card0 failed \\(BackendError: .*\\); "
                                                "card1 hung \\(> 0.30 s\\)$") as info:
        await asyncio.wait_for(runtime.run(_request(2), BatchInfo()), 10)
    assert time.perf_counter() - t0 < 0.2 and info.value.reason == "no_healthy_card"
    assert info.value.code.name == "UNAVAILABLE" and _idle(runtime)
    runtime.close()


@pytest.fixture
def hung_server(rm1, request):
    """Three simulated cards that never answer (nor do their restarts), behind a real gRPC server."""
    _, partitioned = rm1
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", backend_options={"faults": {"hang": True}},
                              metrics=metrics, batching=BatchingConfig(max_batch_rows=64),
                              host_dense_max_rows=request.param, card_timeout_floor_s=0.3)
    # NOTE: no warm-up: it would find the hung cards first, and the test counts what its own requests see
    background = BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None, warmup=False),
                                  metrics).start()
    try:
        yield served, background, metrics
    finally:
        background.stop()


async def _infer(client, request) -> tuple[float, np.ndarray | InferenceServerException]:
    t0 = time.perf_counter()
    try:
        result = await client.infer("rm1", triton_inputs(tca, request), client_timeout=20)
        return time.perf_counter() - t0, result.as_numpy("scores")
    except InferenceServerException as exc:
        return time.perf_counter() - t0, exc


@pytest.mark.parametrize("hung_server", [-1], indirect=True)
async def test_every_card_hung_the_host_answers_every_request_correctly_and_in_time(rm1, hung_server) -> None:
    served, background, metrics = hung_server
    requests = [_request(1 + (i * 7) % 40, seed=i) for i in range(36)]
    async with tca.InferenceServerClient(background.url) as client:
        results = []
        for wave in range(3):  # three waves of 12 at once
            results += await asyncio.gather(*(_infer(client, r) for r in requests[wave * 12:(wave + 1) * 12]))
    for request, (latency, scores) in zip(requests, results):
        assert isinstance(scores, np.ndarray), (scores.status(), scores.message(), latency)
        np.testing.assert_allclose(scores, _expected(rm1, request), atol=1e-4)
        # the floor (0.3 s) + a margin for a busy 2-core machine; the old fixed timeout was 30 s
        assert latency < 1.5, latency
    runtime = served.runtime
    assert runtime.host_fallbacks >= 1 and runtime.router.healthy == []
    sample = metrics.registry.get_sample_value
    hangs = sum(sample("sixfold_card_faults_total", {"model": "rm1", "card": f"card{i}", "lane": "", "kind": "hang"}) or 0
                for i in range(3))
    assert hangs >= 3 and hangs == sum(n for (_, kind), n in runtime.fault_counts.items() if kind == "hang")
    assert sample("sixfold_inference_request_failure_total", {"model": "rm1", "reason": "card_hang"}) is None
    assert sample("sixfold_host_dense_batches_total", {"model": "rm1"}) >= 1


@pytest.mark.parametrize("hung_server", [0], indirect=True)
async def test_every_card_hung_and_no_host_dense_fails_fast_and_counts_each_reason(rm1, hung_server) -> None:
    served, background, metrics = hung_server
    assert served.runtime.host_dense is None
    async with tca.InferenceServerClient(background.url) as client:
        first = []
        for i in range(12):  # one at a time until every card has hung (each batch tries two)
            first.append(await _infer(client, _request(3, seed=i)))
            if not served.runtime.router.healthy:
                break
        assert served.runtime.router.healthy == [] and len(first) >= 2
        later = await asyncio.gather(*(_infer(client, _request(3, seed=i)) for i in range(6)))
    for latency, error in first + later:
        assert isinstance(error, InferenceServerException) and error.status() == "StatusCode.UNAVAILABLE", error
        assert latency < 1.5, latency  # a card's floor (0.3 s) x two tries + margin, not 30 s
    for latency, error in later:
        assert latency < 0.5 and "all 3 cards unhealthy: card0 hung (> 0.30 s)" in error.message(), error
    sample = metrics.registry.get_sample_value
    by_reason = {reason: sample("sixfold_inference_request_failure_total", {"model": "rm1", "reason": reason}) or 0
                 for reason in ("card_hang", "card_error", "no_healthy_card")}
    assert sum(by_reason.values()) == len(first + later)  # every failure a client saw, counted by its reason
    assert by_reason["no_healthy_card"] >= len(later) and by_reason["card_hang"] >= 1


async def test_a_healthy_busy_runtime_sees_no_hang(rm1) -> None:
    """No false positives: 6 cards, batches of 1..256 rows, 8 at a time on this (shared) machine."""
    runtime = _runtime(rm1, _cards(rm1, [{}] * 6), max_card_rows=256)
    requests = [_request(1 + (i * 37) % 256, seed=i) for i in range(48)]
    for wave in range(6):
        chunk = requests[wave * 8:(wave + 1) * 8]
        outs = await asyncio.wait_for(asyncio.gather(*(runtime.run(r, BatchInfo()) for r in chunk)), 60)
        for request, out in zip(chunk, outs):
            np.testing.assert_allclose(out["scores"], _expected(rm1, request), atol=1e-4)
    assert not any(kind in ("hang", "error") for _, kind in runtime.fault_counts), runtime.fault_counts
    assert runtime.router.healthy == list(range(6))
    await _until(lambda: _idle(runtime), timeout=5)
    runtime.close()


def test_a_models_config_pbtxt_sets_its_card_deadlines(rm1, tmp_path) -> None:
    _, partitioned = rm1
    write_artifacts(partitioned, tmp_path / "repo" / "rm1" / "1")
    (tmp_path / "repo" / "rm1" / "config.pbtxt").write_text(
        'parameters { key: "sixfold.card_timeout_floor_ms" value { string_value: "250" } }\n'
        'parameters { key: "sixfold.card_timeout_multiple" value { string_value: "2.5" } }\n')
    metrics = ServerMetrics()
    served = load_from_repository(ModelRepository(tmp_path / "repo"), "rm1", "1", backend="simcard",
                                  metrics=metrics, batching=BatchingConfig(), card_timeout_floor_s=9.0)
    try:
        assert (served.runtime.deadlines.floor_s, served.runtime.deadlines.multiple) == (0.25, 2.5)
        served.runtime.on_card_fault(1, "late")  # the loader wired the runtime's faults to the metrics
        assert metrics.registry.get_sample_value("sixfold_card_faults_total",
                                                 {"model": "rm1", "card": "card1", "lane": "", "kind": "late"}) == 1
    finally:
        served.runtime.close()
    (tmp_path / "repo" / "rm1" / "config.pbtxt").write_text(
        'parameters { key: "sixfold.card_timeout_multiple" value { string_value: "-1" } }\n')
    with pytest.raises(ValueError, match="sixfold.card_timeout_multiple.*must be a finite number >= 0"):
        load_from_repository(ModelRepository(tmp_path / "repo"), "rm1", "1", backend="simcard",
                             metrics=metrics, batching=BatchingConfig())


async def test_closing_while_a_hedged_copy_runs_gives_no_verdict_on_its_card(rm1) -> None:
    runtime = _runtime(rm1, _cards(rm1, [{"hang": True}, {}]), card_timeout_floor_s=1.0, hedge_fraction=0.1)
    runtime.router.loads[1].last_used = 10
    await asyncio.wait_for(runtime.run(_request(2), BatchInfo()), 10)  # card1's copy answered at ~0.1 s
    assert runtime.router.loads[0].outstanding_batches == 1  # card0's copy is still watched
    runtime.close()
    await asyncio.sleep(0.05)
    assert runtime.fault_counts == {(0, "late"): 1} and runtime.router.healthy == [0, 1] and _idle(runtime)
