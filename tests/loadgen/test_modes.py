"""Closed loop, find-max-qps, record/replay and perf_analyzer export against the fake server."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sixfold.loadgen import LoadConfig, SweepConfig, find_max_qps_async, load_recording, run_load_async
from sixfold.loadgen.cli import main
from sixfold.loadgen.export import export_perf_analyzer_async


def config(server, **kw) -> LoadConfig:
    base = dict(url=server.url, model="fake-rm", qps=100.0, duration_s=1.0, query_size="fixed:4",
                wait_ready_s=5.0, drain_timeout_s=2.0, pool=4)
    return LoadConfig(**{**base, **kw})


async def test_closed_loop_keeps_exactly_n_outstanding(fake_server):
    server = fake_server(latency_s=0.020)
    report = await run_load_async(config(server, qps=0.0, concurrency=4, duration_s=1.0, query_size="mlperf"))
    assert server.seen.max_in_flight == 4
    assert report.mode == "closed" and report.concurrency == 4
    # 4 workers, ~20 ms each: ~200 q/s (less the client's own overhead).
    assert 80 <= report.achieved_qps <= 210
    assert report.requests["errors"] == 0 and report.requests["sent"] == len(server.seen.sizes)
    assert 20.0 <= report.latency_ms["p50"] <= 40.0  # closed loop: from the actual send
    assert 100 <= report.query_size["mean"] <= 700


async def test_closed_loop_max_requests(fake_server):
    server = fake_server(latency_s=0.002)
    report = await run_load_async(config(server, qps=0.0, concurrency=3, duration_s=5.0, max_requests=30))
    assert len(server.seen.sizes) == 30 and report.requests["sent"] == 30 and report.requests["ok"] == 30
    assert server.seen.max_in_flight <= 3


async def test_find_max_qps_finds_the_knee_of_a_saturating_server(fake_server):
    """A serial server of 40 ms per request saturates at ~25 q/s (less timer overhead).

    NOTE: 40 ms, not 10: a passing step may then lose 160 ms to a busy machine (the bound is 200 ms)
    and still pass, so the sweep's shape does not depend on how idle the host is.
    """
    server = fake_server(latency_s=0.040, serial=True)
    sweep = SweepConfig(p99_ms=200.0, min_qps=5.0, max_qps=100.0, step_duration_s=1.5, tolerance=0.1,
                        settle_s=0.3)
    report = await find_max_qps_async(config(server, arrival="constant", qps=1.0), sweep)
    rows = report.sweep
    assert [r["qps"] for r in rows[:4]] == [5, 10, 20, 40] and [r["pass"] for r in rows[:4]] == [True] * 3 + [False]
    assert all(r["phase"] == "search" for r in rows[4:]) and len(rows) <= 9
    assert 15.0 <= report.max_qps_under_slo <= 26.25
    assert report.offered_qps == report.max_qps_under_slo  # the best passing step's report
    over = [r for r in rows if r["qps"] >= 30]
    assert over and all(r["p99_ms"] > 200.0 and r["achieved_qps"] < 27.5 for r in over)
    json.dumps(report.to_dict(), allow_nan=False)


async def test_find_max_qps_searches_down_when_the_first_step_fails(fake_server):
    """Started far above a ~50 q/s server's knee, the search halves until a step passes, then bisects."""
    server = fake_server(latency_s=0.020, serial=True)
    sweep = SweepConfig(p99_ms=80.0, min_qps=200.0, max_qps=400.0, floor_qps=5.0, step_duration_s=0.8,
                        tolerance=0.15, settle_s=0.3, max_steps=8)
    report = await find_max_qps_async(config(server, arrival="constant", qps=1.0), sweep)
    rows = report.sweep
    assert rows[0]["qps"] == 200 and not rows[0]["pass"]
    down = [r for r in rows if r["phase"] == "down"]
    assert [r["qps"] for r in down][:2] == [100, 50] and down[-1]["pass"]
    assert all(not r["pass"] for r in down[:-1])
    assert report.max_qps_under_slo is not None and 20.0 <= report.max_qps_under_slo <= 55.0


async def test_record_then_replay_reproduces_schedule_sizes_and_results(fake_server, tmp_path):
    server = fake_server(latency_s=0.005, keep_ids=True)
    path = tmp_path / "run.npz"
    first = await run_load_async(config(server, qps=80.0, arrival="bursty:on=0.2,off=0.3,factor=3",
                                        query_size="uniform:1-9", id_drift=0.2, record_path=str(path)))
    assert first.recording == str(path)
    recording = load_recording(path)
    assert len(recording) == first.requests["sent"] == len(server.seen.sizes)
    assert np.all(recording.status == 1) and np.all(recording.latency[recording.status == 1] >= 0.005)
    # NOTE: as multisets: bursts send requests microseconds apart on separate HTTP/2 streams, and the
    # server may see two of them swapped (2 runs in 10 failed an in-order check, before and after 2026-11-26)
    assert sorted(recording.items.tolist()) == sorted(server.seen.sizes)
    sent_first = sorted(a.tobytes() for a in server.seen.ids)
    server.seen.sizes.clear(), server.seen.ids.clear(), server.seen.arrivals.clear()
    replayed = await run_load_async(config(server, qps=0.0, replay_path=str(path), query_size="fixed:99"))
    assert replayed.mode == "replay"
    assert sorted(server.seen.sizes) == sorted(recording.items.tolist())  # the same sizes
    assert sorted(a.tobytes() for a in server.seen.ids) == sent_first  # the very same ids
    assert replayed.requests == first.requests
    assert [r["sent"] for r in replayed.timeline] == [r["sent"] for r in first.timeline]
    assert replayed.query_size == first.query_size
    # Same timing: the replay's scheduled times are the recording's.
    # (Arrival times carry this 2-core machine's scheduling noise: strict on the median, loose on the max.)
    arrivals = np.asarray(server.seen.arrivals) - server.seen.arrivals[0]
    deviation = np.abs(arrivals - (recording.due - recording.due[0]))
    assert np.median(deviation) < 0.015 and deviation.max() < 0.15, deviation


