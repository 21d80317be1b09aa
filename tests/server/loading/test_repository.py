"""Model repository + explicit model control over real gRPC with stock tritonclient.

A repository written by the partitioner (REPO/NAME/VERSION) is served; models
load, unload and swap versions under traffic without failing a request.
"""

from __future__ import annotations

import shutil
import threading
import time

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.loading.loader import load_from_repository
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository, RepositoryError
from tests.conftest import ServeProcess, triton_inputs

ROWS = 500
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Two partitioned rm1 variants (seeds 0 and 1) written once; tests copy them into repositories."""
    root = tmp_path_factory.mktemp("built")
    refs = {}
    for seed in (0, 1):
        model, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=seed, cards=2)
        write_artifacts(partitioned, root / f"seed{seed}")
        refs[seed] = model
    return root, refs


def _request(items: int = 3, seed: int = 0) -> dict[str, np.ndarray]:
    config = models.get_config("rm1", max_rows=ROWS)
    return models.RequestGenerator.for_config(config, seed=seed).make(items)


def _expected(model, request) -> np.ndarray:
    with torch.inference_mode():
        return model(*[torch.from_numpy(request[k]) for k in
                       ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


def _repo(tmp_path, source, layout: dict[str, list[int]]):
    built, _ = source
    for name, seeds in layout.items():
        for version, seed in enumerate(seeds, start=1):
            shutil.copytree(built / f"seed{seed}", tmp_path / "repo" / name / str(version))
    return tmp_path / "repo"


class _Server:
    def __init__(self, repo, *, explicit: bool, token: str | None = None, load: tuple[str, ...] | None = None):
        metrics = ServerMetrics()
        self.core = InferenceCore()
        repository = ModelRepository(repo)

        def loader(r, name, version):
            return load_from_repository(r, name, version, backend="simcard", metrics=metrics,
                                        batching=BatchingConfig(max_queue_delay_microseconds=1000))

        self.core.control = ModelControl(self.core, repository, loader, explicit=explicit)
        self.background = BackgroundServer(self.core, ServerConfig(grpc_port=0, metrics_port=None,
                                                                   control_token=token), metrics)
        self.background.start()
        for name in (repository.names() if load is None else load):
            self.call(self.core.control.load(name))

    def call(self, coroutine):
        import asyncio
        return asyncio.run_coroutine_threadsafe(coroutine, self.background._loop).result(timeout=120)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.background.stop()


def _infer(client, name, request, version=""):
    result = client.infer(name, triton_inputs(grpcclient, request), model_version=version,
                          outputs=[grpcclient.InferRequestedOutput("scores")], client_timeout=30)
    return result.as_numpy("scores"), result.get_response().model_version


def test_repository_reads_versions_and_policy(tmp_path, source):
    repo = _repo(tmp_path, source, {"alpha": [0, 1], "beta": [1]})
    (repo / "empty").mkdir()
    repository = ModelRepository(repo)
    assert repository.names() == ["alpha", "beta"]
    assert repository.versions("alpha") == ["1", "2"] and repository.served_versions("alpha") == ["2"]
    (repo / "alpha" / "config.pbtxt").write_text("version_policy { all { } }\n")
    assert repository.served_versions("alpha") == ["1", "2"]
    (repo / "alpha" / "config.pbtxt").write_text("version_policy { specific { versions: [1] } }\n")
    assert repository.served_versions("alpha") == ["1"]
    (repo / "alpha" / "config.pbtxt").write_text("name: \"other\"\n")
    with pytest.raises(RepositoryError, match="differs from the folder name 'alpha'"):
        repository.config("alpha")
    (repo / "alpha" / "config.pbtxt").write_text("version_policy { bogus }\n")
    with pytest.raises(RepositoryError, match="config.pbtxt"):
        repository.config("alpha")
    with pytest.raises(RepositoryError, match="no model 'nope'.*'alpha', 'beta'"):
        repository.versions("nope")
    read = repository.read("beta", "1")
    assert read.plan.tables["rows"] and read.artifacts["sparse"].format == "tables"
    (repo / "beta" / "1" / "dense.onnx").unlink()
    with pytest.raises(RepositoryError, match="dense.onnx is missing"):
        repository.read("beta", "1")


def test_serves_every_model_answers_like_the_original_and_indexes(tmp_path, source):
    _, refs = source
    repo = _repo(tmp_path, source, {"alpha": [0], "beta": [1]})
    with _Server(repo, explicit=False) as server:
        client = grpcclient.InferenceServerClient(server.background.url)
        index = client.get_model_repository_index(as_json=True)["models"]
        assert [(m["name"], m["version"], m["state"]) for m in index] == [("alpha", "1", "READY"),
                                                                          ("beta", "1", "READY")]
        request = _request()
        for name, seed in (("alpha", 0), ("beta", 1)):
            scores, version = _infer(client, name, request)
            np.testing.assert_allclose(scores, _expected(refs[seed], request), rtol=1e-5, atol=1e-6)
            assert version == "1"
        # Range checks come from the plan: an id past table 0's rows names the table.
        bad = dict(request)
        bad["sparse_indices"] = bad["sparse_indices"].copy()
        bad["sparse_indices"][0] = ROWS + 5
        with pytest.raises(InferenceServerException, match="table 0") as err:
            _infer(client, "alpha", bad)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        # Model control is off unless explicit.
        with pytest.raises(InferenceServerException, match="model control is disabled") as err:
            client.unload_model("alpha")
        assert err.value.status() == "StatusCode.UNAVAILABLE"
        assert client.is_model_ready("alpha")
        with pytest.raises(InferenceServerException, match="has no version '7'") as err:
            _infer(client, "alpha", request, version="7")
        assert err.value.status() == "StatusCode.NOT_FOUND"


class _Traffic:
    """Sends requests back to back from a thread (bounded in count and time); records every outcome."""

    def __init__(self, url: str, name: str, request, max_requests: int = 2000, max_s: float = 60.0) -> None:
        self.url, self.name, self.request = url, name, request
        self.versions: list[str] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(max_requests, max_s), daemon=True)

    def _run(self, max_requests: int, max_s: float) -> None:
        client = grpcclient.InferenceServerClient(self.url)
        end = time.monotonic() + max_s
        for _ in range(max_requests):
            if self._stop.is_set() or time.monotonic() > end:
                break
            try:
                self.versions.append(_infer(client, self.name, self.request)[1])
            except InferenceServerException as exc:
                self.failures.append(str(exc))
        client.close()

    def __enter__(self):
        self._thread.start()
        while not self.versions and not self.failures and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        time.sleep(0.3)  # a few requests after the change, too
        self._stop.set()
        self._thread.join(timeout=30)
        assert not self._thread.is_alive()


def test_version_swap_and_unload_under_traffic_fail_no_request(tmp_path, source):
    _, refs = source
    repo = _repo(tmp_path, source, {"alpha": [0], "beta": [1]})
    with _Server(repo, explicit=True, token=TOKEN) as server:
        client = grpcclient.InferenceServerClient(server.background.url)
        auth = {"authorization": f"Bearer {TOKEN}"}
        request = _request(items=4, seed=5)
        with _Traffic(server.background.url, "alpha", request) as alpha, \
                _Traffic(server.background.url, "beta", request) as beta:
            shutil.copytree(source[0] / "seed1", repo / "alpha" / "2")  # a new version appears
            client.load_model("alpha", headers=auth)
            assert client.get_model_metadata("alpha", as_json=True)["versions"] == ["2"]
            client.unload_model("beta", headers=auth)  # another model goes away meanwhile
        assert alpha.failures == [] and len(alpha.versions) > 5
        assert alpha.versions[-1] == "2" and alpha.versions[0] == "1"
        swapped = alpha.versions.index("2")
        assert set(alpha.versions[swapped:]) == {"2"}  # once swapped, never back
        assert beta.failures and all("unknown model 'beta'" in f for f in beta.failures)
        scores, _ = _infer(client, "alpha", request)
        np.testing.assert_allclose(scores, _expected(refs[1], request), rtol=1e-5, atol=1e-6)
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index["beta"]["state"] == "UNAVAILABLE" and index["alpha"]["state"] == "READY"
        client.load_model("beta", headers=auth)
        assert client.is_model_ready("beta")


def test_model_control_needs_the_token_when_one_is_set(tmp_path, source):
    repo = _repo(tmp_path, source, {"alpha": [0]})
    with _Server(repo, explicit=True, token=TOKEN, load=()) as server:
        client = grpcclient.InferenceServerClient(server.background.url)
        assert not client.is_model_ready("alpha")
        for headers in (None, {"authorization": "Bearer wrong"}):
            with pytest.raises(InferenceServerException, match="authorization: Bearer") as err:
                client.load_model("alpha", headers=headers)
            assert err.value.status() == "StatusCode.UNAUTHENTICATED"
        client.load_model("alpha", headers={"authorization": f"Bearer {TOKEN}"})
        assert client.is_model_ready("alpha")
        with pytest.raises(InferenceServerException, match="no model 'ghost'") as err:
            client.load_model("ghost", headers={"authorization": f"Bearer {TOKEN}"})
        assert err.value.status() == "StatusCode.NOT_FOUND"


def test_cli_serves_a_repository(tmp_path, source):
    _, refs = source
    repo = _repo(tmp_path, source, {"alpha": [0]})
    proc = ServeProcess("--model-repository", str(repo), "--grpc-port", "0", "--metrics-port", "-1",
                        "--log-format", "json")
    try:
        assert proc.url, proc.output
        client = grpcclient.InferenceServerClient(proc.url)
        request = _request(items=2, seed=9)
        scores, _ = _infer(client, "alpha", request)
        np.testing.assert_allclose(scores, _expected(refs[0], request), rtol=1e-5, atol=1e-6)
    finally:
        proc.kill()
    assert '"event": "model_ready"' in proc.output


def test_a_config_may_let_a_model_score_non_finite_features(tmp_path, source):
    """sixfold.allow_nonfinite in config.pbtxt: that model scores NaN features; the others refuse them."""
    repo = _repo(tmp_path, source, {"lenient": [0], "strict": [0]})
    (repo / "lenient" / "config.pbtxt").write_text(
        'parameters { key: "sixfold.allow_nonfinite" value { string_value: "true" } }\n')
    request = _request(3)
    request["dense_features"][1, 0] = np.nan
    with _Server(repo, explicit=False) as server:
        client = grpcclient.InferenceServerClient(server.background.url)
        scores, _ = _infer(client, "lenient", request)
        assert np.isnan(scores[1, 0]) and np.isfinite(scores[[0, 2]]).all()
        with pytest.raises(InferenceServerException, match="'dense_features': non-finite value nan at \\[1, 0\\]"):
            _infer(client, "strict", request)
        client.close()


def test_a_config_may_choose_its_card_scheduling(tmp_path, source):
    """sixfold.card_scheduling in config.pbtxt reaches that model's runtime; the other keeps the default (fifo)."""
    repo = _repo(tmp_path, source, {"greedy": [0], "default": [0]})
    (repo / "greedy" / "config.pbtxt").write_text(
        'parameters { key: "sixfold.card_scheduling" value { string_value: "greedy" } }\n')
    with _Server(repo, explicit=False) as server:
        assert server.core.model("greedy").runtime.card_gate is None
        assert server.core.model("default").runtime.card_scheduling == "fifo"
        client = grpcclient.InferenceServerClient(server.background.url)
        for name in ("greedy", "default"):
            scores, _ = _infer(client, name, _request(3))
            assert scores.shape == (3, 1)
        client.close()


