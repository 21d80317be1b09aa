"""Row updates of a serving HostEmbeddingStage (table deltas): resident and tiered, every precision."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.backends.host.host_embedding import HostEmbeddingStage
from sixfold.backends.host.row_updates import prepare, read_rows, stored_rows

TABLES, ROWS, DIM = 3, 400, 8


def _write(folder, tables):
    folder.mkdir(parents=True, exist_ok=True)
    for t, a in enumerate(tables):
        np.save(folder / f"table_{t:03d}.npy", a)
    return folder


def _tables(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((ROWS, DIM)).astype(np.float32) for _ in range(TABLES)]


def _batch(seed=1, n=64, pooling=5):
    rng = np.random.default_rng(seed)
    lengths = np.full((n, TABLES), pooling, np.int32)
    ids = rng.integers(0, ROWS, n * TABLES * pooling).astype(np.int64)
    return lengths, ids


def _changes(tables, seed=2, count=50):
    rng = np.random.default_rng(seed)
    new = [t.copy() for t in tables]
    changes = {}
    for t in (0, 2):
        ids = np.sort(rng.choice(ROWS, count, replace=False)).astype(np.int64)
        rows = rng.standard_normal((count, DIM)).astype(np.float32)
        new[t][ids] = rows
        changes[t] = (ids, rows)
    return new, changes


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("tiered", [False, True])
def test_updated_stage_answers_as_a_stage_on_the_new_tables(tmp_path, precision, tiered):
    old = _tables()
    new, changes = _changes(old)
    memory = 12000 if tiered else None
    stage = HostEmbeddingStage(_write(tmp_path / "old", old), precision, table_memory=memory, item_ids=15)
    lengths, ids = _batch()
    stage.run_numpy(lengths, ids)  # warm the cache, so some changed rows are cached when they change
    fresh = HostEmbeddingStage(_write(tmp_path / "new", new), precision)
    want = fresh.run_numpy(lengths, ids)
    before = stage.run_numpy(lengths, ids)
    updates = {t: (i, stored_rows(stage, t, r)) for t, (i, r) in changes.items()}
    swap = prepare(stage, updates)
    assert np.array_equal(stage.run_numpy(lengths, ids), before)  # prepared, not yet visible
    swap.commit()
    assert np.array_equal(stage.run_numpy(lengths, ids), want)
    for t, (i, _) in changes.items():
        assert np.array_equal(read_rows(stage, t, i), updates[t][1])
    # and back: the undo rows restore the old answers
    prepare(stage, {t: (changes[t][0], swap.undo[t]) for t in changes}).commit()
    assert np.array_equal(stage.run_numpy(lengths, ids), before)
    # the files never changed
    assert np.array_equal(np.load(tmp_path / "old" / "table_000.npy"), old[0])
    stage.close()


def test_in_memory_tables_are_updated_in_place():
    old = _tables()
    new, changes = _changes(old)
    stage = HostEmbeddingStage(old)
    lengths, ids = _batch()
    prepare(stage, {t: (i, r) for t, (i, r) in changes.items()}).commit()
    assert np.array_equal(stage.run_numpy(lengths, ids), HostEmbeddingStage(new).run_numpy(lengths, ids))
