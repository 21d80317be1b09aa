"""The sixfold-loadgen command through sixfold.loadgen.cli.main: report file, table, clean errors."""

from __future__ import annotations

import json
import time

import pytest

from sixfold.loadgen.cli import main
from tests.conftest import free_port

REPORT_KEYS = {"latency_ms", "achieved_qps", "requests", "items_per_s", "offered_qps", "duration_s",
               "query_size", "send_lag_ms", "errors_by_reason", "config", "timeline"}


def args(url: str, report, *extra: str) -> list[str]:
    return ["--url", url, "--model", "fake-rm", "--qps", "50", "--duration", "1", "--report", str(report),
            "--wait-ready", "5", *extra]


def test_run_writes_the_report_and_prints_a_plain_table(fake_server, tmp_path, capsys):
    server = fake_server(latency_s=0.005)
    path = tmp_path / "out" / "run.json"
    assert main(args(server.url, path, "--query-size", "fixed:8", "--arrival", "constant", "--seed", "3",
                     "--plot", str(tmp_path / "run.png"))) == 0
    report = json.loads(path.read_text())
    assert REPORT_KEYS <= set(report)
    assert set(report["latency_ms"]) >= {"p50", "p90", "p95", "p99", "p999", "max"}
    assert set(report["requests"]) >= {"sent", "ok", "errors"}
    assert set(report["query_size"]) >= {"mean", "p50", "max"}
    assert set(report["send_lag_ms"]) >= {"p99", "max"}
    assert report["requests"]["sent"] == report["requests"]["ok"] == 50
    assert report["config"]["qps"] == 50 and report["config"]["query_size"] == "fixed:8"
    assert report["config"]["seed"] == 3
    assert [set(r) for r in report["timeline"]] == [{"t", "sent", "ok", "errors", "p50_ms", "p99_ms"}]
    assert (tmp_path / "run.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "latency p50 / p90 / p99" in out and "queries/s" in out and "items/s" in out
    assert "\x1b[" not in out  # not a TTY: no live line, no colour codes


@pytest.mark.parametrize("flag, value, message", [
    ("--query-size", "lognormal", "bad query size spec 'lognormal'"),
    ("--arrival", "burst", "bad arrival spec 'burst'"),
    ("--arrival", "bursty:on=x", "bad arrival spec 'bursty:on=x'"),
    ("--query-size", "uniform:9-3", "bad query size spec 'uniform:9-3'"),
    ("--table-rows", "10,x", "bad --table-rows '10,x'"),
    ("--qps", "0", "qps must be"),
])
def test_bad_specs_exit_2_with_one_line(tmp_path, capsys, flag, value, message):
    argv = args("127.0.0.1:1", tmp_path / "r.json") + [flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_bad_url_exits_2(tmp_path, capsys):
    assert main(args("http://localhost:8001", tmp_path / "r.json")) == 2
    assert "HOST:PORT" in capsys.readouterr().err


def test_unreachable_server_exits_1_after_wait_ready(tmp_path, capsys):
    started = time.monotonic()
    argv = args(f"127.0.0.1:{free_port()}", tmp_path / "r.json") + ["--wait-ready", "0.5"]
    assert main(argv) == 1
    assert time.monotonic() - started < 15.0  # gives up after --wait-ready, not after loadgen's default wait
    err = capsys.readouterr().err.strip()
    assert "cannot reach a KServe v2 server" in err and "\n" not in err and "Traceback" not in err


def test_unknown_model_exits_1(fake_server, tmp_path, capsys):
    server = fake_server()
    argv = args(server.url, tmp_path / "r.json")
    argv[argv.index("fake-rm")] = "rm9"
    assert main(argv) == 1
    assert "unknown model 'rm9'" in capsys.readouterr().err


def test_non_sixfold_model_with_table_rows(fake_server, tmp_path):
    server = fake_server(sixfold_params=False)
    path = tmp_path / "r.json"
    assert main(args(server.url, path, "--quiet")) == 1  # no table sizes anywhere
    assert main(args(server.url, path, "--quiet", "--table-rows", "100", "--pooling", "2",
                     "--query-size", "fixed:2")) == 0
    report = json.loads(path.read_text())
    assert report["requests"]["errors"] == 0 and report["target"]["pooling"] == [2, 2, 2]
    assert server.seen.invalid == []
