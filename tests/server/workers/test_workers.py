"""sixfold-serve --workers N as a user runs it: real processes on one port, stock tritonclient, real /dev/shm."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

with warnings.catch_warnings():  # it imports pkg_resources, which warns that it is deprecated
    warnings.simplefilter("ignore")
    import tritonclient.utils.shared_memory as shm

from sixfold import models
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from tests.conftest import ServeProcess, free_port, triton_inputs

SERVE = Path(sys.executable).parent / "sixfold-serve"
CHANNELS = 24
"""Fresh channels per check: with 2 workers, all landing on one has odds of 2**-23."""


def _workers(proc: ServeProcess) -> dict[int, int]:
    """worker index -> pid, from the supervisor's lines."""
    return {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) pid (\d+)", proc.output)}


def _served(proc: ServeProcess) -> dict[str, float]:
    """Requests each worker answered, from the server's one /metrics page (the per-worker series)."""
    port = re.search(r"metrics of all workers on [^:]+:(\d+)", proc.output).group(1)
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    served: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith("sixfold_worker_inference_request_success_total{"):
            worker = re.search(r'worker="(\d+)"', line).group(1)
            served[worker] = float(line.rsplit(" ", 1)[1])
    total = re.search(r'^nv_inference_request_success\{model="tiny",version="1"\} (\S+)$', page, re.M)
    assert total and float(total.group(1)) == sum(served.values()), page  # Triton's counter: the workers' sum
    return served


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def two_workers():
    proc = ServeProcess("--model", "tiny", "--workers", "2", "--grpc-port", "0", "--metrics-port", "0")
    try:
        assert proc.url, proc.output
        yield proc
    finally:
        proc.kill()