def test_a_loaded_model_is_frozen_out_of_full_collections_and_collected_once_unloaded(tmp_path, source):
    # sixfold.server.memory.gc_pause: what a loaded server holds is moved out of the collector's walks (a full
    # collection of a process with a model loaded took ~95 ms, a stall of every thread); an
    # unloaded version must still be freed, cycles and all.
    import gc
    import weakref

    repo = _repo(tmp_path, source, {"alpha": [0], "beta": [1]})
    with _Server(repo, explicit=True, load=("alpha", "beta"), token="t") as server:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000
        beta = weakref.ref(server.core.model("beta"))
        host = weakref.ref(server.core.model("beta").runtime.host)
        server.call(server.core.control.unload("beta"))
        # NOTE: the host stage's executable can outlive the model by a moment (a stage worker thread finishing its
        # last call holds it); a collection then frees it only if unloading unfroze it (frozen objects are never
        # collected), so a bounded wait with collections still tests what unloading must do
        for _ in range(50):
            if beta() is None and host() is None:
                break
            gc.collect()
            time.sleep(0.1)
        assert beta() is None and host() is None, "an unloaded model stayed alive (its tables and cards with it)"
        assert gc.get_freeze_count() > 10_000  # what is still served is frozen again
        client = grpcclient.InferenceServerClient(server.background.url)
        scores, _ = _infer(client, "alpha", _request())
        assert scores.shape[0] == _request()["dense_features"].shape[0]
