"""A request that every model would refuse is refused before its message is read (real gRPC and REST, stock tritonclient).

rm1 on throttled simcards (one batch of a few rows holds a card ~0.2 s), one batch at a time and one
request queued at most: one request running and one queued, a burst of 6 more that
find the queue full are refused RESOURCE_EXHAUSTED with the scheduler's reason, before their bytes are
read (``DynamicBatcher.refusal_before_read`` via the receive budget's ``unread_refusal``). Every
request is answered or refused, nothing stays held, and the server answers at once afterwards.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.errors import Overloaded
from sixfold.server.scheduling.batcher import BatchingConfig
from tests.conftest import triton_inputs

ROWS = 4
UNREAD = "refused before its message was read"


@pytest.fixture(scope="module")
def slow_rm1():
    _, partitioned = partition_builtin("rm1", max_rows=300, seed=1, cards=1)
    metrics = ServerMetrics()
    batching = BatchingConfig(max_batch_rows=ROWS, max_queue_delay_microseconds=0, max_inflight_batches=1,
                              max_queue_size=1)
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=batching,
                              backend_options={"faults": {"slow_factor": 4000.0}}, host_dense_max_rows=0)
    background = BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, http_port=0, metrics_port=None,
                                                                        warmup=False), metrics).start()
    try:
        yield background, metrics
    finally:
        background.stop()


def _send(url: str, inputs: list) -> str:
    with tc.InferenceServerClient(url) as client:
        try:
            client.infer("rm1", inputs, client_timeout=30)
            return "OK"
        except InferenceServerException as exc:
            return f"{exc.status()}: {exc.message()}"


@pytest.mark.timeout(120)
def test_a_burst_past_a_full_queue_is_refused_unread_and_every_request_is_answered_or_refused(slow_rm1) -> None:
    background, metrics = slow_rm1
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=4).make(ROWS)
    inputs = triton_inputs(tc, request)
    with ThreadPoolExecutor(8) as pool:
        # NOTE: one to run, one to queue, then the burst once they are in: handlers that start in the same
        # turn of the loop all pass the check before any of them is queued (and are refused once read)
        first = [pool.submit(_send, background.url, inputs)]
        time.sleep(0.05)
        first.append(pool.submit(_send, background.url, inputs))
        time.sleep(0.1)
        burst = [pool.submit(_send, background.url, inputs) for _ in range(6)]
        outcomes = [f.result(timeout=60) for f in first + burst]
    answered = [o for o in outcomes if o == "OK"]
    refused = [o for o in outcomes if o.startswith("StatusCode.RESOURCE_EXHAUSTED")]
    assert len(answered) + len(refused) == len(outcomes), outcomes  # nothing else: no timeout, no INTERNAL
    assert 1 <= len(answered) <= 3, outcomes  # one running, one queued (and one more if a batch ended meanwhile)
    unread = [o for o in refused if UNREAD in o and "queue full" in o and "max_queue_size 1" in o]
    assert unread, outcomes
    assert metrics.refused.labels("grpc", "overloaded")._value.get() >= len(unread)
    # Nothing stays held, and once the burst is gone a request is admitted and answered.
    assert background.server.receive_budget.held == 0
    assert _send(background.url, inputs) == "OK"


async def test_the_check_before_a_read_agrees_with_enqueue_and_counts_requests_still_being_read() -> None:
    """``refusal_before_read`` on the real batcher (batches held on the card, the test's clock): None while a
    request might be admitted; the work bound's refusal once the work ahead passes it with no slot free;
    and requests still being read count as mean admitted requests (10 ms each here) taking slots."""
    from tests.server.scheduling.test_admission import FakeClock, HeldModel, _drain, _one_at_a_time, _request, \
        _settle, per_row_ms

    model = HeldModel()
    batcher = _one_at_a_time(model, clock=FakeClock(), cost=per_row_ms(10), max_queue_work_ms=30)
    assert batcher.refusal_before_read() is None  # idle: a slot is free
    assert batcher.refusal_before_read(reading=1) is None  # that read takes the slot, nothing waits ahead
    running = [asyncio.ensure_future(batcher.submit(_request(1), 1)) for _ in range(4)]
    await _settle()  # one on the card, 30 ms of work queued: at the bound, not over it
    assert batcher.refusal_before_read() is None
    reason = batcher.refusal_before_read(reading=1)  # + one mean request being read: 40 ms ahead
    assert reason is not None and "40.0 ms of work waiting ahead exceeds max_queue_work_ms 30" in reason
    assert "refused before its message was read" in reason
    running.append(asyncio.ensure_future(batcher.submit(_request(1), 1)))
    await _settle()
    reason = batcher.refusal_before_read()
    assert reason is not None and "40.0 ms" in reason
    with pytest.raises(Overloaded, match=r"40\.0 ms of work waiting ahead"):  # enqueue says the same
        batcher.enqueue(_request(1), 1)
    model.gate.set()
    await _drain(running)
    assert batcher.refusal_before_read() is None
    await batcher.close()


async def test_with_priorities_on_nothing_is_refused_unread() -> None:
    from tests.server.scheduling.test_admission import FakeClock, HeldModel, _one_at_a_time, per_row_ms

    batcher = _one_at_a_time(HeldModel(), clock=FakeClock(), cost=per_row_ms(10), max_queue_work_ms=30,
                             max_queue_size=1, priority_levels=2, default_priority_level=2)
    assert batcher.refusal_before_read(reading=100) is None  # a message may ask for the higher level
    await batcher.close()


# REST: the model its path names is asked before the body is read (429, counted as rest/overloaded)

def _send_rest(url: str, request: dict) -> str:
    client = th.InferenceServerClient(url, network_timeout=30.0)
    try:
        client.infer("rm1", triton_inputs(th, request))
        return "OK"
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}"
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_rest_burst_past_a_full_queue_is_refused_unread_and_the_server_keeps_serving(slow_rm1) -> None:
    background, metrics = slow_rm1
    url = background.http_url
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=4).make(ROWS)
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(_send_rest, url, request)]
        time.sleep(0.05)
        first.append(pool.submit(_send_rest, url, request))
        time.sleep(0.1)
        burst = [pool.submit(_send_rest, url, request) for _ in range(6)]
        outcomes = [f.result(timeout=60) for f in first + burst]
    answered = [o for o in outcomes if o == "OK"]
    refused = [o for o in outcomes if o.startswith("429")]
    assert len(answered) + len(refused) == len(outcomes), outcomes  # nothing else: no 500, no timeout
    assert 1 <= len(answered) <= 3, outcomes
    unread = [o for o in refused if UNREAD in o and "max_queue_size 1" in o]
    assert unread, outcomes
    assert metrics.refused.labels("rest", "overloaded")._value.get() >= len(unread)
    # once the burst is gone, one client is refused nothing and answered twice on its connection
    client = th.InferenceServerClient(url, network_timeout=30.0)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                client.infer("rm1", triton_inputs(th, request))
                break
            except InferenceServerException:
                assert time.monotonic() < deadline, "the server did not admit a request after the burst"
                time.sleep(0.2)
        client.infer("rm1", triton_inputs(th, request))
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_an_unknown_model_is_404_before_its_body_is_read(slow_rm1) -> None:
    background, _ = slow_rm1
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=4).make(ROWS)
    client = th.InferenceServerClient(background.http_url, network_timeout=30.0)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer("no-such-model", triton_inputs(th, request))
        assert info.value.status() == "404" and "no-such-model" in info.value.message()
    finally:
        client.close()
