"""A model repository mounted read-only serves; its derived tables go to --cache-dir, keyed by contents.

The repository is a read-only bind mount (as docs/deploy.md mounts it). A new version copied over the
served one with ``cp -p`` (modification times older than the cache's), unloaded and loaded again, is scored with
its own rows. (With no writable cache folder at all the tables are served as they are:
tests/backends/host/test_derived_cache.py.)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from sixfold import models
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from tests.conftest import ServeProcess, triton_inputs

ROWS = 400
TOKEN = "read-only-s3cret"


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=10)
    if done.returncode:
        pytest.skip(f"mounting is not allowed here ({' '.join(args)}): {done.stderr.strip()}")


def _expected(model, request: dict[str, np.ndarray]) -> np.ndarray:
    with torch.inference_mode():
        return model(*[torch.from_numpy(request[k]) for k in
                       ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


def _scores(url: str, request: dict[str, np.ndarray]) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    try:
        result = client.infer("rm", triton_inputs(grpcclient, request), client_timeout=30,
                              outputs=[grpcclient.InferRequestedOutput("scores")])
        return result.as_numpy("scores")
    finally:
        client.close()


def test_read_only_repository_serves_and_cp_p_versions_score_their_own_rows(tmp_path: Path) -> None:
    built = {}
    for seed in (1, 0):  # the next version is built first: its files are older than anything served
        model, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=seed, cards=1)
        write_artifacts(partitioned, tmp_path / f"seed{seed}")
        built[seed] = model
    real, repo, cache = tmp_path / "real", tmp_path / "repo", tmp_path / "cache"
    shutil.copytree(tmp_path / "seed0", real / "rm" / "1")
    repo.mkdir()
    _mount("--bind", str(real), str(repo))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=ROWS), seed=3).make(4)
    serve = None
    try:
        _mount("-o", "remount,ro,bind", str(repo))
        base = ("--model-repository", str(repo), "--grpc-port", "0", "--metrics-port", "-1", "--backend", "simcard",
                "--cards", "1", "--model-control-mode", "explicit", "--load-model", "rm",
                "--control-token-file", str(token))
        serve = ServeProcess(*base, "--cache-dir", str(cache), timeout=120)
        assert serve.url, serve.output
        np.testing.assert_allclose(_scores(serve.url, request), _expected(built[0], request), rtol=1e-4, atol=1e-5)
        assert sorted(p.name for p in (real / "rm" / "1" / "tables").iterdir()) == [f"table_{t:03d}.npy"
                                                                                   for t in range(8)]
        (derived,) = (cache / "tables").iterdir()
        # A new version copied over the served one, modification times kept, then loaded again.
        subprocess.run(["cp", "-rp", f"{tmp_path / 'seed1'}/.", str(real / "rm" / "1")], check=True, timeout=30)
        assert (real / "rm" / "1" / "tables" / "table_000.npy").stat().st_mtime < derived.stat().st_mtime
        client = grpcclient.InferenceServerClient(serve.url)
        auth = {"authorization": f"Bearer {TOKEN}"}
        client.unload_model("rm", headers=auth)
        client.load_model("rm", headers=auth)
        client.close()
        scores = _scores(serve.url, request)
        np.testing.assert_allclose(scores, _expected(built[1], request), rtol=1e-4, atol=1e-5)
        assert not np.allclose(scores, _expected(built[0], request), rtol=1e-4, atol=1e-5)
    finally:
        if serve is not None:
            serve.stop()
        subprocess.run(["umount", "-l", str(repo)], timeout=10)


def test_a_full_cache_disk_serves_fp32_as_it_is_and_a_failed_load_takes_nothing_down(tmp_path: Path) -> None:
    model, partitioned = partition_builtin("rm1", max_rows=ROWS, seed=0, cards=1)
    write_artifacts(partitioned, tmp_path / "repo" / "rm" / "1")
    _, packed = partition_builtin("rm1", max_rows=ROWS, seed=0, cards=1, table_precision="int8")
    write_artifacts(packed, tmp_path / "repo" / "rm8" / "1")  # int8 rows tiered: read from a converted file
    (tmp_path / "repo" / "rm8" / "config.pbtxt").write_text(
        'name: "rm8"\nparameters { key: "sixfold.table_memory" value { string_value: "50%" } }\n')
    cache = tmp_path / "cache"
    cache.mkdir()
    _mount("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cache))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    serve = None
    try:
        with open(cache / "ballast", "wb", buffering=0) as f:  # the disk full before the server starts
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * (64 << 10))
        serve = ServeProcess("--model-repository", str(tmp_path / "repo"), "--grpc-port", "0", "--metrics-port",
                             "-1", "--backend", "simcard", "--cards", "1", "--model-control-mode", "explicit",
                             "--load-model", "rm", "--control-token-file", str(token), "--cache-dir", str(cache),
                             timeout=120)
        assert serve.url, serve.output
        request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=ROWS), seed=5).make(3)
        np.testing.assert_allclose(_scores(serve.url, request), _expected(model, request), rtol=1e-4, atol=1e-5)
        assert "No space left on device" in serve.output and "serving them per table" in serve.output
        client = grpcclient.InferenceServerClient(serve.url)
        with pytest.raises(Exception, match="tiered int8 rows are read from a converted file in the cache folder"):
            client.load_model("rm8", headers={"authorization": f"Bearer {TOKEN}"})
        client.close()
        assert serve.proc.poll() is None  # the server, and the model it serves, stay up
        np.testing.assert_allclose(_scores(serve.url, request), _expected(model, request), rtol=1e-4, atol=1e-5)
    finally:
        if serve is not None:
            serve.stop()
        subprocess.run(["umount", "-l", str(cache)], timeout=10)
