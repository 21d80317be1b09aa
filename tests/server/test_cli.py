"""sixfold-serve as a user runs it: a real process, a real client, SIGTERM answers in-flight work."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as tc
from tritonclient.utils import InferenceServerException

import models
from tests.conftest import ServeProcess, free_port, triton_inputs

SERVE = Path(sys.executable).parent / "sixfold-serve"


def test_serve_answers_then_shuts_down_gracefully_on_sigterm() -> None:
    # NOTE: no work bound: 12 queries of 1000 items are far over the default's 30 ms, and this test is about shutdown
    serve = ServeProcess("--model", "rm1", "--max-rows", "500", "--cards", "2", "--host-spec", "host-calibrated",
                         "--grpc-port", "0", "--metrics-port", str(free_port()), "--max-queue-work-ms", "0")
    proc, url, lines = serve.proc, serve.url, serve.lines
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
            first_done = threading.Event()

            def call() -> None:
                try:
                    scores = client.infer("rm1", triton_inputs(tc, big)).as_numpy("scores")
                    outcomes.append(("ok", time.monotonic(), scores))
                except InferenceServerException as exc:
                    outcomes.append((exc.status(), time.monotonic(), None))
                first_done.set()

            # NOTE: 12 requests, so several are still queued when the first answer arrives (with 6,
            # a fast host stage could answer them all before the signal was sent).
            threads = [threading.Thread(target=call) for _ in range(12)]
            for t in threads:
                t.start()
            assert first_done.wait(60)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            for t in threads:
                t.join(60)
        assert proc.wait(timeout=30) == 0
        assert len(outcomes) == 12, outcomes
        assert {status for status, _, _ in outcomes} <= {"ok", "StatusCode.UNAVAILABLE"}
        answered = [scores for status, _, scores in outcomes if status == "ok"]
        assert all(s.shape == (1000, 1) and np.isfinite(s).all() for s in answered)
        assert any(status == "ok" and at > signalled for status, at, _ in outcomes), \
            "a request queued before SIGTERM should still be answered after it"
        output = "".join(lines)
        assert "card1" in output and "bottleneck" in output  # the plan is explained at start
        assert "host-calibrated" in output  # ... with the host spec asked for
        assert "stopped" in output
    finally:
        serve.kill()


def test_serve_reports_a_bad_model_cleanly() -> None:
    result = subprocess.run([str(SERVE), "--model", "nope", "--grpc-port", "0", "--metrics-port", "-1"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown model 'nope'" in result.stderr
    result = subprocess.run([str(SERVE), "--model", "rm1", "--max-rows", "100", "--host-spec", "no-such-spec",
                             "--grpc-port", "0", "--metrics-port", "-1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no-such-spec" in result.stderr, result.stderr
