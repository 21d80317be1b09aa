"""sixfold-serve as a user runs it: a real process, a real client, SIGTERM answers in-flight work."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.server.workers.process import READY_PREFIX
from tests.conftest import ServeProcess, free_port, triton_inputs

SERVE = Path(sys.executable).parent / "sixfold-serve"


def _pending_requests(metrics_url: str) -> int:
    """The server's own count of received, unanswered requests (Triton's pending gauge)."""
    import urllib.request
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("nv_inference_pending_request_count{"))


def test_serve_answers_then_shuts_down_gracefully_on_sigterm() -> None:
    # NOTE: no work bound: 12 queries of 1000 items are far over the default's 30 ms, and this test is about shutdown
    metrics_port = free_port()
    serve = ServeProcess("--model", "rm1", "--max-rows", "500", "--cards", "2", "--host-spec", "host-calibrated",
                         "--grpc-port", "0", "--metrics-port", str(metrics_port), "--max-queue-work-ms", "0")
    proc, url, lines = serve.proc, serve.url, serve.lines
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        assert url, "".join(lines)
        gen = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=500), seed=1)
        with tc.InferenceServerClient(url) as client:
            request = gen.make(8)
            assert client.infer("rm1", triton_inputs(tc, request)).as_numpy("scores").shape == (8, 1)
            # SIGTERM while requests are queued: those already received are answered, later
            # ones get UNAVAILABLE; none hangs and none is dropped.
            big = gen.make(1000)
            outcomes: list = []

            def call() -> None:
                try:
                    scores = client.infer("rm1", triton_inputs(tc, big)).as_numpy("scores")
                    outcomes.append(("ok", time.monotonic(), scores))
                except InferenceServerException as exc:
                    outcomes.append((exc.status(), time.monotonic(), None))

            # NOTE: the signal goes out while the server itself reports requests pending (its
            # gauge), not after a guessed delay: on a fast host a burst can be batched and answered
            # whole before a timer fires. A burst answered before the gauge was seen is sent again
            # (bounded: 5 bursts of 12).
            signalled = None
            for _ in range(5):
                outcomes.clear()
                threads = [threading.Thread(target=call) for _ in range(12)]
                for t in threads:
                    t.start()
                deadline = time.monotonic() + 60
                while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
                    if _pending_requests(metrics_url) >= 2:
                        signalled = time.monotonic()
                        proc.send_signal(signal.SIGTERM)
                        break
                    time.sleep(0.002)
                if signalled is not None:
                    break
                for t in threads:
                    t.join(60)
            assert signalled is not None, "the server never reported two requests pending in 5 bursts of 12"
            for t in threads:
                t.join(60)
        assert proc.wait(timeout=30) == 0
        assert len(outcomes) == 12, outcomes
        assert {status for status, _, _ in outcomes} <= {"ok", "StatusCode.UNAVAILABLE"}
        answered = [scores for status, _, scores in outcomes if status == "ok"]
        assert all(s.shape == (1000, 1) and np.isfinite(s).all() for s in answered)
        after = [(status, round(at - signalled, 3)) for status, at, _ in outcomes]
        assert any(status == "ok" and at > signalled for status, at, _ in outcomes), \
            f"a request pending at SIGTERM should still be answered after it: {after}"
        output = "".join(lines)
        assert "card1" in output and "bottleneck" in output  # the plan is explained at start
        assert "host-calibrated" in output  # ... with the host spec asked for
        assert "stopped" in output
    finally:
        serve.kill()


def test_serve_reports_a_bad_model_cleanly() -> None:
    result = subprocess.run([str(SERVE), "--model", "nope", "--grpc-port", "0", "--metrics-port", "-1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--model nope: unknown model 'nope'" in result.stderr, result.stderr
    result = subprocess.run([str(SERVE), "--model", "rm1", "--max-rows", "100", "--host-spec", "no-such-spec",
                             "--grpc-port", "0", "--metrics-port", "-1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no-such-spec" in result.stderr, result.stderr


def test_sigterm_drains_first_not_ready_but_serving_and_a_second_sigterm_ends_the_grace() -> None:
    serve = ServeProcess("--model", "rm1", "--max-rows", "500", "--cards", "2", "--grpc-port", "0",
                         "--metrics-port", "-1", "--drain-seconds", "600")
    try:
        assert serve.url, serve.output
        request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=500), seed=4).make(5)
        with tc.InferenceServerClient(serve.url) as client:
            assert client.is_server_ready()
            serve.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while client.is_server_ready() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not client.is_server_ready(), serve.output
            # a request that reaches the server after SIGTERM, during the grace, is answered
            assert client.infer("rm1", triton_inputs(tc, request)).as_numpy("scores").shape == (5, 1)
            assert serve.proc.poll() is None
            serve.proc.send_signal(signal.SIGTERM)
            assert serve.proc.wait(timeout=60) == 0
        assert "draining (not ready; still serving for 600 s)" in serve.output
        assert "stopped" in serve.output
    finally:
        serve.kill()


def test_explicit_model_control_needs_a_token_or_an_explicit_opt_out(tmp_path) -> None:
    base = [str(SERVE), "--model-repository", str(tmp_path / "absent"), "--model-control-mode", "explicit",
            "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    env = {k: v for k, v in os.environ.items() if k != "SIXFOLD_CONTROL_TOKEN"}
    refused = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2
    assert "--control-token" in refused.stderr and "--insecure-model-control" in refused.stderr, refused.stderr
    # with the opt-out (or a token) it gets as far as the repository, which this one lacks
    for extra in (["--insecure-model-control"], ["--control-token", "t0ken"]):
        result = subprocess.run(base + extra, capture_output=True, text=True, timeout=120, env=env)
        assert result.returncode == 2 and "absent" in result.stderr and "--insecure" not in result.stderr, result.stderr


def test_allow_nonfinite_flag_passes_nan_dense_features_through() -> None:
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=6).make(4)
    request["dense_features"][2, 1] = np.nan
    for flags, accepted in (([], False), (["--allow-nonfinite"], True)):
        serve = ServeProcess("--model", "rm1", "--max-rows", "300", "--cards", "1", "--grpc-port", "0",
                             "--metrics-port", "-1", *flags)
        try:
            assert serve.url, serve.output
            with tc.InferenceServerClient(serve.url) as client:
                if accepted:
                    scores = client.infer("rm1", triton_inputs(tc, request)).as_numpy("scores")
                    assert np.isnan(scores[2, 0]) and np.isfinite(np.delete(scores, 2, axis=0)).all()
                else:
                    try:
                        client.infer("rm1", triton_inputs(tc, request))
                        raise AssertionError("NaN dense features were scored without --allow-nonfinite")
                    except InferenceServerException as exc:
                        assert exc.status() == "StatusCode.INVALID_ARGUMENT" and "dense_features" in exc.message()
        finally:
            assert serve.stop() == 0, serve.output


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused start: no traceback, no bare errno, and nothing loaded first."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and not lines[0].rstrip().split(":")[-1].strip().isdigit(), lines
    assert "bottleneck" not in result.stdout and "warmed up" not in result.stderr  # refused before loading
    return lines[0]


def test_user_mistakes_are_one_line_naming_the_flag_before_anything_loads(tmp_path) -> None:
    (tmp_path / "not-a-cert.pem").write_text("hello\n")
    (tmp_path / "bad-spec.json").write_text("{")
    # NOTE: rm2 at 50k rows takes seconds to partition: every refusal below comes before it, or the plan shows
    base = [str(SERVE), "--model", "rm2", "--max-rows", "50000", "--cards", "2", "--grpc-port", "0",
            "--http-port", "0", "--metrics-port", "-1"]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        free = free_port()
        mistakes = [
            (["--metrics-port", str(taken)],
             f"could not bind 127.0.0.1:{taken} for metrics (--metrics-port): it is in use"),
            (["--grpc-port", str(taken)], f"could not bind 127.0.0.1:{taken} for gRPC (--grpc-port): it is in use"),
            (["--grpc-port", str(free), "--http-port", str(free)],
             f"gRPC (--grpc-port) and REST (--http-port) are both {free}: give each its own port"),
            (["--host", "203.0.113.9"], "--host: 203.0.113.9 is not an address of this machine"),
            (["--log-level", "verbose"], "--log-level: 'verbose': give one of debug, info, warning, error, critical"),
            (["--host-spec", str(tmp_path / "missing.json")], "--host-spec"),
            (["--host-spec", str(tmp_path / "bad-spec.json")], "not a device spec"),
            (["--backend", "nope"], "--backend nope: no such backend"),
            (["--backend-options-file", str(tmp_path / "missing.json")], "--backend-options-file"),
            (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(tmp_path / "missing.pem")],
             "--tls-cert"),
            (["--tls-cert", str(tmp_path / "not-a-cert.pem"), "--tls-key", str(tmp_path / "not-a-cert.pem")],
             "no PEM certificate"),
            (["--warm-from", str(tmp_path / "missing.npz"), "--table-memory", "10%"], "--warm-from"),
            (["--cards", "0"], "--cards 0"),
        ]
        for extra, expected in mistakes:
            result = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
            line = _one_line_error(result)
            assert expected in line and line.startswith("sixfold-serve: "), (extra, line)
    result = subprocess.run([str(SERVE), "--model-repository", str(tmp_path / "absent"), "--grpc-port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert "--model-repository" in _one_line_error(result) and "no such folder" in result.stderr


def test_json_log_format_every_line_is_json_and_the_plan_prices_the_table_memory() -> None:
    serve = ServeProcess("--model", "rm1", "--max-rows", "2000", "--cards", "2", "--grpc-port", "0",
                         "--metrics-port", "0", "--log-format", "json", "--table-memory", "25%")
    try:
        assert serve.url, serve.output  # the READY object is read as the READY line is
        with tc.InferenceServerClient(serve.url) as client:
            assert client.is_server_ready()
        assert serve.stop() == 0
        deadline = time.monotonic() + 10  # the reader thread may still be taking the last lines
        while '"stopped"' not in serve.output and time.monotonic() < deadline:
            time.sleep(0.05)
        entries = [json.loads(line) for line in serve.lines]  # raises on any line that is not one JSON object
    finally:
        serve.kill()
    assert all(isinstance(e, dict) and {"ts", "level", "logger", "message"} <= set(e) for e in entries)
    events = [e.get("event") for e in entries]
    for event in ("loading", "plan", "serving", "ready", "stopped"):
        assert event in events, events
    [ready] = [e for e in entries if e.get("event") == "ready"]
    assert ready["message"] == f"{READY_PREFIX}{serve.url}" and ready["grpc"] == serve.url
    [plan] = [e for e in entries if e.get("event") == "plan"]
    fields = plan["plan"]
    assert [d["device"] for d in fields["devices"]] == ["host", "card0", "card1"]
    # with a table memory the start-up plan prices the tiers it runs, not every row resident
    assert fields["tiers"]["estimates"][0]["hit_rate"] < 1 and "priced with its table memory" in plan["message"]
    assert fields["throughput_items_per_s"] < fields["resident"]["throughput_items_per_s"]
    assert fields["latency_ms"] > fields["resident"]["latency_ms"]


def test_json_log_format_mistakes_are_one_json_line() -> None:
    for extra in (["--log-level", "verbose"], ["--metrics-port", "70000"]):
        result = subprocess.run([str(SERVE), "--model", "rm1", "--grpc-port", "0", "--http-port", "0",
                                 "--log-format", "json", *extra], capture_output=True, text=True, timeout=120)
        [line] = result.stderr.splitlines()
        entry = json.loads(line)
        assert result.returncode == 2 and entry["level"] == "error" and extra[0] in entry["message"], line


def test_help_is_grouped_with_defaults() -> None:
    text = subprocess.run([str(SERVE), "--help"], capture_output=True, text=True, timeout=60, check=True).stdout
    for group in ("model (what to serve):", "network:", "security (TLS and tokens):", "cards and placement:",
                  "embedding tables:", "batching and admission:", "logging and discovery:"):
        assert f"\n{group}\n" in text, group
    assert "(default 1024)" in text.replace("\n", " ").replace("  ", " ")  # --max-batch-rows: default shown
    assert "$SIXFOLD_CONTROL_TOKEN" in text and text.count("usage:") == 1 and len(text.splitlines()[0]) < 130


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_tokens_from_a_file_or_the_environment_stay_out_of_the_process_list(tmp_path) -> None:
    base = [str(SERVE), "--model-repository", str(tmp_path / "absent"), "--model-control-mode", "explicit",
            "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1"]
    env = {k: v for k, v in os.environ.items() if k not in ("SIXFOLD_CONTROL_TOKEN", "SIXFOLD_METRICS_TOKEN")}
    good, empty = tmp_path / "token", tmp_path / "empty"
    good.write_text("s3cret\n")
    empty.write_text("\n")

    def run(*extra: str, **more: str) -> subprocess.CompletedProcess:
        return subprocess.run(base + list(extra), capture_output=True, text=True, timeout=120, env={**env, **more})

    # a file, the environment: no warning; it gets as far as the repository, which this one lacks
    for extra, more in (((f"--control-token-file={good}",), {}), ((), {"SIXFOLD_CONTROL_TOKEN": "s3cret"}),
                        (("--control-token-file", str(good), "--metrics-token-file", str(good)), {})):
        result = run(*extra, **more)
        assert result.returncode == 2 and "absent" in result.stderr and "warning" not in result.stderr, result.stderr
    # in argv: still works, with one warning that says why and what to use instead
    result = run("--control-token", "s3cret", "--metrics-token", "m3trics")
    assert result.returncode == 2 and "absent" in result.stderr, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 2, result.stderr
    assert "--control-token on the command line" in warnings[0] and "process list" in warnings[0]
    assert "--control-token-file PATH or $SIXFOLD_CONTROL_TOKEN" in warnings[0]
    assert "--metrics-token-file PATH or $SIXFOLD_METRICS_TOKEN" in warnings[1]
    # refused with one line, before the repository is looked at
    for extra, why in (((f"--control-token-file={tmp_path / 'missing'}",), "--control-token-file .*missing: no such file"),
                       (("--metrics-token-file", str(empty)), "--metrics-token-file .*empty: its first line is empty"),
                       (("--metrics-token-file", str(tmp_path)), "--metrics-token-file .*: a folder, not a file"),
                       (("--control-token", "x", "--control-token-file", str(good)),
                        "--control-token and --control-token-file both given")):
        result = run(*extra)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and "absent" not in result.stderr, result.stderr
        import re
        assert re.search(why, lines[0]), lines[0]


def test_workers_get_the_tokens_in_their_environment_not_their_argv(tmp_path) -> None:
    import urllib.request

    from sixfold.partitioner.artifacts import write_artifacts
    from sixfold.partitioner.compile import partition_builtin

    write_artifacts(partition_builtin("rm1", max_rows=200, cards=1)[1], tmp_path / "repo" / "alpha" / "1")
    token_file = tmp_path / "control-token"
    token_file.write_text("c0ntrol-s3cret\nignored second line\n")
    env = {**os.environ, "SIXFOLD_METRICS_TOKEN": "m3trics-s3cret"}
    env.pop("SIXFOLD_CONTROL_TOKEN", None)
    metrics_port = free_port()
    serve = ServeProcess("--model-repository", str(tmp_path / "repo"), "--model-control-mode", "explicit",
                         "--control-token-file", str(token_file), "--backend", "onnxruntime", "--cards", "1",
                         "--grpc-port", "0", "--metrics-port", str(metrics_port), "--workers", "2", env=env)
    try:
        assert serve.url, serve.output
        pids = [serve.proc.pid] + [int(p) for p in __import__("re").findall(r"worker \d+ pid (\d+)", serve.output)]
        assert len(pids) == 4, serve.output  # the supervisor, the engine and two front ends
        for pid in pids:
            cmdline = _cmdline(pid)
            assert "s3cret" not in cmdline, cmdline
        assert all("--control-token" not in _cmdline(pid) for pid in pids[1:])
        assert "warning" not in serve.output
        with tc.InferenceServerClient(serve.url) as client:
            try:
                client.load_model("alpha")
                raise AssertionError("a load without the token was accepted")
            except InferenceServerException as exc:
                assert "UNAUTHENTICATED" in str(exc.status()), exc
            auth = {"authorization": "Bearer c0ntrol-s3cret"}
            for _ in range(4):  # each worker (SO_REUSEPORT spreads the connections) has the token
                with tc.InferenceServerClient(serve.url) as fresh:
                    fresh.load_model("alpha", headers=auth)
            assert client.is_model_ready("alpha")
        request = urllib.request.Request(f"http://127.0.0.1:{metrics_port}/metrics",
                                         headers={"Authorization": "Bearer m3trics-s3cret"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
    finally:
        serve.kill()


def test_the_sla_sets_the_admission_defaults_and_flags_given_win() -> None:
    from sixfold.server.cli import apply_sla, _parser as build_parser

    def resolved(*argv: str) -> tuple[float, int]:
        args = build_parser().parse_args(["--model", "tiny", *argv])
        apply_sla(args)
        return args.max_queue_work_ms, args.default_timeout_us

    assert resolved() == (30.0, 1_000_000)  # MLPerf's 60 ms: the defaults as they were
    assert resolved("--p99-ms", "250") == (125.0, 1_000_000)
    assert resolved("--p99-ms", "500") == (250.0, 2_000_000)
    assert resolved("--p99-ms", "500", "--max-queue-work-ms", "0", "--default-timeout-us", "0") == (0.0, 0)

    def share(*argv: str) -> float:
        args = build_parser().parse_args(["--model", "tiny", *argv])
        apply_sla(args)
        return args.deadline_work_share

    # no SLA stated: clients' deadlines state theirs; one stated by the operator wins
    assert (share(), share("--p99-ms", "250"), share("--max-queue-work-ms", "30")) == (0.5, 0.0, 0.0)


def test_a_served_sla_shows_in_the_model_config_and_a_bad_one_is_refused() -> None:
    result = subprocess.run([str(SERVE), "--model", "tiny", "--p99-ms", "-5", "--grpc-port", "0", "--metrics-port", "-1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--p99-ms -5" in result.stderr, result.stderr
    serve = ServeProcess("--model", "tiny", "--p99-ms", "500", "--grpc-port", "0", "--http-port", "-1",
                         "--metrics-port", "-1")
    try:
        assert serve.url, serve.output
        with tc.InferenceServerClient(serve.url) as client:
            config = client.get_model_config("tiny").config
        assert config.dynamic_batching.default_queue_policy.default_timeout_microseconds == 2_000_000
    finally:
        serve.kill()
