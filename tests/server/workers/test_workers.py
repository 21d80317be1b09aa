"""sixfold-serve --workers N as a user runs it: real processes on one port, stock tritonclient, real /dev/shm."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
import shutil
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
from sixfold.partitioner.tables.checksums import table_checksums
from sixfold.partitioner.tables.deltas import make_delta
from sixfold.server.deltas.cli import apply_delta, rollback_delta
from tests.conftest import ServeProcess, free_port, triton_inputs

SERVE = Path(sys.executable).parent / "sixfold-serve"
CHANNELS = 24
"""Fresh channels per check: with 2 front ends, all landing on one has odds of 2**-23."""


def _pids(proc: ServeProcess) -> dict[int, int]:
    """worker index -> pid, from the supervisor's lines (0: the engine; 1..N: the front ends)."""
    return {int(i): int(pid) for i, pid in re.findall(r"worker (\d+) pid (\d+) \((?:the engine|a front end)\)",
                                                      proc.output)}


def _page(proc: ServeProcess, token: str | None = None) -> str:
    port = re.search(r"metrics of all workers on [^:]+:(\d+)", proc.output).group(1)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    return urllib.request.urlopen(request, timeout=10).read().decode()


def _served(proc: ServeProcess, model: str = "tiny", exact: bool = True) -> dict[str, float]:
    """Inference requests each front end answered, from the server's one /metrics page (``exact``: they add up
    to the engine's count, as they do while no front end was restarted)."""
    page = _page(proc)
    served = {m[0]: float(m[1]) for m in re.findall(r'^sixfold_frontend_requests_total\{frontend="(\d+)"\} (\S+)$',
                                                     page, re.M)}
    total = re.search(rf'^nv_inference_request_success\{{model="{model}",version="1"\}} (\S+)$', page, re.M)
    assert total and (float(total.group(1)) == sum(served.values()) or not exact), page  # the engine's count
    return served


def _http_url(proc: ServeProcess) -> str:
    """The REST ``HOST:PORT``: of the front ends, or of one process."""
    found = re.search(r"share \S+ \(gRPC\) and (\S+) \(REST\)", proc.output) or \
        re.search(r"REST https?://(\S+)/v2", proc.output)
    return found.group(1)


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


def _answers(url: str, http_url: str, request: dict) -> list[np.ndarray]:
    """Scores over CHANNELS fresh gRPC channels, then CHANNELS // 2 fresh REST connections."""
    answers = []
    for _ in range(CHANNELS):  # each client is its own channel, so its own connection
        with tc.InferenceServerClient(url) as client:
            answers.append(client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores"))
    for _ in range(CHANNELS // 2):
        with th.InferenceServerClient(http_url) as client:
            answers.append(client.infer("tiny", triton_inputs(th, request)).as_numpy("scores"))
    return answers


def test_four_front_ends_answer_as_one_process_and_stop_on_sigterm():
    request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=3).make(5)
    single = ServeProcess("--model", "tiny", "--grpc-port", "0", "--metrics-port", "-1")
    try:
        assert single.url, single.output
        with tc.InferenceServerClient(single.url) as client:
            expected = client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores")
    finally:
        assert single.stop() == 0, single.output
    proc = ServeProcess("--model", "tiny", "--workers", "4", "--grpc-port", "0", "--metrics-port", "0")
    try:
        assert proc.url, proc.output
        pids = _pids(proc)
        assert sorted(pids) == [0, 1, 2, 3, 4], proc.output
        before = _served(proc)
        for scores in _answers(proc.url, _http_url(proc), request):
            np.testing.assert_array_equal(scores, expected)
        gained = {i: n - before.get(i, 0.0) for i, n in _served(proc).items()}
        assert sum(gained.values()) == CHANNELS + CHANNELS // 2, gained
        assert len([n for n in gained.values() if n > 0]) >= 2, f"one front end took every connection: {gained}"
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(timeout=60) == 0, proc.output
        assert all(_gone(pid) for pid in pids.values())
        assert "worker 0] sixfold-serve: stopped" in proc.output
    finally:
        proc.kill()


def _own_connection(url: str) -> tc.InferenceServerClient:
    """A client with a TCP connection of its own (gRPC shares one among a process's open channels to a target)."""
    return tc.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)])


