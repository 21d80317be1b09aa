"""--warm-from: a tiered model's row cache filled from a real loadgen recording before the server is READY."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from sixfold.loadgen import LoadConfig, load_recording, save_recording
from sixfold.loadgen.cli import main as loadgen_main
from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.runner import plan_run
from sixfold.loadgen.target import ModelShape
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_builtin, load_from_repository
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository
from tests.conftest import ServeProcess, free_port, triton_inputs

ROWS = 500  # rm1: 8 tables x 500 rows x dim 32 fp32 = 512 KiB of tables
BUDGET = "200KiB"  # ~700 of the 4000 rows cached
SERVE = Path(sys.executable).parent / "sixfold-serve"


def _config(name: str, memory: str | None = None, warm_from: str | None = None) -> str:
    text = f'name: "{name}"\ndynamic_batching {{ max_queue_delay_microseconds: 0 }}\n'
    for key, value in (("sixfold.table_memory", memory), ("sixfold.warm_from", warm_from)):
        if value is not None:
            text += f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'
    return text


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """resident (all rows in memory), tiered (a table memory), cold (a table memory, warming turned off)."""
    built = tmp_path_factory.mktemp("built") / "rm1"
    _, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=2, cards=2)
    write_artifacts(partitioned, built)
    root = tmp_path_factory.mktemp("repo")
    for name in ("resident", "tiered", "cold"):
        shutil.copytree(built, root / name / "1")
    (root / "resident" / "config.pbtxt").write_text(_config("resident"))
    (root / "tiered" / "config.pbtxt").write_text(_config("tiered", BUDGET))
    (root / "cold" / "config.pbtxt").write_text(_config("cold", BUDGET, warm_from=""))
    return root


@pytest.fixture(scope="module")
def recording(repo, tmp_path_factory):
    """A real ``sixfold-loadgen --record`` run against the resident model, served in this process."""
    metrics = ServerMetrics()
    core = InferenceCore()

    def loader(r, name, version):
        return load_from_repository(r, name, version, backend="simcard", metrics=metrics,
                                    batching=BatchingConfig(max_queue_delay_microseconds=0))

    core.control = ModelControl(core, ModelRepository(repo), loader, explicit=True)
    background = BackgroundServer(core, ServerConfig(grpc_port=0, http_port=None, metrics_port=None), metrics).start()
    out = tmp_path_factory.mktemp("rec")
    try:
        asyncio.run_coroutine_threadsafe(core.control.load("resident"), background._loop).result(timeout=120)
        code = loadgen_main(["--url", background.url, "--model", "resident", "--qps", "10", "--duration", "1",
                             "--query-size", "fixed:4", "--pool", "6", "--seed", "3", "--quiet",
                             "--report", str(out / "report.json"), "--record", str(out / "rec.npz")])
    finally:
        background.stop()
    assert code == 0
    return out / "rec.npz"


def _metrics(port: int) -> dict[str, float]:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in page.splitlines()
            if line.startswith("sixfold_table_") and not line.startswith("#")}


def test_serve_warm_from_fills_the_cache_before_ready_and_answers_like_resident(repo, recording):
    port = free_port()
    serve = ServeProcess("--model-repository", str(repo), "--warm-from", str(recording), "--grpc-port", "0",
                         "--metrics-port", str(port))
    try:
        assert serve.url, serve.output
        out = serve.output
        assert f"model tiered: row cache warmed from {recording}" in out, out
        assert "hit rate on the recorded requests" in out and "cache fill" in out
        assert "model resident has no tiered tables (no table memory): nothing to warm" in out, out
        # its config.pbtxt turns the flag off (sixfold.warm_from ""): not warmed, not even read
        assert "model cold: row cache warmed" not in out and "model cold has no tiered tables" not in out
        before = _metrics(port)  # no request yet: the warmed cache holds rows, the cold one none
        assert before['sixfold_table_cache_rows{model="tiered"}'] > 0
        assert before['sixfold_table_cache_rows{model="tiered"}'] <= before['sixfold_table_cache_slots{model="tiered"}']
        # the cold one holds at most row 0 of each of rm1's 8 tables: the synthetic warm-up batches' (sixfold.server.model.warmup)
        assert before['sixfold_table_cache_rows{model="cold"}'] <= 8
        assert before['sixfold_table_cache_hits_total{model="tiered"}'] == 0
        loaded = load_recording(recording)
        query = dict(loaded.tensors[int(loaded.query[0])])  # the first recorded request's query
        with grpcclient.InferenceServerClient(serve.url) as client:
            scores = {name: client.infer(name, triton_inputs(grpcclient, query), client_timeout=30).as_numpy("scores")
                      for name in ("resident", "tiered", "cold")}
        np.testing.assert_array_equal(scores["tiered"], scores["resident"])
        np.testing.assert_array_equal(scores["cold"], scores["resident"])
        after = _metrics(port)
        # the same first request: the warmed cache answers more of its ids than the cold one (which only
        # hits rows that an earlier part of the same batch admitted: the batch is looked up in runs of bags)
        warm_hits = after['sixfold_table_cache_hits_total{model="tiered"}']
        cold_hits = after['sixfold_table_cache_hits_total{model="cold"}']
        assert warm_hits > cold_hits and warm_hits > 0
        assert after['sixfold_table_cache_misses_total{model="tiered"}'] < after[
            'sixfold_table_cache_misses_total{model="cold"}']
    finally:
        serve.kill()


def test_config_pbtxt_warm_from_is_relative_to_the_model_folder(repo, recording, tmp_path, caplog):
    shutil.copytree(repo / "tiered", tmp_path / "own")
    shutil.copy(recording, tmp_path / "own" / "traffic.npz")
    (tmp_path / "own" / "config.pbtxt").write_text(_config("own", BUDGET, warm_from="traffic.npz"))
    with caplog.at_level(logging.INFO, logger="sixfold.server.model.warm"):
        served = load_from_repository(ModelRepository(tmp_path), "own", "1", backend="simcard",
                                      metrics=ServerMetrics(), batching=BatchingConfig())
    try:
        stores = served.runtime.host.stage.stores
        assert sum(s.cached_rows for s in stores) > 0
        assert all(s.stats.hits == s.stats.misses == 0 for s in stores)  # warming counts no lookup
        assert "model own: row cache warmed from" in caplog.text and "traffic.npz" in caplog.text
    finally:
        served.runtime.close()


def test_a_builtin_model_warms_and_a_resident_one_has_nothing_to_warm(recording, caplog):
    kwargs = dict(max_rows=ROWS, seed=1, cards=1, backend="simcard", card_spec="m2-card", batching=BatchingConfig())
    with caplog.at_level(logging.INFO, logger="sixfold.server.model.warm"):
        tiered = load_builtin("rm1", metrics=ServerMetrics(), table_memory=0.5, warm_from=recording, **kwargs)
        resident = load_builtin("rm1", metrics=ServerMetrics(), warm_from=recording, **kwargs)
    try:
        assert sum(s.cached_rows for s in tiered.runtime.host.stage.stores) > 0
        assert "model rm1: row cache warmed from" in caplog.text
        assert "model rm1 has no tiered tables (no table memory): nothing to warm" in caplog.text
        query = load_recording(recording).tensors[0]
        host_inputs = {k: query[k] for k in ("sparse_lengths", "sparse_indices")}
        (a,), (b,) = resident.runtime.host.run(host_inputs).values(), tiered.runtime.host.run(host_inputs).values()
        np.testing.assert_array_equal(a, b)
    finally:
        tiered.runtime.close()
        resident.runtime.close()


def _other_recording(path: Path, rows: int, *, with_shape: bool) -> Path:
    """A recording written by loadgen for rm1's table count at ``rows`` rows per table."""
    shape = ModelShape(dense_dim=13, table_rows=(rows,) * 8, pooling=(80,) * 8, zipf=1.05)
    config = LoadConfig(url="127.0.0.1:1", model="rm1", qps=10.0, duration_s=1.0, query_size="fixed:4", pool=2)
    schedule = plan_run(config, shape, lambda q: None, keep_tensors=True)
    record = RunRecord(schedule.offsets, schedule.items)
    return save_recording(path, record, schedule.query, schedule.pool.tensors, {"config": config.to_dict()},
                          recipe=schedule.pool.recipe, shape=shape.to_dict() if with_shape else None)


