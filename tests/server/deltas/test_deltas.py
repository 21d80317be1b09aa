"""Table deltas over real gRPC: apply while serving, bit-identical to the new version, rejected whole, rolled
back, persisted across a restart, reaching a tiered store, never mixed under concurrent load."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.tables.checksums import file_checksum, table_checksums
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.tables.deltas import DELTA_FILE, DeltaError, make_delta, read_delta
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.deltas.cli import apply_delta, rollback_delta
from sixfold.server.deltas.delta_log import DeltaWatcher
from sixfold.server.loading.loader import load_from_repository
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository
from tests.conftest import free_port, triton_inputs

ROWS = 300  # rm1: 8 tables x 300 rows x dim 32
TOKEN = "s3cret"
MODELS = ("resident", "tiered")


def _change(version: Path, seed: int, tables=(0, 3, 5), share=0.1) -> None:
    """Rewrite some rows of some tables in place, and plan.json's checksums."""
    rng = np.random.default_rng(seed)
    for t in tables:
        path = version / "tables" / f"table_{t:03d}.npy"
        a = np.load(path)
        ids = rng.choice(a.shape[0], int(a.shape[0] * share), replace=False)
        a[ids] = rng.standard_normal((ids.shape[0], a.shape[1])).astype(np.float32)
        np.save(path, a)
    plan = json.loads((version / "plan.json").read_text())
    plan["tables"]["checksums"] = table_checksums(version / "tables")
    (version / "plan.json").write_text(json.dumps(plan))


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """v1 (built), v2 (some rows changed), v3 (more changed), and the deltas v1->v2 (seq 1), v2->v3 (seq 2)."""
    root = tmp_path_factory.mktemp("versions")
    _, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=2, cards=2)
    write_artifacts(partitioned, root / "v1")
    shutil.copytree(root / "v1", root / "v2")
    _change(root / "v2", 1)
    shutil.copytree(root / "v2", root / "v3")
    _change(root / "v3", 2, tables=(1, 3))
    make_delta(root / "v1", root / "v2", root / "d1")
    make_delta(root / "v2", root / "v3", root / "d2", base_sequence=1)
    return root


def _repo(root: Path, versions: Path, version: str = "v1") -> Path:
    for name in MODELS:
        shutil.copytree(versions / version, root / name / "1")
    (root / "tiered" / "config.pbtxt").write_text(
        'name: "tiered"\nparameters { key: "sixfold.table_memory" value { string_value: "110KiB" } }\n'
        'dynamic_batching { max_queue_delay_microseconds: 0 }\n')
    (root / "resident" / "config.pbtxt").write_text('name: "resident"\n'
                                                    'dynamic_batching { max_queue_delay_microseconds: 0 }\n')
    return root


class _Server:
    def __init__(self, repo: Path, explicit: bool = True) -> None:
        self.metrics = ServerMetrics()
        self.core = InferenceCore()

        def loader(r, name, version):
            return load_from_repository(r, name, version, backend="simcard", metrics=self.metrics,
                                        batching=BatchingConfig(max_queue_delay_microseconds=0))

        self.core.control = ModelControl(self.core, ModelRepository(repo), loader, explicit=explicit)
        self.metrics_port = free_port()
        self.background = BackgroundServer(self.core, ServerConfig(grpc_port=0, http_port=0,
                                                                   metrics_port=self.metrics_port,
                                                                   control_token=TOKEN), self.metrics).start()
        for name in MODELS:
            self.run(self.core.control.load(name))
        self.url = self.background.url

    def run(self, coroutine, timeout=120):
        return asyncio.run_coroutine_threadsafe(coroutine, self.background._loop).result(timeout=timeout)

    def stop(self) -> None:
        self.background.stop()


