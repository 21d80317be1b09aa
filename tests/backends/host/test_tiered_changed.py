"""A tiered table file changed under a serving store fails every lookup naming the file, never wrong rows.

Overwritten in place (same inode, new rows) or replaced by a rename: the first batch that reads from
it sees a different (size, mtime, inode) and fails with TableChanged (an OSError: the server answers
UNAVAILABLE); later batches fail too, even those the cache alone would answer, until reloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from sixfold.backends.api import PartitionArtifact
from sixfold.backends.host.host_embedding import HostEmbeddingBackend, HostEmbeddingStage
from sixfold.backends.host.table_store import TableChanged
from tests.backends.factories import device

ROWS, DIM = (4000, 3000), 16


def _tables(folder: Path, seed: int) -> list[np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tables = [rng.standard_normal((r, DIM)).astype(np.float32) for r in ROWS]
    for t, a in enumerate(tables):
        np.save(folder / f"table_{t:03d}.npy", a)
    return tables


def _batch(seed: int, items: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = np.full((items, len(ROWS)), 3, np.int32)
    ids = np.concatenate([rng.integers(0, ROWS[t], 3) for _ in range(items) for t in range(len(ROWS))])
    return lengths, ids.astype(np.int64)


def _expected(tables: list[np.ndarray], lengths: np.ndarray, ids: np.ndarray) -> np.ndarray:
    return HostEmbeddingStage(tables).run_numpy(lengths, ids)


@pytest.mark.parametrize("how", ["in place", "renamed over"])
def test_a_changed_table_file_fails_every_lookup_naming_it(tmp_path: Path, how: str) -> None:
    folder = tmp_path / "tables"
    old = _tables(folder, seed=0)
    stage = HostEmbeddingStage(folder, table_memory=0.2)
    try:
        first = _batch(1)
        np.testing.assert_array_equal(stage.run_numpy(*first), _expected(old, *first))
        new = [a + 1 for a in old]
        target = folder / "table_001.npy"
        if how == "in place":  # same inode, same size: only the modification time and the rows differ
            inode = target.stat().st_ino
            with open(target, "r+b") as f:
                np.save(f, new[1])
            assert target.stat().st_ino == inode
        else:
            np.save(tmp_path / "next.npy", new[1])
            os.replace(tmp_path / "next.npy", target)
        with pytest.raises(TableChanged, match=r"table file '.*table_001\.npy' changed under the server") as err:
            for seed in range(2, 12):  # misses on table 1 come soon
                stage.run_numpy(*_batch(seed))
        assert ("mtime_ns" if how == "in place" else "inode") in str(err.value)
        assert isinstance(err.value, OSError)  # the runtime answers UNAVAILABLE for it
        with pytest.raises(TableChanged):  # sticky: the cached rows alone would answer this one
            stage.run_numpy(*first)
    finally:
        stage.close()
    reloaded = HostEmbeddingStage(folder, table_memory=0.2)
    np.testing.assert_array_equal(reloaded.run_numpy(*first), _expected([old[0], new[1]], *first))
    reloaded.close()


def test_the_executable_passes_it_on_as_an_os_error(tmp_path: Path) -> None:
    folder = tmp_path / "tables"
    old = _tables(folder, seed=0)
    artifact = PartitionArtifact(name="sparse", format="tables", payload=folder, input_names=("sparse_lengths",
                                 "sparse_indices"), output_names=("host_embedding_bag",), param_bytes=0,
                                 metadata={"table_memory": 0.2})
    executable = HostEmbeddingBackend().load(artifact, device())
    try:
        lengths, ids = _batch(1)
        executable.run({"sparse_lengths": lengths, "sparse_indices": ids})
        np.save(folder / "table_000.npy", old[0] * 2)
        with pytest.raises(OSError, match="table_000.npy' changed under the server"):
            for seed in range(2, 12):
                executable.run(dict(zip(("sparse_lengths", "sparse_indices"), _batch(seed))))
    finally:
        executable.close()
