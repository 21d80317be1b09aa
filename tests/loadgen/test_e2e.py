"""Whole runs over real loopback gRPC against the fake KServe v2 server (real clock, loose bounds)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from sixfold.loadgen import LoadConfig, LoadgenError, run_load_async
from tests.conftest import free_port

from tests.loadgen.fake_server import Stall


def config(server, **kw) -> LoadConfig:
    base = dict(url=server.url, model="fake-rm", qps=100.0, duration_s=1.5, query_size="fixed:4",
                wait_ready_s=5.0, drain_timeout_s=2.0, pool=4)
    return LoadConfig(**{**base, **kw})


def consistent(report) -> None:
    req = report.requests
    assert req["sent"] == req["ok"] + req["errors"]
    assert sum(report.errors_by_reason.values()) == req["errors"]
    assert sum(r["sent"] for r in report.timeline) == req["sent"]


@pytest.mark.parametrize("client", ["raw", "tritonclient"])
async def test_known_latency_gives_known_percentiles_and_rate(fake_server, client):
    server = fake_server(latency_s=0.020)
    report = await run_load_async(config(server, arrival="constant", client=client))
    consistent(report)
    assert report.requests == {"scheduled": 150, "sent": 150, "ok": 150, "errors": 0, "unsent": 0}
    assert 20.0 <= report.latency_ms["p50"] <= 50.0
    assert report.latency_ms["min"] >= 20.0
    assert report.achieved_qps == pytest.approx(100.0, rel=0.1)
    assert report.items_per_s == pytest.approx(400.0, rel=0.1)
    assert report.query_size["mean"] == 4 and report.query_size["max"] == 4
    assert server.seen.invalid == [] and len(server.seen.sizes) == 150
    assert not any(w.startswith("few samples") for w in report.warnings)  # 150 answers: p99 is not the max
    # The server saw the constant schedule: gaps of ~10 ms.
    assert np.median(np.diff(server.seen.arrivals)) == pytest.approx(0.010, abs=0.003)


async def test_server_stall_shows_in_the_tail(fake_server):
    """Requests arriving in a 300 ms window wait 300 ms more; an open-loop client keeps sending."""
    server = fake_server(latency_s=0.005, stall=Stall(0.5, 0.8, 0.3))
    report = await run_load_async(config(server, qps=100.0, duration_s=2.0, query_size="mlperf"))
    consistent(report)
    assert report.requests["errors"] == 0
    assert report.latency_ms["p99"] >= 300.0
    assert report.latency_ms["p50"] <= 40.0
    stalled = [r for r in report.timeline if r["p99_ms"] is not None and r["p99_ms"] >= 300.0]
    assert stalled and stalled[0]["t"] in (0, 1)
    # Open loop: the client did not stop sending while the server stalled.
    first = server.seen.arrivals[0]
    during = [a for a in server.seen.arrivals if 0.5 <= a - first < 0.8]
    assert len(during) >= 15
    assert 100 <= report.query_size["mean"] <= 700 and server.seen.invalid == []


async def test_unanswered_requests_time_out_and_the_run_ends(fake_server):
    server = fake_server(latency_s=5.0)
    started = time.monotonic()
    report = await run_load_async(config(server, duration_s=0.3, drain_timeout_s=0.3))
    assert time.monotonic() - started < 4.5  # the server answers after 5 s: the run ended without waiting for it
    consistent(report)
    assert report.requests["ok"] == 0 and report.errors_by_reason == {"timeout": report.requests["sent"]}
    assert report.latency_ms["p50"] is None


async def test_max_requests_and_warmup(fake_server):
    server = fake_server(latency_s=0.002)
    report = await run_load_async(config(server, qps=200.0, warmup_s=0.3, duration_s=2.0, max_requests=100,
                                         arrival="constant"))
    consistent(report)
    assert len(server.seen.sizes) == 100
    assert report.warmup["sent"] == 60 and report.requests["sent"] == 40
    assert report.duration_s == pytest.approx(0.2, abs=1e-6)
    assert any("cut the schedule short" in w for w in report.warnings)


async def test_model_without_sixfold_parameters_needs_table_rows(fake_server):
    server = fake_server(sixfold_params=False, table_rows=(1000, 1000, 1000))
    with pytest.raises(LoadgenError, match="--table-rows"):
        await run_load_async(config(server, duration_s=0.2))
    report = await run_load_async(config(server, duration_s=0.5, table_rows=(1000,), pooling=(3,)))
    consistent(report)
    assert report.requests["errors"] == 0 and server.seen.invalid == []
    assert report.target["table_rows"] == [1000, 1000, 1000]
    assert report.target["sources"]["table_rows"] == "flag"


async def test_unknown_model_fails_fast(fake_server):
    server = fake_server()
    started = time.monotonic()
    with pytest.raises(LoadgenError, match="unknown model 'nope'"):
        await run_load_async(config(server, model="nope", wait_ready_s=10.0))
    assert time.monotonic() - started < 8.0  # well short of the 10 s it would wait for a server that is not up


async def test_waits_for_a_server_that_starts_late(fake_server):
    port = free_port()
    url = f"127.0.0.1:{port}"
    run = asyncio.ensure_future(run_load_async(LoadConfig(url=url, model="fake-rm", qps=50.0, duration_s=0.3,
                                                          query_size="fixed:2", wait_ready_s=10.0)))
    await asyncio.sleep(1.2)
    assert not run.done()
    started = time.monotonic()
    await asyncio.to_thread(fake_server, port=port)
    report = await asyncio.wait_for(run, timeout=10.0)
    assert time.monotonic() - started < 3.0  # noticed within a reconnect backoff
    assert report.requests["ok"] == report.requests["sent"] > 0


async def test_a_tail_resting_on_few_answers_is_flagged(fake_server):
    """12 answers: nearest-rank p99 is the slowest of them; the report says so, with the count."""
    server = fake_server(latency_s=0.002)
    report = await run_load_async(config(server, qps=12.0, duration_s=1.0, arrival="constant"))
    assert report.requests["ok"] == 12 and report.latency_ms["p99"] == report.latency_ms["max"]
    [warning] = [w for w in report.warnings if w.startswith("few samples")]
    assert "rest on 12 answered requests" in warning and "100" in warning