@pytest.fixture()
def server(tmp_path, versions):
    s = _Server(_repo(tmp_path / "repo", versions))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def answers(tmp_path_factory, versions):
    """Scores of the test requests from servers started on v1, v2 and v3 (each model)."""
    out = {}
    for version in ("v1", "v2", "v3"):
        s = _Server(_repo(tmp_path_factory.mktemp(version), versions, version))
        try:
            client = grpcclient.InferenceServerClient(s.url)
            out[version] = {name: [_infer(client, name, r) for r in REQUESTS] for name in MODELS}
        finally:
            s.stop()
    return out


def _requests(count: int, seed: int):
    gen = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=ROWS), seed=seed)
    rng = np.random.default_rng(seed)
    return [gen.make(int(rng.integers(1, 40))) for _ in range(count)]


REQUESTS = _requests(6, seed=5)


def _infer(client, name, request):
    result = client.infer(name, triton_inputs(grpcclient, request),
                          outputs=[grpcclient.InferRequestedOutput("scores")], client_timeout=60)
    return result.as_numpy("scores")


def _scores(url, name):  # noqa: D103
    client = grpcclient.InferenceServerClient(url)
    return [_infer(client, name, r) for r in REQUESTS]


def _same(got, want) -> bool:
    return all(np.array_equal(a, b) for a, b in zip(got, want))


def _sequence(url, name) -> str:
    config = grpcclient.InferenceServerClient(url).get_model_config(name, as_json=True)["config"]
    return config["parameters"]["sixfold.delta_sequence"]["string_value"]


def _metric(port, name) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in page.splitlines():
        if line.startswith("sixfold_model_delta_sequence{") and f'model="{name}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no sixfold_model_delta_sequence series for " + name)


def test_versions_differ(answers):
    for name in MODELS:
        assert not _same(answers["v1"][name], answers["v2"][name])
        assert _same(answers["v1"]["resident"], answers["v1"]["tiered"])


@pytest.mark.parametrize("name", MODELS)
def test_apply_answers_as_the_new_version_then_rolls_back(server, versions, answers, name):
    assert _sequence(server.url, name) == "0"
    assert _same(_scores(server.url, name), answers["v1"][name])
    assert apply_delta(server.url, name, versions / "d1", token=TOKEN) == "1"
    assert _same(_scores(server.url, name), answers["v2"][name])  # bit-identical to a server on v2
    assert _metric(server.metrics_port, name) == 1
    assert apply_delta(server.url, name, versions / "d2", token=TOKEN, server_path=True) == "2"
    assert _same(_scores(server.url, name), answers["v3"][name])
    assert rollback_delta(server.url, name, token=TOKEN, from_sequence=2) == "1"
    assert _same(_scores(server.url, name), answers["v2"][name])
    # the same rollback again (its reply lost, say): refused, and nothing more is undone
    with pytest.raises(InferenceServerException, match="expects sequence 2 but the model serves sequence 1"):
        rollback_delta(server.url, name, token=TOKEN, from_sequence=2)
    assert _sequence(server.url, name) == "1" and _same(_scores(server.url, name), answers["v2"][name])
    assert rollback_delta(server.url, name, token=TOKEN) == "0"
    assert _same(_scores(server.url, name), answers["v1"][name])
    with pytest.raises(InferenceServerException, match="no delta to roll back"):
        rollback_delta(server.url, name, token=TOKEN)


