"""Tiered tables over real gRPC: a model served with a tiny table memory answers like the all-resident one."""

from __future__ import annotations

import asyncio
import errno
import shutil
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.backends.host import pread
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_from_repository
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository
from tests.conftest import free_port, triton_inputs

ROWS = 500  # rm1: 8 tables x 500 rows x dim 32 fp32 = 512 KiB of tables
BUDGET = "200KiB"  # a row index (16 KiB), one item's 640 ids staged (80 KiB), ~700 of 4000 rows cached


def _config(name: str, memory: str) -> str:
    return (f'name: "{name}"\nparameters {{ key: "sixfold.table_memory" value {{ string_value: "{memory}" }} }}\n'
            'dynamic_batching { max_queue_delay_microseconds: 0 }\n')


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    built = tmp_path_factory.mktemp("built") / "rm1"
    _, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=2, cards=2)
    write_artifacts(partitioned, built)
    root = tmp_path_factory.mktemp("repo")
    for name in ("resident", "tiered"):
        shutil.copytree(built, root / name / "1")
    (root / "tiered" / "config.pbtxt").write_text(_config("tiered", BUDGET))
    (root / "resident" / "config.pbtxt").write_text('name: "resident"\n'
                                                    'dynamic_batching { max_queue_delay_microseconds: 0 }\n')
    return root


@pytest.fixture(scope="module")
def server(repo):
    metrics = ServerMetrics()
    core = InferenceCore()
    repository = ModelRepository(repo)

    def loader(r, name, version):
        return load_from_repository(r, name, version, backend="simcard", metrics=metrics,
                                    batching=BatchingConfig(max_queue_delay_microseconds=0))

    core.control = ModelControl(core, repository, loader, explicit=False)
    port = free_port()
    background = BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=port), metrics).start()
    for name in ("resident", "tiered"):
        asyncio.run_coroutine_threadsafe(core.control.load(name), background._loop).result(timeout=120)
    try:
        yield background, port
    finally:
        background.stop()


def _infer(client, name, request):
    result = client.infer(name, triton_inputs(grpcclient, request),
                          outputs=[grpcclient.InferRequestedOutput("scores")], client_timeout=30)
    return result.as_numpy("scores")


def _requests(count: int, seed: int):
    gen = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=ROWS), seed=seed)
    rng = np.random.default_rng(seed)
    return [gen.make(int(rng.integers(1, 12))) for _ in range(count)]


def test_tiny_budget_scores_bit_identical_and_reports_hits(server):
    background, metrics_port = server
    client = grpcclient.InferenceServerClient(background.url)
    for request in _requests(25, seed=4):
        np.testing.assert_array_equal(_infer(client, "tiered", request), _infer(client, "resident", request))
    page = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in page.splitlines()
              if line.startswith("sixfold_table_") and not line.startswith("#")}
    assert values['sixfold_table_cache_hits_total{model="tiered"}'] > 0
    assert values['sixfold_table_cache_misses_total{model="tiered"}'] > 0
    assert 0 < values['sixfold_table_cache_bytes{model="tiered"}'] <= 200 * 1024
    assert values['sixfold_table_read_duration_seconds_count{model="tiered"}'] > 0
    assert not any('model="resident"' in k for k in values)


def test_a_failed_read_is_unavailable_and_the_next_request_is_served(server, monkeypatch):
    background, _ = server
    client = grpcclient.InferenceServerClient(background.url)
    real = pread.gather
    broken = {"on": True}

    def flaky(*args, **kwargs):
        if broken["on"]:
            raise pread.ReadError(errno.EIO, 0)
        return real(*args, **kwargs)

    monkeypatch.setattr(pread, "gather", flaky)
    request = _requests(1, seed=99)[0]
    with pytest.raises(InferenceServerException) as info:
        _infer(client, "tiered", request)
    assert info.value.status() == "StatusCode.UNAVAILABLE" and "table file" in info.value.message()
    broken["on"] = False
    np.testing.assert_array_equal(_infer(client, "tiered", request), _infer(client, "resident", request))


def test_budget_below_one_item_is_refused_with_the_minimum(repo, tmp_path):
    shutil.copytree(repo / "tiered", tmp_path / "small")
    (tmp_path / "small" / "config.pbtxt").write_text(_config("small", "20KiB"))
    with pytest.raises(Exception, match=r"table memory 20.0 KiB is below this model's minimum of .* KiB"):
        load_from_repository(ModelRepository(tmp_path), "small", "1", backend="simcard", metrics=ServerMetrics(),
                             batching=BatchingConfig())


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "remove"])
def test_a_damaged_table_file_fails_the_load_naming_it(repo, tmp_path, damage):
    shutil.copytree(repo / "resident", tmp_path / "m")
    path = tmp_path / "m" / "1" / "tables" / "table_003.npy"
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[-5] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-128]))
    else:
        path.unlink()
    (tmp_path / "m" / "config.pbtxt").write_text(_config("m", BUDGET))
    words = {"corrupt": "corrupted", "truncate": "truncated", "remove": "missing"}[damage]
    with pytest.raises(ValueError, match=rf"table_003.npy.*{words}"):
        load_from_repository(ModelRepository(tmp_path), "m", "1", backend="simcard", metrics=ServerMetrics(),
                             batching=BatchingConfig())


def test_a_builtin_model_with_a_table_memory_answers_like_resident():
    from sixfold.server.loading.loader import load_builtin

    kwargs = dict(max_rows=300, seed=1, cards=1, backend="simcard", card_spec="m2-card", batching=BatchingConfig())
    resident = load_builtin("rm1", metrics=ServerMetrics(), **kwargs)
    tiered = load_builtin("rm1", metrics=ServerMetrics(), table_memory=0.5, **kwargs)
    try:
        assert tiered.runtime.host.stage.stores and not resident.runtime.host.stage.stores
        assert tiered.parameters["sixfold.table_memory"] == str(tiered.runtime.host.stage.table_memory)
        gen = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=5)
        for items in (1, 7, 40):
            request = gen.make(items)
            host_inputs = {k: request[k] for k in ("sparse_lengths", "sparse_indices")}
            (a,), (b,) = resident.runtime.host.run(host_inputs).values(), tiered.runtime.host.run(host_inputs).values()
            np.testing.assert_array_equal(a, b)
    finally:
        resident.runtime.close()
        tiered.runtime.close()


def test_tables_larger_than_the_host_fit_with_a_table_memory(repo):
    """A host spec smaller than the tables refuses them resident, and takes them with a budget that fits."""
    import dataclasses

    from sixfold.backends.host.host_embedding import HostEmbeddingBackend
    from sixfold.backends.memory import DoesNotFit
    from sixfold.backends.spec_catalog import load_spec

    read = ModelRepository(repo).read("resident", "1")
    artifact = read.artifacts["sparse"]
    small = dataclasses.replace(load_spec("host-cpu"), memory_bytes=artifact.param_bytes // 2)
    with pytest.raises(DoesNotFit):
        HostEmbeddingBackend().load(artifact, small)
    tiered = dataclasses.replace(artifact, metadata={**artifact.metadata, "table_memory": 0.4, "item_ids": 640})
    HostEmbeddingBackend().load(tiered, small).close()
