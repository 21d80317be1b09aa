"""``sixfold-loadgen --mlperf-scenario``: MLCommons LoadGen against a real sixfold-serve process.

Short, non-compliant LoadGen settings (seconds, tens of queries) so the module
stays quick; the verdicts are LoadGen's own, read back from the summary it wrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sixfold.loadgen.cli import main
from sixfold.loadgen.mlperf import parse_summary
from tests.conftest import ServeProcess, free_port

MODEL = "dlrm-mlperf"


@pytest.fixture(scope="module")
def server():
    # NOTE: no admission bound: on a busy test machine the default 30 ms queue budget refuses a few queries.
    serve = ServeProcess("--model", MODEL, "--max-rows", "2000", "--cards", "2", "--grpc-port", "0",
                         "--metrics-port", "-1", "--max-queue-work-ms", "0")
    try:
        assert serve.url, serve.output
        yield serve
    finally:
        serve.stop()


def run(server, tmp_path: Path, *extra: str, log: str = "logs") -> tuple[int, Path]:
    args = ["--url", server.url, "--model", MODEL, "--mlperf-samples", "48", "--quiet",
            "--mlperf-log-dir", str(tmp_path / log), "--report", str(tmp_path / f"{log}.json"), *extra]
    return main(args), tmp_path / log


def test_server_scenario_at_low_qps_is_valid(server, tmp_path, capsys):
    # p90 so that LoadGen's early-stopping test is met by 64 queries (p99 needs ~460 even if all are fast).
    code, logs = run(server, tmp_path, "--mlperf-scenario", "server", "--qps", "16", "--duration", "2",
                     "--mlperf-min-queries", "64", "--mlperf-latency-percentile", "90",
                     "--mlperf-latency-ms", "1000", "--mlperf-require-valid")
    out = capsys.readouterr().out
    assert code == 0, out
    assert "MLPerf Server: VALID" in out
    assert (logs / "mlperf_log_summary.txt").is_file() and (logs / "mlperf_log_detail.txt").is_file()
    summary = parse_summary((logs / "mlperf_log_summary.txt").read_text())
    assert summary["scenario"] == "Server" and summary["result"] == "VALID"
    assert all(summary["checks"].values()) and set(summary["checks"]) >= {"min_duration", "early_stopping"}
    report = json.loads((tmp_path / "logs.json").read_text())
    assert report["valid"] and report["errors"] == 0 and report["samples_sent"] >= 64
    assert 0 < report["latency_ms"]["p90"] <= 1000 and report["latency_ms"]["p90"] <= report["latency_ms"]["max"]
    assert report["samples_per_s"] == pytest.approx(16, rel=0.5)
    assert report["settings"]["min_query_count"] == 64
    # The QSL follows MLPerf's query sizes (100..700 items, mostly 200).
    assert 150 <= report["settings"]["qsl_items_mean"] <= 450
    # The printed p90 is the summary's.
    printed = float(re.search(r"p90 latency: ([\d.]+) ms", out).group(1))
    assert printed == pytest.approx(summary["latency_ms"]["p90"], abs=0.06)


def test_impossible_latency_bound_is_invalid(server, tmp_path, capsys):
    args = ("--mlperf-scenario", "server", "--qps", "16", "--duration", "1", "--mlperf-min-queries", "16",
            "--mlperf-latency-ms", "0.01")
    code, logs = run(server, tmp_path, *args)
    out = capsys.readouterr().out
    assert code == 0 and "MLPerf Server: INVALID" in out, out
    summary = parse_summary((logs / "mlperf_log_summary.txt").read_text())
    assert summary["result"] == "INVALID" and summary["checks"]["performance_constraints"] is False
    code, _ = run(server, tmp_path, *args, "--mlperf-require-valid", log="again")
    assert code == 3


def test_offline_scenario_completes(server, tmp_path, capsys):
    code, logs = run(server, tmp_path, "--mlperf-scenario", "offline", "--qps", "40", "--duration", "1",
                     "--mlperf-min-queries", "40", "--concurrency", "2")
    out = capsys.readouterr().out
    assert code == 0 and "MLPerf Offline:" in out, out
    summary = parse_summary((logs / "mlperf_log_summary.txt").read_text())
    assert summary["scenario"] == "Offline" and summary["result"] in ("VALID", "INVALID")
    report = json.loads((tmp_path / "logs.json").read_text())
    # LoadGen sizes the one Offline query as ~1.1 x expected QPS x min duration: 44 samples here.
    assert report["samples_sent"] >= 40 and report["errors"] == 0
    assert report["samples_per_s"] > 0 and summary["samples_per_s"] == report["samples_per_s"]


def test_warm_up_queries_reach_the_server_before_the_timed_run(server, tmp_path, capsys):
    import tritonclient.grpc as tc

    def served() -> int:
        with tc.InferenceServerClient(server.url) as client:
            stats = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        return int(stats["inference_stats"]["success"].get("count", 0))

    before = served()
    code, _ = run(server, tmp_path, "--mlperf-scenario", "offline", "--qps", "40", "--duration", "1",
                  "--mlperf-min-queries", "20", "--concurrency", "2", "--mlperf-warmup-queries", "5")
    assert code == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "logs.json").read_text())
    assert report["settings"]["warmup_queries"] == 5
    assert served() - before == report["samples_sent"] + 5  # timed samples plus the untimed warm-up


@pytest.mark.parametrize("extra, message", [
    (("--mlperf-scenario", "server"), "needs --qps"),
    (("--mlperf-scenario", "server", "--qps", "5", "--concurrency", "2"), "--concurrency applies"),
    (("--mlperf-scenario", "server", "--qps", "5", "--find-max-qps"), "--find-max-qps does not go"),
    (("--mlperf-scenario", "server", "--qps", "5", "--mlperf-latency-percentile", "100"), "percentile"),
    (("--mlperf-scenario", "offline", "--qps", "5", "--mlperf-min-queries", "0"), "--mlperf-min-queries"),
    (("--mlperf-scenario", "server", "--qps", "5", "--mlperf-warmup-queries", "-1"), "--mlperf-warmup-queries"),
])
def test_bad_arguments_exit_2(extra, message, capsys):
    code = main(["--url", "127.0.0.1:1", "--model", MODEL, *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_bad_scenario_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--url", "127.0.0.1:1", "--model", MODEL, "--mlperf-scenario", "single", "--qps", "1"])
    assert exc.value.code == 2 and "--mlperf-scenario" in capsys.readouterr().err


def test_unreachable_server_and_unknown_model_are_one_line(server, tmp_path, capsys):
    port = free_port()
    code = main(["--url", f"127.0.0.1:{port}", "--model", MODEL, "--mlperf-scenario", "server", "--qps", "1",
                 "--wait-ready", "0.5", "--quiet", "--mlperf-log-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "cannot reach a KServe v2 server" in err and err.count("\n") == 1, err
    code = main(["--url", server.url, "--model", "nope", "--mlperf-scenario", "server", "--qps", "1", "--quiet",
                 "--mlperf-log-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "unknown model 'nope'" in err and err.count("\n") == 1, err