def test_restart_serves_the_applied_rows(tmp_path, versions, answers):
    repo = _repo(tmp_path / "repo", versions)
    first = _Server(repo)
    try:
        for name in MODELS:
            apply_delta(first.url, name, versions / "d1", token=TOKEN)
            apply_delta(first.url, name, versions / "d2", token=TOKEN)
            rollback_delta(first.url, name, token=TOKEN)
    finally:
        first.stop()
    second = _Server(repo)
    try:
        for name in MODELS:
            assert _sequence(second.url, name) == "1"
            assert _same(_scores(second.url, name), answers["v2"][name])
            assert apply_delta(second.url, name, versions / "d2", token=TOKEN) == "2"
            assert _same(_scores(second.url, name), answers["v3"][name])
    finally:
        second.stop()
    # the base tables were never rewritten
    assert file_checksum(repo / "resident" / "1" / "tables" / "table_000.npy") == \
        file_checksum(versions / "v1" / "tables" / "table_000.npy")


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite(delta: Path, table_file: str, array: np.ndarray, entry_changes: dict | None = None) -> None:
    """Replace one file of a delta (and its checksum in delta.json, so only the intended fault remains)."""
    np.save(delta / table_file, array)
    meta = json.loads((delta / DELTA_FILE).read_text())
    for entry in meta["tables"]:
        for key in ("ids", "values", "packed"):
            if entry.get(key) and entry[key]["file"] == table_file:
                entry[key]["checksum"] = file_checksum(delta / table_file)
        entry.update((entry_changes or {}).get(entry["table"], {}))
    (delta / DELTA_FILE).write_text(json.dumps(meta))


def _bad_deltas(versions: Path, tmp: Path) -> dict[str, tuple[Path, str]]:
    d1 = versions / "d1"
    first = read_delta(d1).tables[0]
    t = first.table
    cases = {}
    cases["gap"] = (versions / "d2", "a gap")
    other = _copy(versions / "v1", tmp / "other")
    _change(other, 9)
    cases["wrong base"] = (make_delta(other, versions / "v2", tmp / "wrong-base").path, "wrong base")
    bad = _copy(d1, tmp / "checksum")
    rows = np.load(bad / f"table_{t:03d}.rows.npy")
    rows[0, 0] += 1
    np.save(bad / f"table_{t:03d}.rows.npy", rows)
    cases["checksum"] = (bad, f"table_{t:03d}.rows.npy: checksum mismatch")
    bad = _copy(d1, tmp / "unknown-table")
    meta = json.loads((bad / DELTA_FILE).read_text())
    meta["tables"][0]["table"] = 99
    (bad / DELTA_FILE).write_text(json.dumps(meta))
    cases["unknown table"] = (bad, "unknown table 99")
    bad = _copy(d1, tmp / "range")
    ids = first.ids.copy()
    ids[-1] = ROWS + 5
    _rewrite(bad, f"table_{t:03d}.ids.npy", ids)
    cases["id out of range"] = (bad, f"id {ROWS + 5} is out of range for table {t}")
    bad = _copy(d1, tmp / "dim")
    _rewrite(bad, f"table_{t:03d}.rows.npy", np.zeros((first.count, 33), np.float32), {t: {"dim": 33}})
    cases["dim"] = (bad, "rows of dim 33")
    bad = _copy(d1, tmp / "dtype")
    _rewrite(bad, f"table_{t:03d}.rows.npy", first.values.astype(np.float64))
    cases["dtype"] = (bad, "expected float32")
    bad = _copy(d1, tmp / "model")
    meta = json.loads((bad / DELTA_FILE).read_text())
    meta["model"] = "rm9"
    (bad / DELTA_FILE).write_text(json.dumps(meta))
    cases["model"] = (bad, "model 'rm9'")
    bad = _copy(d1, tmp / "missing")
    (bad / f"table_{t:03d}.ids.npy").unlink()
    cases["missing file"] = (bad, f"table_{t:03d}.ids.npy: missing")
    return cases


def test_bad_deltas_are_rejected_whole(server, versions, answers, tmp_path):
    cases = _bad_deltas(versions, tmp_path)
    for name in MODELS:
        for case, (delta, message) in cases.items():
            with pytest.raises(InferenceServerException) as caught:
                apply_delta(server.url, name, delta, token=TOKEN, server_path=True)
            assert message in caught.value.message(), (case, caught.value.message())
            assert _sequence(server.url, name) == "0", case
            assert _same(_scores(server.url, name), answers["v1"][name]), case
        assert not list((server.core.model(name).deltas.folder).glob("0*")), "no log entry left behind"
    # and a good one still applies after them
    assert apply_delta(server.url, "resident", versions / "d1", token=TOKEN) == "1"