@pytest.mark.parametrize("bad", ["missing", "truncated", "not-npz", "other-shape", "ids-out-of-range"])
def test_a_bad_recording_fails_the_load_naming_the_file(repo, recording, tmp_path, bad):
    path = tmp_path / f"{bad}.npz"
    if bad == "truncated":
        data = recording.read_bytes()
        path.write_bytes(data[:len(data) // 2])
    elif bad == "not-npz":
        path.write_text("not a recording\n")
    elif bad == "other-shape":
        _other_recording(path, 300, with_shape=True)
    elif bad == "ids-out-of-range":
        _other_recording(path, 100_000, with_shape=False)
    words = {"missing": "no such file", "truncated": "not a complete .npz file", "not-npz": "not a complete .npz",
             "other-shape": r"made for another model: 8 tables of 300 rows; model tiered has 8 tables of 500 rows",
             "ids-out-of-range": r"made for another model: query \d+ asks for row \d+ of table \d+, which has 500"}[bad]
    with pytest.raises(ValueError, match=rf"{bad}\.npz.*{words}"):
        load_from_repository(ModelRepository(repo), "tiered", "1", backend="simcard", metrics=ServerMetrics(),
                             batching=BatchingConfig(), warm_from=path)


def test_serve_exits_2_naming_a_missing_recording(tmp_path):
    missing = tmp_path / "nowhere.npz"
    result = subprocess.run([str(SERVE), "--model", "rm1", "--max-rows", "300", "--cards", "1", "--table-memory", "50%",
                             "--warm-from", str(missing), "--grpc-port", "0", "--http-port", "-1",
                             "--metrics-port", "-1"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 2, result.stderr
    # checked before the model is partitioned: one line naming the flag, the file and the fix
    assert result.stderr.strip() == (f"sixfold-serve: --warm-from {missing}: no such file; give a recording "
                                     "written by sixfold-loadgen --record"), result.stderr