def test_requests_from_different_front_ends_meet_in_one_batch():
    # a long batching window, and no early dispatch: whatever arrives within it is one batch
    proc = ServeProcess("--model", "tiny", "--workers", "2", "--grpc-port", "0", "--metrics-port", "0",
                        "--max-queue-delay-us", "600000", "--no-all-in-dispatch", "--default-timeout-us", "30000000")
    clients = []
    try:
        assert proc.url, proc.output
        request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=6).make(1)
        count = 16
        clients = [_own_connection(proc.url) for _ in range(count)]
        for client in clients:  # connected (each its own channel, so its own front end) before the burst
            assert client.is_server_ready()
        with tc.InferenceServerClient(proc.url) as client:
            stats = client.get_inference_statistics("tiny").model_stats[0]
        before = _served(proc)
        barrier = threading.Barrier(count)
        answers: list = [None] * count

        def ask(i: int) -> None:
            barrier.wait(timeout=30)
            answers[i] = clients[i].infer("tiny", triton_inputs(tc, request), client_timeout=60).as_numpy("scores")

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=90)
        assert all(a is not None for a in answers)
        with tc.InferenceServerClient(proc.url) as client:
            after = client.get_inference_statistics("tiny").model_stats[0]
        gained = {i: n - before.get(i, 0.0) for i, n in _served(proc).items()}
        assert sum(gained.values()) == count and all(n > 0 for n in gained.values()), \
            f"the burst did not reach both front ends: {gained}"
        assert after.inference_count - stats.inference_count == count
        assert after.execution_count - stats.execution_count == 1, "both front ends' requests: one batch"
    finally:
        for client in clients:
            client.close()
        proc.kill()


def test_a_bad_request_gets_the_error_one_process_gives():
    config = models.get_config("tiny")
    good = models.RequestGenerator.for_config(config, seed=7).make(2)
    wrong_dtype = {**good, "dense_features": good["dense_features"].astype(np.int32)}
    missing = {k: v for k, v in good.items() if k != "sparse_indices"}
    renamed = {("dense" if k == "dense_features" else k): v for k, v in good.items()}

    def errors(proc: ServeProcess) -> list[str]:
        seen = []
        for module, url in ((tc, proc.url), (th, _http_url(proc))):
            with module.InferenceServerClient(url) as client:
                for model, request in (("nope", good), ("tiny", wrong_dtype), ("tiny", missing), ("tiny", renamed)):
                    with pytest.raises(InferenceServerException) as refused:
                        client.infer(model, triton_inputs(module, request))
                    seen.append(f"{refused.value.status()} {refused.value.message()}")
        return seen

    expected = []
    for workers in ("1", "2"):
        proc = ServeProcess("--model", "tiny", "--workers", workers, "--grpc-port", "0", "--metrics-port", "-1")
        try:
            assert proc.url, proc.output
            seen = errors(proc)
        finally:
            assert proc.stop() == 0, proc.output
        if not expected:
            expected = seen
    assert seen == expected
    assert any("dense_features" in e for e in expected) and any("nope" in e for e in expected)


def test_a_killed_front_end_fails_its_clients_fast_and_is_restarted():
    proc = ServeProcess("--model", "tiny", "--workers", "2", "--grpc-port", "0", "--metrics-port", "0",
                        "--max-queue-delay-us", "2000000", "--no-all-in-dispatch", "--default-timeout-us", "30000000")
    clients = []
    try:
        assert proc.url, proc.output
        pids = _pids(proc)
        folder = Path(re.search(r"run folder (\S+)", proc.output).group(1))
        request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=8).make(1)
        clients = [_own_connection(proc.url) for _ in range(CHANNELS)]
        for client in clients:
            assert client.is_server_ready()
        outcomes: list = [None] * len(clients)

        def ask(i: int) -> None:
            started = time.monotonic()
            try:
                clients[i].infer("tiny", triton_inputs(tc, request), client_timeout=60)
                outcomes[i] = ("ok", time.monotonic() - started)
            except InferenceServerException as exc:
                outcomes[i] = (str(exc.status()), time.monotonic() - started)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(clients))]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # every request waits in the engine's 2 s batching window
        os.kill(pids[1], signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=30)
        assert all(o is not None for o in outcomes), "a client hung"
        failed = [o for o in outcomes if o[0] != "ok"]
        assert failed and all(o[0] == "StatusCode.UNAVAILABLE" and o[1] < 10 for o in failed), outcomes
        assert len(failed) < len(outcomes), "the other front end's clients are answered"
        assert _wait_for(lambda: "front end 1 (pid" in proc.output and "restarted as pid" in proc.output), proc.output
        assert proc.proc.poll() is None
        fresh = _pids_after_restart(proc)
        assert fresh != pids[1] and not _gone(fresh)
        assert _wait_for(lambda: len(list(folder.glob("frontend-1-*.in"))) == 1, 10), "the dead one's arena stays"
        for scores in _answers(proc.url, _http_url(proc), request):
            assert scores.shape == (1, 1)
        assert all(n > 0 for n in _served(proc, exact=False).values())
    finally:
        for client in clients:
            client.close()
        proc.kill()