def test_model_control_needs_the_token(server, versions):
    with pytest.raises(InferenceServerException, match="authorization"):
        apply_delta(server.url, "resident", versions / "d1", token="wrong")
    assert _sequence(server.url, "resident") == "0"


def test_delta_json_is_checked_on_its_own(versions, tmp_path):
    bad = _copy(versions / "d1", tmp_path / "seq")
    meta = json.loads((bad / DELTA_FILE).read_text())
    meta["sequence"] = 5
    (bad / DELTA_FILE).write_text(json.dumps(meta))
    with pytest.raises(DeltaError, match="sequence 5 must follow its base sequence 0"):
        read_delta(bad)
    (bad / DELTA_FILE).write_text("{not json")
    with pytest.raises(DeltaError, match="delta.json: not valid JSON"):
        read_delta(bad)


def test_rest_applies_and_rolls_back(server, versions, answers):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.background.http_url)
    headers = {"authorization": f"Bearer {TOKEN}"}
    body = json.dumps({"parameters": {"sixfold.delta_path": str(versions / "d1")}}).encode()
    request = urllib.request.Request(f"http://{server.background.http_url}/v2/repository/models/resident/load",
                                     data=body, headers=headers, method="POST")
    reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
    assert reply["sequence"] == 1
    assert _same(_scores(server.url, "resident"), answers["v2"]["resident"])
    body = json.dumps({"parameters": {"sixfold.delta_rollback": True}}).encode()
    request = urllib.request.Request(f"http://{server.background.http_url}/v2/repository/models/resident/load",
                                     data=body, headers=headers, method="POST")
    assert json.loads(urllib.request.urlopen(request, timeout=60).read())["sequence"] == 0
    assert client.get_model_config("resident")["parameters"]["sixfold.delta_sequence"]["string_value"] == "0"