async def test_export_perf_analyzer_json(tmp_path):
    path = tmp_path / "pa.json"
    cfg = LoadConfig(url="127.0.0.1:1", model="m", qps=10.0, duration_s=5.0, query_size="uniform:1-5",
                     table_rows=(100, 50, 20), dense_dim=3, pooling=(2, 1, 3), max_requests=12)
    written, count = await export_perf_analyzer_async(cfg, path)  # no server: the shape is all in flags
    data = json.loads(path.read_text())["data"]
    assert count == len(data) == 12
    for entry in data:
        dense, lengths, ids = entry["dense_features"], entry["sparse_lengths"], entry["sparse_indices"]
        n = dense["shape"][0]
        assert 1 <= n <= 5 and dense["shape"] == [n, 3] and len(dense["content"]) == 3 * n
        assert lengths["shape"] == [n, 3] and len(lengths["content"]) == 3 * n
        assert sum(lengths["content"]) == len(ids["content"]) == ids["shape"][0]
        table = np.tile(np.arange(3), n).repeat(lengths["content"])
        assert np.all(np.asarray(ids["content"]) < np.asarray([100, 50, 20])[table])


def test_cli_find_max_qps_writes_sweep_and_plots(fake_server, tmp_path, capsys):
    server = fake_server(latency_s=0.010, serial=True)
    report_path, plot = tmp_path / "sweep.json", tmp_path / "sweep.png"
    argv = ["--url", server.url, "--model", "fake-rm", "--find-max-qps", "--p99-ms", "40", "--min-qps", "30",
            "--max-qps", "60", "--step-duration", "0.5", "--query-size", "fixed:2",
            "--arrival", "constant", "--report", str(report_path), "--plot", str(plot), "--wait-ready", "5"]
    assert main(argv) == 0
    report = json.loads(report_path.read_text())
    assert [r["qps"] for r in report["sweep"]] == [30, 60] and report["max_qps_under_slo"] == 60
    assert report["slo"]["p99_ms"] == 40
    assert {"qps", "achieved_qps", "p50_ms", "p99_ms", "errors", "pass"} <= set(report["sweep"][0])
    for name in ("sweep.png", "sweep-timeline.png", "sweep-cdf.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "find-max-qps" in out and "max QPS with p99 <= 40 ms" in out and "step 1 (sweep)" in out
    assert "sent under 100 requests" in out  # 0.5 s steps at 30-60 q/s: the table says p99 is about the max


def test_cli_closed_loop_record_export_and_prefix_plots(fake_server, tmp_path):
    server = fake_server(latency_s=0.005)
    base = ["--url", server.url, "--model", "fake-rm", "--wait-ready", "5", "--query-size", "fixed:3", "--quiet"]
    assert main(base + ["--concurrency", "2", "--duration", "0.5", "--report", str(tmp_path / "c.json"),
                        "--record", str(tmp_path / "c.npz"), "--plot", str(tmp_path / "c"),
                        "--zipf", "1.2,0.9,1.1", "--id-drift", "0.05"]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["mode"] == "closed" and report["target"]["zipf"] == [1.2, 0.9, 1.1]
    assert report["latency_cdf_ms"][0][0] == 0 and report["latency_cdf_ms"][-1][0] == 100
    assert (tmp_path / "c-timeline.png").exists() and (tmp_path / "c-cdf.png").exists()
    assert len(load_recording(tmp_path / "c.npz")) == report["requests"]["sent"]
    assert main(base + ["--export-perf-analyzer", str(tmp_path / "pa.json"), "--pool", "5"]) == 0
    assert len(json.loads((tmp_path / "pa.json").read_text())["data"]) == 5


@pytest.mark.parametrize("argv, message", [
    (["--duration", "1"], "--qps is required"),
    (["--qps", "5"], "--duration is required"),
    (["--find-max-qps"], "needs --p99-ms"),
    (["--qps", "5", "--duration", "1", "--zipf", "1,x"], "bad --zipf '1,x'"),
    (["--qps", "5", "--duration", "1", "--id-drift", "2"], "id_drift must be in [0, 1]"),
])
def test_cli_mode_errors_exit_2(tmp_path, capsys, argv, message):
    assert main(["--url", "127.0.0.1:1", "--model", "m", "--report", str(tmp_path / "r.json"), *argv]) == 2
    assert message in capsys.readouterr().err
