"""The tiered table store: rows on disk behind a DRAM row cache (sixfold.backends.host.table_store)."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import numpy as np
import pytest

from sixfold.backends.host import pread
from sixfold.backends.host.host_embedding import HostEmbeddingStage
from sixfold.backends.host.table_store import (TableMemoryError, TableReadError, TieredRows, open_table_file, parse_bytes,
                                  parse_table_memory)
from sixfold.models.requests import RequestGenerator

ROWS = (1000, 3000, 500, 2000)
DIM = 16


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tables")
    rng = np.random.default_rng(0)
    for t, r in enumerate(ROWS):
        np.save(d / f"table_{t:03d}.npy", rng.standard_normal((r, DIM)).astype(np.float32))
    return d


def _requests(count: int, seed: int = 1, max_items: int = 60) -> list[tuple[np.ndarray, np.ndarray]]:
    gen = RequestGenerator(ROWS, 4, (5, 5, 5, 5), zipf=1.05, seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lengths = gen.lengths(int(rng.integers(1, max_items)))
        out.append((lengths, gen.ids(lengths)))
    return out


def test_parse_sizes() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1000") == 1000
    assert parse_table_memory("10%") == pytest.approx(0.1)
    assert parse_table_memory(None) is None
    for bad in ("lots", "4 parsecs", "0", "-1GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError):
        parse_table_memory("150%")


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_tiny_budget_matches_resident_bit_for_bit(tables: Path, precision: str) -> None:
    resident = HostEmbeddingStage(tables, precision)
    tiered = HostEmbeddingStage(tables, precision, table_memory=40_000, item_ids=20)
    store = tiered.stores[0]
    assert store.nbytes <= 40_000 and store.slots < sum(ROWS) // 10  # eviction is forced
    for lengths, ids in _requests(25):
        np.testing.assert_array_equal(tiered.run_numpy(lengths, ids), resident.run_numpy(lengths, ids))
    assert store.stats.misses > 0 and store.stats.hits > 0
    assert store.cached_rows == store.slots  # full: every later miss evicted something
    # the index and the owners agree: every cached row points at its slot
    owners = store.owner[store.owner >= 0]
    assert np.array_equal(store.index[owners], np.flatnonzero(store.owner >= 0))
    assert (store.index >= 0).sum() == owners.shape[0]
    tiered.close()


@pytest.mark.parametrize("policy", ["clock", "tinylfu"])
def test_policies_keep_hot_rows(tables: Path, policy: str) -> None:
    tiered = HostEmbeddingStage(tables, table_memory=0.3, cache_policy=policy, item_ids=20)
    for lengths, ids in _requests(60, max_items=30):
        tiered.run_numpy(lengths, ids)
    assert tiered.stores[0].stats.hit_rate > 0.4  # Zipf 1.05 ids, 30% of the rows cached
    tiered.close()


def test_many_threads_at_once(tables: Path) -> None:
    resident = HostEmbeddingStage(tables)
    tiered = HostEmbeddingStage(tables, table_memory=30_000, item_ids=20, io_threads=2)
    work = _requests(40, seed=7)
    expected = [resident.run_numpy(*r) for r in work]
    failures: list[str] = []

    def worker(k: int) -> None:
        for i in range(k, len(work), 4):
            got = tiered.run_numpy(*work[i])
            if not np.array_equal(got, expected[i]):
                failures.append(f"request {i}")

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    tiered.close()


def test_budget_below_minimum_is_refused_with_the_minimum(tables: Path) -> None:
    with pytest.raises(TableMemoryError, match=r"below this model's minimum of .*row index.*20 ids staged"):
        HostEmbeddingStage(tables, table_memory=20_000, item_ids=20)


def test_truncated_and_missing_files_are_named(tables: Path, tmp_path: Path) -> None:
    good = open_table_file(tables / "table_000.npy")
    bad = tmp_path / "table_000.npy"
    bad.write_bytes((tables / "table_000.npy").read_bytes()[:good.offset + 100])
    with pytest.raises(ValueError, match=r"table_000.npy.*truncated"):
        TieredRows([bad], 10**6)
    with pytest.raises(FileNotFoundError, match=r"table_009.npy.*missing"):
        TieredRows([tmp_path / "table_009.npy"], 10**6)


def test_read_error_fails_the_batch_and_the_store_recovers(tables: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resident = HostEmbeddingStage(tables)
    tiered = HostEmbeddingStage(tables, table_memory=40_000, item_ids=20)
    real = pread.gather
    broken = {"on": True}

    def flaky(fd: int, offsets: np.ndarray, row_bytes: int, out: np.ndarray, block: int = 0) -> None:
        if broken["on"]:
            raise pread.ReadError(errno.EIO, 0)
        real(fd, offsets, row_bytes, out, block)

    monkeypatch.setattr(pread, "gather", flaky)
    lengths, ids = _requests(1, seed=3)[0]
    with pytest.raises(TableReadError, match=r"table file .*table_00\d.npy.*Input/output error"):
        tiered.run_numpy(lengths, ids)
    broken["on"] = False
    for lengths, ids in _requests(5, seed=3):
        np.testing.assert_array_equal(tiered.run_numpy(lengths, ids), resident.run_numpy(lengths, ids))
    tiered.close()


def test_python_fallback_reads_the_same_rows(tables: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pread.HELPER, "_lib", None)
    monkeypatch.setattr(pread.HELPER, "_tried", True)
    resident = HostEmbeddingStage(tables)
    tiered = HostEmbeddingStage(tables, table_memory=40_000, item_ids=20)
    for lengths, ids in _requests(5, seed=5):
        np.testing.assert_array_equal(tiered.run_numpy(lengths, ids), resident.run_numpy(lengths, ids))
    tiered.close()


def test_warm_loads_the_most_read_rows_and_answers_stay_exact(tables: Path) -> None:
    resident = HostEmbeddingStage(tables)
    tiered = HostEmbeddingStage(tables, table_memory=60_000, item_ids=20)
    store = tiered.stores[0]
    trace = _requests(30, seed=11)
    lengths = np.concatenate([r[0] for r in trace])
    ids = np.concatenate([r[1] for r in trace])
    assert tiered.warm(lengths, ids) == store.slots
    owners = store.owner[store.owner >= 0]
    assert np.array_equal(store.index[owners], np.flatnonzero(store.owner >= 0))
    for lengths, ids in trace[:5]:
        np.testing.assert_array_equal(tiered.run_numpy(lengths, ids), resident.run_numpy(lengths, ids))
    assert store.stats.hit_rate > 0.5
    tiered.close()


def test_warm_takes_rows_a_delta_replaced_from_the_overlay(tables: Path) -> None:
    from sixfold.backends.host.table_store import RowOverlay

    tiered = HostEmbeddingStage(tables, table_memory=60_000, item_ids=20)
    store = tiered.stores[0]
    rows = np.array([3, 1500, 4001], np.int64)  # global rows in tables 0, 1 and 2
    values = np.full((3, DIM), 7.0, np.float32)
    with store.lock:
        store.replace_rows(rows, values, RowOverlay.empty().merged(rows, values))
    store.warm(rows)
    np.testing.assert_array_equal(store.data[store.index[rows]], values)
    tiered.close()


def _global_rows(lengths: np.ndarray, ids: np.ndarray) -> np.ndarray:
    table = np.repeat(np.tile(np.arange(len(ROWS)), lengths.shape[0]), lengths.reshape(-1))
    return ids.astype(np.int64) + np.cumsum((0,) + ROWS)[table]


@pytest.mark.parametrize("precision,budget", [("fp32", 60_000), ("int8", 45_000)])
@pytest.mark.parametrize("cache", ["cold", "warm", "full"])
def test_a_split_batch_reads_each_missed_row_once(tables: Path, precision: str, budget: int, cache: str) -> None:
    # ~66-98 staging rows, ~370-420 slots: the batch's ~180 distinct misses are looked up in runs of bags
    resident = HostEmbeddingStage(tables, precision)
    tiered = HostEmbeddingStage(tables, precision, table_memory=budget, item_ids=20)
    store = tiered.stores[0]
    if cache == "warm":  # some of the batch's rows cached
        trace = _requests(3, seed=21, max_items=10)
        tiered.warm(np.concatenate([r[0] for r in trace]), np.concatenate([r[1] for r in trace]))
    elif cache == "full":  # every slot taken by other rows: the policy admits no first-time miss
        store.warm(np.random.default_rng(2).permutation(store.total_rows))
        assert store.cached_rows == store.slots
    gen = RequestGenerator(ROWS, 4, (5, 5, 5, 5), zipf=1.05, seed=13)
    lengths = gen.lengths(12)
    ids = gen.ids(lengths)
    rows = _global_rows(lengths, ids)
    cached = tiered.cached(lengths, ids)
    distinct_misses = np.unique(rows[~cached]).shape[0]
    assert store.staging_rows < distinct_misses < store.slots // 2  # split, and every kept row fits
    assert np.unique(rows).shape[0] < rows.shape[0]  # rows repeat across the runs
    store.reset_stats()
    np.testing.assert_array_equal(tiered.run_numpy(lengths, ids), resident.run_numpy(lengths, ids))
    assert store.stats.rows_read == distinct_misses  # once each, read from the files on disk
    # counted as the batch unsplit would be: every id of a row not cached before is a miss
    assert (store.stats.hits, store.stats.misses, store.stats.batches) == (int(cached.sum()), int((~cached).sum()), 1)
    # the next batch is normal again: nothing stays pinned, the index and the owners agree
    for lengths, ids in _requests(5, seed=4, max_items=3):
        np.testing.assert_array_equal(tiered.run_numpy(lengths, ids), resident.run_numpy(lengths, ids))
    owners = store.owner[store.owner >= 0]
    assert np.array_equal(store.index[owners], np.flatnonzero(store.owner >= 0))
    assert (store.index >= 0).sum() == owners.shape[0]
    tiered.close()


def test_a_split_batch_too_big_to_keep_still_answers_exactly(tables: Path) -> None:
    # 27 staging rows, ~146 slots: more distinct misses than the cache can keep; some rows are read again
    resident = HostEmbeddingStage(tables)
    tiered = HostEmbeddingStage(tables, table_memory=40_000, item_ids=20)
    store = tiered.stores[0]
    gen = RequestGenerator(ROWS, 4, (5, 5, 5, 5), zipf=1.05, seed=17)
    lengths = gen.lengths(59)
    ids = gen.ids(lengths)
    assert np.unique(_global_rows(lengths, ids)).shape[0] > store.slots
    np.testing.assert_array_equal(tiered.run_numpy(lengths, ids), resident.run_numpy(lengths, ids))
    assert store.stats.misses == ids.shape[0] and store.stats.hits == 0 and store.stats.batches == 1
    tiered.close()
