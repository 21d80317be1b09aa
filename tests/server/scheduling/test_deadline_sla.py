"""A client's deadline is the SLA its request is admitted against (``sixfold-serve`` with no SLA stated).

Real: ``sixfold-serve`` with one simulated card whose every batch takes 0.2 s (a stall fault), requests
over real gRPC from stock tritonclient, sent together from threads. Without a deadline, the 30 ms
default work bound refuses most of a burst; with a 10 s deadline, the same burst queues and is served;
with a deadline too short for the work ahead, the refusal names the deadline; ``sixfold-loadgen
--deadline-ms`` sends such deadlines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time

import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.loadgen import LoadConfig, run_load_async
from tests.conftest import ServeProcess, triton_inputs

BURST = 8


def _burst(url: str, timeout_s: float | None) -> list[str]:
    """Send BURST one-item requests at once; each outcome: 'ok' or the error's status and message."""
    request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=3).make(1)

    def one(_: int) -> str:
        with tc.InferenceServerClient(url) as client:
            try:
                client.infer("tiny", triton_inputs(tc, request), client_timeout=timeout_s)
                return "ok"
            except InferenceServerException as exc:
                return f"{exc.status()} {exc.message()}"

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        return list(pool.map(one, range(BURST), timeout=60))


def test_a_loose_client_deadline_queues_deeper_and_a_tight_one_is_refused_early() -> None:
    serve = ServeProcess("--model", "tiny", "--backend", "simcard", "--cards", "1",
                         "--backend-option", 'faults={"stall_s": 0.2}', "--host-dense-max-rows", "0",
                         "--grpc-port", "0", "--metrics-port", "-1")
    try:
        assert serve.url, serve.output
        first = _burst(serve.url, None)  # teaches the batcher the 0.2 s service time
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            outcomes = _burst(serve.url, None)
            refused = [o for o in outcomes if "queue full of work" in o]
            if refused:
                break
        assert refused, (first, outcomes)
        assert all("max_queue_work_ms 30" in o for o in refused), refused
        loose = _burst(serve.url, 10.0)
        assert loose == ["ok"] * BURST, loose
        tight = _burst(serve.url, 0.25)
        early = [o for o in tight if "queue full of work" in o]
        # the deadline left when the request arrives: 250 ms less the time on the wire
        assert early and all(re.search(r"0\.5 of this request's 2[0-5]\d ms deadline", o) for o in early), tight
        # sixfold-loadgen --deadline-ms sends the deadline: a 50 ms one cannot be met by 0.2 s batches
        report = asyncio.run(run_load_async(LoadConfig(url=serve.url, model="tiny", qps=0, duration_s=5.0,
                                                       concurrency=4, query_size="fixed:1", max_requests=12,
                                                       deadline_s=0.05)))
        assert report.requests.get("ok", 0) <= 4, report.requests  # at most the first ones, on an idle card
        reasons = set(report.errors_by_reason)
        assert reasons and reasons <= {"deadline_exceeded", "resource_exhausted"}, report.errors_by_reason
    finally:
        serve.kill()
