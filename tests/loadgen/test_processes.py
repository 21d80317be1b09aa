"""--processes: one open-loop run spread over several generator processes, merged into one report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadgen.cli import main
from loadgen.config import LoadConfig
from loadgen.multiprocess import run_load_processes


def _config(server, **fields) -> LoadConfig:
    base = dict(url=server.url, model="fake-rm", qps=60.0, duration_s=3.0, query_size="fixed:4",
                wait_ready_s=10.0, drain_timeout_s=5.0, pool=4, seed=1)
    return LoadConfig(**{**base, **fields})


def test_two_processes_offer_the_whole_rate_as_one_poisson_stream(fake_server) -> None:
    server = fake_server(latency_s=0.005)
    report = run_load_processes(_config(server), 2)
    assert report.config["processes"] == 2 and report.target["processes"] == 2
    sent, ok = report.requests["sent"], report.requests["ok"]
    assert sent == ok == len(server.seen.sizes)
    assert 120 < sent < 240  # 60 q/s for 3 s, Poisson
    assert 40 < report.achieved_qps < 80
    gaps = np.diff(np.sort(np.asarray(server.seen.arrivals)))
    assert 0.6 < gaps.mean() * 60 < 1.6 and 0.6 < gaps.std() / gaps.mean() < 1.5  # merged stream stays Poisson
    assert report.latency_ms["p50"] >= 5.0


def test_processes_refuse_modes_they_cannot_split(fake_server, tmp_path) -> None:
    server = fake_server()
    with pytest.raises(ValueError, match="--processes spreads open-loop runs"):
        run_load_processes(_config(server, concurrency=2), 2)
    with pytest.raises(ValueError, match="--processes must be >= 1"):
        run_load_processes(_config(server), 0)


def test_cli_runs_with_processes(fake_server, tmp_path) -> None:
    server = fake_server(latency_s=0.002)
    report = tmp_path / "r.json"
    code = main(["--url", server.url, "--model", "fake-rm", "--qps", "30", "--duration", "2", "--processes", "2",
                 "--query-size", "fixed:2", "--report", str(report), "--quiet"])
    assert code == 0
    data = json.loads(report.read_text())
    assert data["config"]["processes"] == 2 and data["requests"]["errors"] == 0 and data["requests"]["sent"] > 20
