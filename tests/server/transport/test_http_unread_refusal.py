"""REST refuses an inference the named model's batcher would refuse before reading its body (stock tritonclient.http).

rm1 on throttled simcards (a batch holds a card ~0.2 s), one batch at a time and one request queued at most: a
burst past that is answered 429 naming the full queue and saying the body was not read; every request is answered
or refused, the same client is served afterwards (a refusal that leaves the body unread closes the connection
cleanly), and the refusals are counted on /metrics' refused counter.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_partitioned
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig
from tests.conftest import triton_inputs

ROWS = 4
UNREAD = "refused before its message was read"


@pytest.fixture(scope="module")
def slow_rm1_rest():
    _, partitioned = partition_builtin("rm1", max_rows=300, seed=1, cards=1)
    metrics = ServerMetrics()
    batching = BatchingConfig(max_batch_rows=ROWS, max_queue_delay_microseconds=0, max_inflight_batches=1,
                              max_queue_size=1)
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=batching,
                              backend_options={"faults": {"slow_factor": 4000.0}}, host_dense_max_rows=0)
    config = ServerConfig(grpc_port=0, http_port=0, metrics_port=None, warmup=False)
    background = BackgroundServer(InferenceCore([served]), config, metrics).start()
    try:
        yield background, metrics
    finally:
        background.stop()


def _send(url: str, request: dict) -> str:
    client = th.InferenceServerClient(url, network_timeout=30.0)
    try:
        client.infer("rm1", triton_inputs(th, request))
        return "OK"
    except InferenceServerException as exc:
        return f"{exc.status()}: {exc.message()}"
    finally:
        client.close()


@pytest.mark.timeout(120)
def test_a_rest_burst_past_a_full_queue_is_refused_unread_and_the_server_keeps_serving(slow_rm1_rest) -> None:
    background, metrics = slow_rm1_rest
    url = background.http_url
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=4).make(ROWS)
    with ThreadPoolExecutor(8) as pool:
        first = [pool.submit(_send, url, request)]
        time.sleep(0.05)
        first.append(pool.submit(_send, url, request))
        time.sleep(0.1)
        burst = [pool.submit(_send, url, request) for _ in range(6)]
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
def test_an_unknown_model_is_404_before_its_body_is_read(slow_rm1_rest) -> None:
    background, _ = slow_rm1_rest
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=4).make(ROWS)
    client = th.InferenceServerClient(background.http_url, network_timeout=30.0)
    try:
        with pytest.raises(InferenceServerException) as info:
            client.infer("no-such-model", triton_inputs(th, request))
        assert info.value.status() == "404" and "no-such-model" in info.value.message()
    finally:
        client.close()