def test_two_workers_share_the_ports_answer_alike_and_stop_on_sigterm(two_workers):
    proc = two_workers
    workers = _workers(proc)
    assert sorted(workers) == [0, 1], proc.output
    request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=3).make(5)
    answers = []
    for _ in range(CHANNELS):  # each client is its own channel, so its own connection
        with tc.InferenceServerClient(proc.url) as client:
            answers.append(client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores"))
    for scores in answers[1:]:
        np.testing.assert_array_equal(scores, answers[0])  # same weights in every worker
    http_url = re.search(r"share \S+ \(gRPC\) and (\S+) \(REST\)", proc.output).group(1)
    for _ in range(CHANNELS // 2):
        with th.InferenceServerClient(http_url) as client:
            np.testing.assert_array_equal(client.infer("tiny", triton_inputs(th, request)).as_numpy("scores"),
                                          answers[0])
    served = _served(proc)
    assert sorted(served) == ["0", "1"] and all(n > 0 for n in served.values()), f"a worker got no request: {served}"
    assert sum(served.values()) >= CHANNELS * 1.5  # warm-up batches are not requests
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=60) == 0, proc.output
    assert all(_gone(pid) for pid in workers.values())
    assert "worker 1] sixfold-serve: stopped" in proc.output


def test_a_shared_memory_region_registered_through_one_worker_is_known_to_all(two_workers):
    proc = two_workers
    request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=4).make(3)
    with tc.InferenceServerClient(proc.url) as client:
        expected = client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores")
    key = f"/sixfold-test-{uuid.uuid4().hex[:12]}"
    nbytes = sum(a.nbytes for a in request.values())
    handle = shm.create_shared_memory_region(key, key, nbytes)
    try:
        shm.set_shared_memory_region(handle, list(request.values()))
        with tc.InferenceServerClient(proc.url) as client:
            client.register_system_shared_memory("query", key, nbytes)

        def by_region() -> list:
            inputs, offset = [], 0
            for name, array in request.items():
                item = tc.InferInput(name, list(array.shape), {"float32": "FP32", "int32": "INT32",
                                                               "int64": "INT64"}[array.dtype.name])
                item.set_shared_memory("query", array.nbytes, offset=offset)
                offset += array.nbytes
                inputs.append(item)
            return inputs

        for _ in range(CHANNELS):
            with tc.InferenceServerClient(proc.url) as client:
                assert client.get_system_shared_memory_status("query", as_json=True)["regions"]["query"]["key"] == key
                np.testing.assert_array_equal(client.infer("tiny", by_region()).as_numpy("scores"), expected)
        with tc.InferenceServerClient(proc.url) as client:
            client.unregister_system_shared_memory("query")
        for _ in range(CHANNELS // 2):
            with tc.InferenceServerClient(proc.url) as client:
                with pytest.raises(InferenceServerException, match="query"):
                    client.infer("tiny", by_region())
        http_url = re.search(r"share \S+ \(gRPC\) and (\S+) \(REST\)", proc.output).group(1)
        with th.InferenceServerClient(http_url) as client:  # REST tells the siblings too
            client.register_system_shared_memory("query", key, nbytes)
        for _ in range(CHANNELS // 2):
            with tc.InferenceServerClient(proc.url) as client:
                np.testing.assert_array_equal(client.infer("tiny", by_region()).as_numpy("scores"), expected)
        with th.InferenceServerClient(http_url) as client:
            client.unregister_system_shared_memory("query")
        for _ in range(CHANNELS // 2):
            with tc.InferenceServerClient(proc.url) as client:
                assert not client.get_system_shared_memory_status(as_json=True).get("regions")
    finally:
        shm.destroy_shared_memory_region(handle)


def test_loadgen_channels_reach_every_worker(two_workers, tmp_path):
    proc = two_workers
    before = _served(proc)
    loadgen = Path(sys.executable).parent / "sixfold-loadgen"
    result = subprocess.run([str(loadgen), "--url", proc.url, "--model", "tiny", "--qps", "200", "--duration", "1",
                             "--max-requests", "400", "--channels", str(CHANNELS), "--report", str(tmp_path / "report.json")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["requests"]["errors"] == 0 and report["requests"]["ok"] == report["requests"]["sent"] > 0
    gained = {i: n - before.get(i, 0.0) for i, n in _served(proc).items()}
    assert sorted(gained) == ["0", "1"]
    assert all(n > 0 for n in gained.values()), f"{CHANNELS} channels reached one worker only: {gained}"


def test_the_one_metrics_page_keeps_the_servers_bearer_token():
    proc = ServeProcess("--model", "tiny", "--workers", "2", "--grpc-port", "0", "--metrics-port", "0",
                        "--metrics-token", "m3trics")
    try:
        assert proc.url, proc.output
        port = re.search(r"metrics of all workers on [^:]+:(\d+)", proc.output).group(1)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert refused.value.code == 401
        scrape = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                        headers={"Authorization": "Bearer m3trics"})
        page = urllib.request.urlopen(scrape, timeout=10).read().decode()
        assert 'worker="0"' in page and 'worker="1"' in page
    finally:
        assert proc.stop() == 0, proc.output


def test_a_worker_that_dies_stops_the_whole_server(two_workers):
    proc = two_workers
    workers = _workers(proc)
    os.kill(workers[1], signal.SIGKILL)
    assert proc.proc.wait(timeout=60) == 1
    assert "worker 1" in proc.output and "exited with code -9; stopping the others" in proc.output
    assert _gone(workers[0])


def _workers_of(supervisor: int) -> list[int]:
    """Live worker processes started by ``supervisor`` (their environment names it)."""
    mark = f"SIXFOLD_SUPERVISOR_PID={supervisor}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _wait_for(predicate, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_a_signal_while_starting_stops_cleanly_and_workers_follow_a_killed_supervisor():
    cmd = [str(SERVE), "--model", "tiny", "--workers", "2", "--grpc-port", "0", "--http-port", "-1",
           "--metrics-port", "-1", "--drain-seconds", "0"]
    starting = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert _wait_for(lambda: _workers_of(starting.pid)), "no worker started"
        starting.send_signal(signal.SIGTERM)  # worker 0 is still loading its model
        output, _ = starting.communicate(timeout=120)
        assert starting.returncode == 0, output
        assert "READY" not in output
        assert _wait_for(lambda: not _workers_of(starting.pid), 10)
    finally:
        starting.kill()
    serving = ServeProcess(*cmd[1:])
    try:
        assert serving.url, serving.output
        workers = _workers_of(serving.pid)
        assert len(workers) == 2
        run_folders = list(Path("/dev/shm").glob(f"sixfold-workers-{serving.pid}-*"))
        assert len(run_folders) == 1, "the run folder is named by its supervisor"
        serving.proc.kill()  # SIGKILL: the supervisor cannot pass anything on; the workers follow it out
        assert _wait_for(lambda: all(_gone(pid) for pid in workers)), "workers outlived their supervisor"
        assert run_folders[0].exists()  # nobody could remove it ...
    finally:
        serving.kill()
    following = ServeProcess(*cmd[1:])
    try:
        assert following.url, following.output
        assert not run_folders[0].exists()  # ... until the next supervisor starts
    finally:
        following.kill()


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = tmp_path_factory.mktemp("repo")
    _, partitioned = partition_builtin("rm1", max_rows=300, seed=0, cards=2)
    write_artifacts(partitioned, root / "alpha" / "1")
    return root


def test_model_control_reaches_every_worker_and_deltas_are_refused(repository):
    proc = ServeProcess("--model-repository", str(repository), "--model-control-mode", "explicit",
                        "--control-token", "s3cret", "--cards", "2", "--workers", "2", "--grpc-port", "0",
                        "--metrics-port", "-1")
    token = {"authorization": "Bearer s3cret"}
    try:
        assert proc.url, proc.output
        request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=5).make(4)
        with tc.InferenceServerClient(proc.url) as client:
            assert not client.is_model_ready("alpha")
            client.load_model("alpha", headers=token)
        for _ in range(CHANNELS):
            with tc.InferenceServerClient(proc.url) as client:
                assert client.is_model_ready("alpha")
                assert client.infer("alpha", triton_inputs(tc, request)).as_numpy("scores").shape == (4, 1)
        with tc.InferenceServerClient(proc.url) as client:
            with pytest.raises(InferenceServerException, match="--workers 1") as refused:
                client.load_model("alpha", headers=token, config=json.dumps(
                    {"parameters": {"sixfold.delta_rollback": {"string_value": "true"}}}))
            assert "FAILED_PRECONDITION" in str(refused.value.status())
            client.unload_model("alpha", headers=token)
        for _ in range(CHANNELS):
            with tc.InferenceServerClient(proc.url) as client:
                assert not client.is_model_ready("alpha")
    finally:
        assert proc.stop() == 0, proc.output


def test_workers_refuse_what_they_cannot_share_and_one_server_refuses_a_busy_port(repository, tmp_path):
    result = subprocess.run([str(SERVE), "--model-repository", str(repository), "--workers", "2",
                             "--watch-deltas", str(tmp_path), "--grpc-port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--watch-deltas needs --workers 1" in result.stderr
    result = subprocess.run([str(SERVE), "--model", "tiny", "--workers", "0"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--workers must be >= 1" in result.stderr
    port = free_port()
    first = ServeProcess("--model", "tiny", "--grpc-port", str(port), "--metrics-port", "-1")
    try:
        assert first.url, first.output
        # gRPC would share a busy port silently (SO_REUSEPORT); a second server must not take half its clients
        second = subprocess.run([str(SERVE), "--model", "tiny", "--grpc-port", str(port), "--metrics-port", "-1",
                                 "--http-port", "-1", "--no-warmup"], capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and f"could not bind 127.0.0.1:{port}" in second.stderr, second.stderr
        # workers bind with SO_REUSEPORT, which could join another server's port: they check it first
        workers = subprocess.run([str(SERVE), "--model", "tiny", "--workers", "2", "--grpc-port", str(port),
                                  "--metrics-port", "-1", "--http-port", "-1"], capture_output=True, text=True,
                                 timeout=120)
        assert workers.returncode == 2 and f"could not bind 127.0.0.1:{port} for gRPC" in workers.stderr, \
            workers.stdout + workers.stderr
    finally:
        assert first.stop() == 0