def test_concurrent_load_sees_old_or_new_never_a_mix(server, versions, answers):
    """Clients keep sending while deltas apply and roll back: no request fails, each answer is one version's."""
    name = "resident"
    known = [answers[v][name] for v in ("v1", "v2", "v3")]
    errors: list[str] = []
    seen = [0, 0, 0]
    stop = threading.Event()

    def client_loop(seed: int) -> None:
        client = grpcclient.InferenceServerClient(server.url)
        k = seed
        while not stop.is_set() and k < seed + 400:
            i = k % len(REQUESTS)
            try:
                got = _infer(client, name, REQUESTS[i])
            except InferenceServerException as exc:
                errors.append(exc.message())
                return
            match = [v for v in range(3) if np.array_equal(got, known[v][i])]
            if not match:
                errors.append(f"request {i}: an answer of no version (a mix)")
                return
            seen[match[0]] += 1
            k += 1

    threads = [threading.Thread(target=client_loop, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(2):
            apply_delta(server.url, name, versions / "d1", token=TOKEN)
            apply_delta(server.url, name, versions / "d2", token=TOKEN)
            rollback_delta(server.url, name, token=TOKEN)
            rollback_delta(server.url, name, token=TOKEN)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors[:3]
    assert sum(seen) > 0, seen


def test_watched_folder_applies_in_order_and_skips_bad_ones(server, versions, answers, tmp_path):
    watched = tmp_path / "watched"
    watched.mkdir()

    def named(src: Path, dst: Path, model: str) -> Path:  # the watcher applies a delta to the model it names
        meta = json.loads((_copy(src, tmp_path / "staging" / dst.name) / DELTA_FILE).read_text())
        meta["model"] = model
        (tmp_path / "staging" / dst.name / DELTA_FILE).write_text(json.dumps(meta))
        shutil.move(tmp_path / "staging" / dst.name, dst)  # written beside, moved in whole
        return dst

    named(versions / "d2", watched / "b-second", "resident")  # waits for the first
    broken = named(versions / "d1", watched / "a-broken", "tiered")
    first = read_delta(broken).tables[0]
    rows = np.load(broken / f"table_{first.table:03d}.rows.npy")
    rows[:] = 0
    np.save(broken / f"table_{first.table:03d}.rows.npy", rows)  # checksum mismatch: rejected, skipped
    watcher = DeltaWatcher(server.core, watched, interval_s=0.05)
    assert server.run(watcher.scan()) == 0
    assert _sequence(server.url, "resident") == "0"
    named(versions / "d1", watched / "c-first", "resident")
    assert server.run(watcher.scan()) == 2  # c-first, then b-second, in sequence order
    assert _sequence(server.url, "resident") == "2"
    assert _sequence(server.url, "tiered") == "0"
    assert _same(_scores(server.url, "resident"), answers["v3"]["resident"])
    assert server.run(watcher.scan()) == 0


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sixfold.server.deltas.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_cli_make_apply_rollback_and_a_watched_folder(tmp_path, versions, answers):
    from tests.conftest import ServeProcess

    made = _cli("make", str(versions / "v1"), str(versions / "v2"), "--out", str(tmp_path / "d"), "--model",
                "resident", "--quiet")
    assert made.returncode == 0, made.stderr
    assert "sequence 0 -> 1" in made.stdout
    shown = json.loads(_cli("show", str(tmp_path / "d")).stdout)
    assert shown["model"] == "resident" and shown["rows"] == read_delta(versions / "d1").rows
    repo = _repo(tmp_path / "repo", versions)
    watched = tmp_path / "watched"
    watched.mkdir()
    serve = ServeProcess("--model-repository", str(repo), "--model-control-mode", "explicit", "--load-model",
                         "resident", "--control-token", TOKEN, "--watch-deltas", str(watched), "--grpc-port", "0",
                         "--metrics-port", "-1", "--backend", "simcard", "--max-queue-delay-us", "0")
    try:
        assert serve.url, serve.output
        shutil.copytree(tmp_path / "d", tmp_path / "staged")
        os.replace(tmp_path / "staged", watched / "d1")  # moved in whole
        deadline = time.monotonic() + 120
        while _sequence(serve.url, "resident") != "1" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _sequence(serve.url, "resident") == "1", serve.output
        assert _same(_scores(serve.url, "resident"), answers["v2"]["resident"])
        refused = _cli("rollback", "--url", serve.url, "--model", "resident", "--control-token", "wrong")
        assert refused.returncode == 1 and "authorization" in refused.stderr
        (tmp_path / "token").write_text(TOKEN + "\n")
        stale = _cli("rollback", "--url", serve.url, "--model", "resident", "--control-token-file",
                     str(tmp_path / "token"), "--from-sequence", "2")
        assert stale.returncode == 1 and "expects sequence 2 but the model serves sequence 1" in stale.stderr
        rolled = _cli("rollback", "--url", serve.url, "--model", "resident", "--control-token-file",
                      str(tmp_path / "token"), "--from-sequence", "1")
        assert rolled.returncode == 0 and "serves delta sequence 0" in rolled.stdout, rolled.stderr
        assert "warning" not in rolled.stderr
        assert "process list" in refused.stderr  # the token given in argv is warned about
        applied = _cli("apply", "--url", serve.url, "--model", "resident", "--control-token", TOKEN,
                       str(tmp_path / "d"))
        assert applied.returncode == 0 and "serves delta sequence 1" in applied.stdout, applied.stderr
        again = _cli("apply", "--url", serve.url, "--model", "resident", "--control-token", TOKEN,
                     str(tmp_path / "d"))
        assert again.returncode == 1 and "serves sequence 1 already" in again.stderr
        assert _same(_scores(serve.url, "resident"), answers["v2"]["resident"])
    finally:
        serve.kill()


def test_a_trainer_written_delta_chains_on_the_served_fingerprint(server, versions, answers, tmp_path):
    """write_delta (rows a trainer knows it changed) on top of a made delta: the server takes the chain."""
    from sixfold.partitioner.tables.deltas import write_delta

    apply_delta(server.url, "resident", versions / "d1", token=TOKEN)
    served = grpcclient.InferenceServerClient(server.url).get_model_config("resident", as_json=True)["config"]
    fingerprint = served["parameters"]["sixfold.delta_fingerprint"]["string_value"]
    d2 = read_delta(versions / "d2")
    write_delta(tmp_path / "t2", "resident", 1, fingerprint, {t.table: (t.ids, t.values) for t in d2.tables})
    assert apply_delta(server.url, "resident", tmp_path / "t2", token=TOKEN) == "2"
    assert _same(_scores(server.url, "resident"), answers["v3"]["resident"])


@pytest.mark.parametrize("memory", [None, "110KiB"])
def test_int8_tables_take_the_packed_rows(tmp_path, memory):
    """An int8 model: the delta carries packed rows (make quantizes them as the server would); resident and tiered."""
    _, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=2, cards=2, table_precision="int8")
    write_artifacts(partitioned, tmp_path / "v1")
    shutil.copytree(tmp_path / "v1", tmp_path / "v2")
    _change(tmp_path / "v2", 4)
    delta = make_delta(tmp_path / "v1", tmp_path / "v2", tmp_path / "d", model="q")
    assert all(t.packed is not None and t.packed_precision == "int8" for t in delta.tables)
    scores = {}
    for version in ("v1", "v2"):
        root = tmp_path / f"repo-{version}"
        shutil.copytree(tmp_path / version, root / "q" / "1")
        if memory:
            (root / "q" / "config.pbtxt").write_text(
                f'name: "q"\nparameters {{ key: "sixfold.table_memory" value {{ string_value: "{memory}" }} }}\n')
        metrics, core = ServerMetrics(), InferenceCore()
        core.control = ModelControl(core, ModelRepository(root), lambda r, n, v: load_from_repository(
            r, n, v, backend="simcard", metrics=metrics, batching=BatchingConfig(max_queue_delay_microseconds=0)),
            explicit=True)
        background = BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None), metrics).start()
        try:
            asyncio.run_coroutine_threadsafe(core.control.load("q"), background._loop).result(timeout=120)
            scores[version] = _scores(background.url, "q")
            if version == "v1":
                assert apply_delta(background.url, "q", tmp_path / "d") == "1"
                scores["applied"] = _scores(background.url, "q")
        finally:
            background.stop()
    assert not _same(scores["v1"], scores["v2"])
    assert _same(scores["applied"], scores["v2"])


def test_rest_upload_and_a_damaged_upload(server, versions, answers):
    """REST load with the delta's files as base64 ``file:`` parameters (Triton's REST load convention)."""
    import base64

    def load(files: dict[str, bytes]) -> urllib.request.Request:
        body = json.dumps({"parameters": {f"file:{k}": base64.b64encode(v).decode() for k, v in files.items()}})
        return urllib.request.Request(f"http://{server.background.http_url}/v2/repository/models/tiered/load",
                                      data=body.encode(), headers={"authorization": f"Bearer {TOKEN}"},
                                      method="POST")

    files = {p.name: p.read_bytes() for p in (versions / "d1").iterdir()}
    damaged = dict(files)
    name = next(k for k in files if k.endswith(".rows.npy"))
    damaged[name] = damaged[name][:-4] + b"\0\0\0\1"
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(load(damaged), timeout=60)
    assert caught.value.code == 400 and "checksum mismatch" in caught.value.read().decode()
    assert _sequence(server.url, "tiered") == "0"
    assert json.loads(urllib.request.urlopen(load(files), timeout=60).read())["sequence"] == 1
    assert _same(_scores(server.url, "tiered"), answers["v2"]["tiered"])
