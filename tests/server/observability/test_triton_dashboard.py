"""Triton's published Kubernetes dashboard, read against sixfold's /metrics: one process and two workers.

The dashboard's queries (``triton_dashboard.json``) are parsed for the metrics and labels they use
and evaluated over two real scrapes of a real ``sixfold-serve`` (``promql.py``), with the target
labels Prometheus adds. Every query must find its series and carry data; the page of two workers
must be the page of one process: the same families, types and label names.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.server.observability.metrics import TRITON_REASONS
from tests.conftest import ServeProcess, triton_inputs
from tests.server.observability.promql import Scrape, evaluate, parse, scrape

DASHBOARD = json.loads((Path(__file__).parent / "triton_dashboard.json").read_text())
TARGET = {"pod": "sixfold-0", "instance": "10.0.0.7:8002", "job": "sixfold"}
REQUESTS = 16
"""Requests each server answers, each on a fresh channel (with 2 workers, all on one has odds of 2**-15)."""
KINDS = ("one-process", "two-workers")
WORKERS = 2
"""The workers of the "two-workers" server (checked by hand at 4 too: closing note of issue 34)."""


@pytest.fixture(scope="module")
def servers():
    """Both servers, started side by side: (process, metrics URL) by kind."""
    started = {}
    try:
        for kind in KINDS:
            extra = ("--workers", str(WORKERS)) if kind == "two-workers" else ()
            started[kind] = ServeProcess("--model", "tiny", "--grpc-port", "0", "--metrics-port", "0", *extra,
                                         timeout=0)
        urls = {}
        for kind, proc in started.items():
            assert proc.wait_ready(300), proc.output
            found = re.search(r"metrics of all workers on [^:]+:(\d+)", proc.output) or \
                re.search(r"metrics https?://[^:]+:(\d+)/metrics", proc.output)
            assert found, proc.output
            urls[kind] = f"http://127.0.0.1:{found.group(1)}/metrics"
        yield {kind: (started[kind], urls[kind]) for kind in KINDS}
    finally:
        for proc in started.values():
            proc.stop()


def _scrape(url: str) -> Scrape:
    page = urllib.request.urlopen(url, timeout=10).read().decode()
    return scrape(page, time.monotonic(), TARGET)


def _traffic(url: str) -> None:
    """REQUESTS answered, each on its own channel, and one refused (a wrong shape: a failure, OTHER)."""
    request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=7).make(8)
    for _ in range(REQUESTS):
        with tc.InferenceServerClient(url) as client:
            assert client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores").shape == (8, 1)
    wrong = {name: np.concatenate([array, array[:1]]) if name == "dense_features" else array
             for name, array in request.items()}
    with tc.InferenceServerClient(url) as client, pytest.raises(InferenceServerException):
        client.infer("tiny", triton_inputs(tc, wrong))


@pytest.fixture(scope="module")
def scrapes(servers):
    """(before, after) the traffic, by kind."""
    out = {}
    for kind, (proc, url) in servers.items():
        before = _scrape(url)
        _traffic(proc.url)
        time.sleep(0.2)
        out[kind] = (before, _scrape(url))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_every_series_is_there_before_the_first_request(scrapes, kind):
    before, _ = scrapes[kind]
    version = frozenset({("model", "tiny"), ("version", "1"), *TARGET.items()})
    for name in ("nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count",
                 "nv_inference_request_duration_us",
                 "nv_inference_queue_duration_us", "nv_inference_compute_input_duration_us",
                 "nv_inference_compute_infer_duration_us", "nv_inference_compute_output_duration_us",
                 "nv_inference_pending_request_count"):
        assert before.samples[name] == {version: 0.0}, name  # warm-up batches are not counted
    failures = before.samples["nv_inference_request_failure"]
    assert {dict(labels)["reason"] for labels in failures} == set(TRITON_REASONS) and not any(failures.values())
    for name in ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"):
        assert set(before.samples[name]) == {frozenset(TARGET.items())}, name   # one host, unlabelled
    cards = {dict(labels)["card"] for labels in before.samples["sixfold_card_healthy"]}
    assert cards and set(before.samples["sixfold_card_healthy"].values()) == {1.0}


@pytest.mark.parametrize("kind", KINDS)
def test_tritons_dashboard_queries_find_their_series_and_carry_data(scrapes, kind):
    before, after = scrapes[kind]
    for panel in DASHBOARD["queries"]:
        query = parse(panel["expr"])
        for name in query.metrics:  # written as Triton writes it: a counter with no _total
            assert after.types.get(name) == "counter" and name in after.samples, (panel["panel"], name)
        labelled = set().union(*(dict(labels) for name in query.metrics for labels in after.samples[name]))
        assert query.labels <= labelled, (panel["panel"], query.labels - labelled)
        result = evaluate(query, before, after)
        assert isinstance(result, dict) and result, (panel["panel"], result)
        assert all(math.isfinite(v) and v > 0 for v in result.values()), (panel["panel"], result)
    assert evaluate("sum(nv_inference_request_success)", before, after) == {frozenset(): REQUESTS}
    assert evaluate("sum by (pod) (rate(nv_inference_count[1m])) / ignoring(pod) group_left "
                    "sum (rate(nv_inference_count[1m]))", before, after) == {frozenset({("pod", "sixfold-0")}): 1.0}
    failed = evaluate('sum by (reason, sixfold_reason) (increase(nv_inference_request_failure[1m]))', before, after)
    assert {k: v for k, v in failed.items() if v} == {frozenset({("reason", "OTHER"),
                                                                 ("sixfold_reason", "invalid_input")}): 1.0}


def _schema(page: Scrape) -> dict[str, tuple[str, frozenset[frozenset[str]]]]:
    """Family -> (type, the label-name sets of its samples), without the target's labels."""
    out = {}
    for name, kind in page.types.items():
        names = frozenset(frozenset(k for k, _ in labels if k not in TARGET)
                          for sample, series in page.samples.items() if sample.startswith(name)
                          for labels in series)
        out[name] = (kind, names)
    return out


def test_two_workers_write_one_process_page(scrapes):
    one, two = (_schema(scrapes[kind][1]) for kind in KINDS)
    per_worker = {name for name, (_, labels) in two.items() if any("worker" in names for names in labels)}
    assert {n for n in per_worker if n.startswith(("nv_", "sixfold_card_", "sixfold_inference"))} == set()
    assert {n for n in two if n.startswith("sixfold_worker_")} == {
        "sixfold_worker_up", "sixfold_worker_inference_request_success_total", "sixfold_worker_pending_request_count"}
    for name, (kind, labels) in one.items():
        if name not in per_worker:
            assert two.get(name) == (kind, labels), name
    _, after = scrapes["two-workers"]
    served = after.samples["sixfold_worker_inference_request_success_total"]
    assert sum(served.values()) == REQUESTS and len(served) == WORKERS
    # the same cards, holding the partitions once: one engine serves every front end
    one_cards, two_cards = (scrapes[kind][1].samples for kind in KINDS)
    for labels, total in one_cards["sixfold_card_memory_total_bytes"].items():
        assert two_cards["sixfold_card_memory_total_bytes"][labels] == total
        used = one_cards["sixfold_card_memory_used_bytes"][labels]
        assert two_cards["sixfold_card_memory_used_bytes"][labels] == used
