"""--processes: one open-loop run spread over several generator processes, merged into one report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sixfold.loadgen.cli import main
from sixfold.loadgen.config import LoadConfig
from sixfold.loadgen.arrivals import parse_arrival
from sixfold.loadgen.multiprocess import run_load_processes, split_config


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
    assert report.latency_ms["p50"] >= 5.0


def test_children_schedules_merge_into_one_poisson_stream_at_the_full_rate() -> None:
    # Checked on the planned schedules, not on server arrival times: on a loaded 2-core CI
    # machine the arrival times measure the scheduler's jitter as much as the generator.
    config = LoadConfig(url="127.0.0.1:1", model="m", qps=600.0, duration_s=10.0, seed=1)
    parts = []
    for i in range(3):
        child = split_config(config, 3, i)
        assert child.qps == pytest.approx(200.0)
        parts.append(parse_arrival(child.arrival).offsets(child.qps, child.duration_s,
                                                          np.random.default_rng(child.seed)))
    assert len({p.tobytes() for p in parts}) == 3  # each child has its own seed
    gaps = np.diff(np.sort(np.concatenate(parts)))
    assert 0.9 < gaps.mean() * 600 < 1.1 and 0.9 < gaps.std() / gaps.mean() < 1.1


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