def _pids_after_restart(proc: ServeProcess) -> int:
    return int(re.findall(r"restarted as pid (\d+)", proc.output)[-1])


def test_a_shared_memory_region_registered_through_one_front_end_is_known_to_all(two_workers):
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
        with th.InferenceServerClient(http_url) as client:  # REST registers it in the engine too
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


def test_loadgen_channels_reach_every_front_end(two_workers, tmp_path):
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
    assert sorted(gained) == ["1", "2"]
    assert all(n > 0 for n in gained.values()), f"{CHANNELS} channels reached one front end only: {gained}"


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
        assert 'worker="0"' in page and 'worker="1"' in page and 'worker="2"' in page
    finally:
        assert proc.stop() == 0, proc.output


def test_an_engine_that_dies_stops_the_whole_server(two_workers):
    proc = two_workers
    pids = _pids(proc)
    os.kill(pids[0], signal.SIGKILL)
    assert proc.proc.wait(timeout=60) == 1
    assert "the engine (pid" in proc.output and "exited with code -9; stopping the front ends" in proc.output
    assert _wait_for(lambda: _gone(pids[1]) and _gone(pids[2]), 30)


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
        assert len(workers) == 3  # the engine and two front ends
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
    changed = tmp_path_factory.mktemp("changed")
    shutil.copytree(root / "alpha" / "1", changed / "1")
    rng = np.random.default_rng(1)
    for path in sorted((changed / "1" / "tables").glob("table_*.npy"))[:3]:
        table = np.load(path)
        table[rng.choice(table.shape[0], 30, replace=False)] += 1.0
        np.save(path, table)
    plan = json.loads((changed / "1" / "plan.json").read_text())
    plan["tables"]["checksums"] = table_checksums(changed / "1" / "tables")
    (changed / "1" / "plan.json").write_text(json.dumps(plan))
    make_delta(root / "alpha" / "1", changed / "1", changed / "delta")
    return root, changed / "delta"


def test_model_control_and_a_delta_reach_every_front_end_of_four(repository):
    root, delta = repository
    proc = ServeProcess("--model-repository", str(root), "--model-control-mode", "explicit",
                        "--control-token", "s3cret", "--cards", "2", "--workers", "4", "--grpc-port", "0",
                        "--metrics-port", "0")
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
            before = client.infer("alpha", triton_inputs(tc, request)).as_numpy("scores")
        assert apply_delta(proc.url, "alpha", delta, token="s3cret") == "1"
        after = []
        for _ in range(CHANNELS):  # every front end asks the one engine, which holds the one copy of the tables
            with tc.InferenceServerClient(proc.url) as client:
                after.append(client.infer("alpha", triton_inputs(tc, request)).as_numpy("scores"))
        assert not np.array_equal(after[0], before), "the delta changed no answer"
        for scores in after[1:]:
            np.testing.assert_array_equal(scores, after[0])
        served = _served(proc, "alpha")
        assert sorted(served) == ["1", "2", "3", "4"] and all(n > 0 for n in served.values()), served
        assert rollback_delta(proc.url, "alpha", token="s3cret") == "0"
        for _ in range(CHANNELS // 2):
            with tc.InferenceServerClient(proc.url) as client:
                np.testing.assert_array_equal(client.infer("alpha", triton_inputs(tc, request)).as_numpy("scores"),
                                              before)
        with tc.InferenceServerClient(proc.url) as client:
            client.unload_model("alpha", headers=token)
        for _ in range(CHANNELS):
            with tc.InferenceServerClient(proc.url) as client:
                assert not client.is_model_ready("alpha")
    finally:
        assert proc.stop() == 0, proc.output


def test_a_bad_worker_count_and_a_busy_port_are_refused():
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
