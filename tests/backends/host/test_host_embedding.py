"""HostEmbeddingStage: fp32 equals a numpy reference; fp16/int8/int4 within their quantization bounds;
memory-mapped tables are not copied; converted tables are cached; errors say what is wrong.

Quantization bounds, per element of one pooled bag (sum over its rows r, range_r = max_r - min_r):
  fp16: |err| <= 2**-10 * (sum_r |w_r| + |out|)          (weights rounded to fp16, output rounded to fp16)
  int8: |err| <= sum_r range_r / 510 * 1.01 + 1e-6        (row-wise fp32 scale = range/255; half a step)
  int4: |err| <= sum_r (range_r / 30 + 2**-9 * (|min_r| + range_r)) + 1e-6
                                                        (scale = range/15; scale and bias stored as fp16)
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from sixfold.backends.api import BackendError, PartitionArtifact
from sixfold.backends.host.host_embedding import (PRECISIONS, HostEmbeddingBackend, HostEmbeddingStage, bytes_per_row,
                                     table_files)
from tests.backends.factories import device


def make_tables(rows=(50, 7, 1, 30), dim=8, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (r, dim)).astype(np.float32) for r in rows]


def make_request(rows, n=5, max_len=6, seed=1, empty_every=3):
    """Random jagged request: lengths [n, T] int32 (some bags empty), sample-major local ids int64."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len + 1, (n, len(rows))).astype(np.int32)
    lengths.reshape(-1)[::empty_every] = 0
    ids = [rng.integers(0, rows[t], lengths[s, t]) for s in range(n) for t in range(len(rows))]
    indices = np.concatenate(ids).astype(np.int64) if ids else np.zeros(0, np.int64)
    return lengths, indices


def reference(tables, lengths, indices, reduce=lambda rows: rows.sum(0)):
    """Per bag (sample-major, then table), ``reduce`` of the table rows it names; float64."""
    n, t_count = lengths.shape
    dim = tables[0].shape[1]
    out = np.zeros((n * t_count, dim))
    pos = 0
    for bag, length in enumerate(lengths.reshape(-1)):
        t = bag % t_count
        rows = tables[t][indices[pos:pos + length]].astype(np.float64)
        if length:
            out[bag] = reduce(rows)
        pos += length
    return out


def save_tables(tables, directory):
    directory.mkdir(parents=True, exist_ok=True)
    for t, a in enumerate(tables):
        np.save(directory / f"table_{t:03d}.npy", a)
    return directory


# ---- fp32 ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 64])
@pytest.mark.parametrize("layout", ["fused", "per-table"])
def test_fp32_equals_reference(n, layout):
    tables = make_tables()
    stage = HostEmbeddingStage(tables, layout=layout)
    for seed in range(3):
        lengths, indices = make_request(stage.table_rows, n=n, seed=seed)
        out = stage.run_numpy(lengths, indices)
        assert out.shape == (n * len(tables), 8) and out.dtype == np.float32
        np.testing.assert_allclose(out, reference(tables, lengths, indices), atol=1e-6, rtol=0)


def test_all_bags_empty_and_zero_samples():
    tables = make_tables()
    stage = HostEmbeddingStage(tables)
    out = stage.run_numpy(np.zeros((3, 4), np.int32), np.zeros(0, np.int64))
    assert out.shape == (12, 8) and not out.any()
    assert stage.run_numpy(np.zeros((0, 4), np.int32), np.zeros(0, np.int64)).shape == (0, 8)


def test_fp32_is_bit_identical_to_the_model_module():
    from sixfold.models.dlrm import TableBatchedEmbedding

    module = TableBatchedEmbedding((40, 9, 3), 16, torch.Generator().manual_seed(3))
    weight = module.weight.detach()
    tables = [weight[0:40], weight[40:49], weight[49:52]]
    stage = HostEmbeddingStage(tables)
    lengths, indices = make_request((40, 9, 3), n=17, seed=4)
    with torch.inference_mode():
        args = torch.from_numpy(lengths), torch.from_numpy(indices)
        assert torch.equal(stage(*args), module(*args))


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("n", [1, 9, 200, 1500])
def test_numpy_index_arithmetic_sums_like_forward_bit_for_bit(monkeypatch, precision, n):
    """run_numpy builds the rows in numpy (any batch size, any precision of one resident group);
    the sums must be forward's (torch's index arithmetic) to the bit. 1500 items: ~22k ids."""
    tables = make_tables(rows=(50, 7, 1, 30, 400))
    stage = HostEmbeddingStage(tables, precision)
    lengths, indices = make_request(stage.table_rows, n=n, seed=n, empty_every=4)
    calls = []
    monkeypatch.setattr(stage, "forward", lambda *a: calls.append(a) or HostEmbeddingStage.forward(stage, *a))
    got = stage.run_numpy(lengths, indices)
    assert calls == []  # the numpy path
    with torch.inference_mode():
        want = HostEmbeddingStage.forward(stage, torch.from_numpy(lengths), torch.from_numpy(indices)).numpy()
    assert got.dtype == np.float32 and got.shape == want.shape and np.array_equal(got, want)
    if precision == "fp32":
        np.testing.assert_allclose(got, reference(tables, lengths, indices), atol=1e-6, rtol=0)


def test_per_table_views_of_one_weight_are_used_in_place():
    """The built-ins hand over per-table views of one fused weight: no second copy of the tables."""
    weight = np.random.default_rng(2).standard_normal((88, 8)).astype(np.float32)
    views = [weight[0:50], weight[50:57], weight[57:58], weight[58:88]]
    stage = HostEmbeddingStage(views)
    assert np.shares_memory(stage.groups[0].array, weight) and stage.groups[0].array.shape == (88, 8)
    lengths, indices = make_request(stage.table_rows, n=7, seed=5)
    np.testing.assert_allclose(stage.run_numpy(lengths, indices), reference(views, lengths, indices), atol=1e-6)
    # Not adjacent (a gap, or out of order): copied into one buffer as before.
    for parts in ([weight[0:50], weight[51:58]], [weight[50:57], weight[0:50]]):
        assert not np.shares_memory(HostEmbeddingStage(parts).groups[0].array, weight)


# ---- quantized -------------------------------------------------------------------------------------


def _bound(precision, tables, lengths, indices, exact):
    if precision == "fp16":
        return 2.0 ** -10 * (reference(tables, lengths, indices, lambda r: np.abs(r).sum(0)) + np.abs(exact))
    rng_ = reference(tables, lengths, indices, lambda r: np.broadcast_to(
        (r.max(1) - r.min(1)).sum(), r.shape[1:]))
    if precision == "int8":
        return rng_ / 510 * 1.01 + 1e-6
    low = reference(tables, lengths, indices, lambda r: np.broadcast_to(np.abs(r.min(1)).sum(), r.shape[1:]))
    return rng_ / 30 + 2.0 ** -9 * (low + rng_) + 1e-6


@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
def test_quantized_within_bounds(precision):
    tables = make_tables(rows=(200, 31, 64), dim=16, seed=5)
    stage = HostEmbeddingStage(tables, precision)
    lengths, indices = make_request(stage.table_rows, n=40, max_len=12, seed=6)
    out = stage.run_numpy(lengths, indices)
    exact = reference(tables, lengths, indices)
    err = np.abs(out - exact)
    bound = _bound(precision, tables, lengths, indices, exact)
    assert (err <= bound).all(), f"{precision}: worst excess {(err - bound).max()}"
    assert err.max() > 0  # it really is quantized
    expected_bytes = sum(stage.table_rows) * bytes_per_row(precision, 16)
    assert stage.nbytes == expected_bytes


def test_mixed_precision_per_table():
    tables = make_tables(rows=(50, 7, 1, 30, 12), dim=8)
    mix = ["int8", "fp32", "int4", "fp16", "fp32"]
    stage = HostEmbeddingStage(tables, mix)
    assert len(stage.groups) == 4
    lengths, indices = make_request(stage.table_rows, n=9, seed=7)
    out = stage.run_numpy(lengths, indices).reshape(9, 5, 8)
    for p in set(mix):
        alone = HostEmbeddingStage(tables, p).run_numpy(lengths, indices).reshape(9, 5, 8)
        cols = [t for t, q in enumerate(mix) if q == p]
        np.testing.assert_allclose(out[:, cols], alone[:, cols], atol=1e-6, rtol=0)
    exact = reference(tables, lengths, indices).reshape(9, 5, 8)
    np.testing.assert_allclose(out[:, [1, 4]], exact[:, [1, 4]], atol=1e-6, rtol=0)


# ---- memory maps and caches ------------------------------------------------------------------------


def test_directory_fp32_per_table_is_zero_copy(tmp_path):
    tables = make_tables()
    src = save_tables(tables, tmp_path / "tables")
    stage = HostEmbeddingStage(src, layout="per-table")
    files = table_files(src)
    for group in stage.groups:
        (t,) = group.tables
        assert isinstance(group.array, np.memmap) and Path(group.array.filename) == files[t].resolve()
        assert np.shares_memory(group.array, group.weight.numpy())
        assert group.weight.data_ptr() == group.array.ctypes.data
    assert not (src / "fp32").exists()  # nothing written
    lengths, indices = make_request(stage.table_rows, seed=8)
    np.testing.assert_allclose(stage.run_numpy(lengths, indices), reference(tables, lengths, indices), atol=1e-6)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_directory_fused_is_cached_once_then_mapped(tmp_path, precision):
    tables = make_tables(dim=8)
    src = save_tables(tables, tmp_path / "tables")
    first = HostEmbeddingStage(src, precision, cache_dir=tmp_path / "cache")
    (cache,) = first.cache_paths
    assert cache.is_file() and cache.parent == tmp_path / "cache" / "tables"
    assert sorted(p.name for p in src.iterdir()) == [f"table_{t:03d}.npy" for t in range(4)]  # nothing beside the tables
    stamp = cache.stat().st_mtime_ns
    second = HostEmbeddingStage(src, precision, cache_dir=tmp_path / "cache")
    assert second.cache_paths == [cache] and cache.stat().st_mtime_ns == stamp  # mapped, not rebuilt
    (group,) = second.groups
    assert isinstance(group.array, np.memmap) and Path(group.array.filename) == cache.resolve()
    assert np.shares_memory(group.array, group.weight.numpy())
    lengths, indices = make_request(first.table_rows, seed=9)
    np.testing.assert_array_equal(first.run_numpy(lengths, indices), second.run_numpy(lengths, indices))
    from_list = HostEmbeddingStage(tables, precision).run_numpy(lengths, indices)
    np.testing.assert_array_equal(second.run_numpy(lengths, indices), from_list)


def test_per_table_quantized_cache_follows_contents_not_mtimes(tmp_path):
    tables = make_tables()
    src = save_tables(tables, tmp_path / "tables")
    first = HostEmbeddingStage(src, "int8", layout="per-table", cache_dir=tmp_path / "cache")
    assert len(first.cache_paths) == 4 and not (src / "int8").exists()
    # New rows in a file whose modification time is older than the cache's: a new cache, the new rows.
    stamp = (src / "table_002.npy").stat().st_mtime_ns
    tables[2] = tables[2] + 5
    np.save(src / "table_002.npy", tables[2])
    os.utime(src / "table_002.npy", ns=(stamp - 10**9, stamp - 10**9))
    stage = HostEmbeddingStage(src, "int8", layout="per-table", cache_dir=tmp_path / "cache")
    assert stage.cache_paths[2] != first.cache_paths[2] and stage.cache_paths[:2] == first.cache_paths[:2]
    lengths, indices = make_request(stage.table_rows, seed=10)
    err = np.abs(stage.run_numpy(lengths, indices) - reference(tables, lengths, indices))
    assert err.max() < 0.1


def test_cache_off_writes_nothing(tmp_path):
    src = save_tables(make_tables(), tmp_path / "tables")
    HostEmbeddingStage(src, "int4", cache=False, cache_dir=tmp_path / "cache")
    assert sorted(p.name for p in src.iterdir()) == [f"table_{t:03d}.npy" for t in range(4)]
    assert not (tmp_path / "cache").exists()


# ---- errors ----------------------------------------------------------------------------------------


def test_bad_precision_is_a_clear_value_error():
    with pytest.raises(ValueError, match=r"unknown precision 'int3'; known: fp32, fp16, int8, int4"):
        HostEmbeddingStage(make_tables(), "int3")
    with pytest.raises(ValueError, match="3 precisions given for 4 tables"):
        HostEmbeddingStage(make_tables(), ["fp32", "int8", "int4"])
    with pytest.raises(ValueError, match="int4 needs an even dim"):
        HostEmbeddingStage(make_tables(dim=7), "int4")
    with pytest.raises(ValueError, match="unknown layout"):
        HostEmbeddingStage(make_tables(), layout="sharded")  # type: ignore[arg-type]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_ids_out_of_range_name_the_table(precision):
    stage = HostEmbeddingStage(make_tables(rows=(50, 7, 1, 30)), precision)
    lengths = np.array([[1, 1, 1, 1], [0, 2, 0, 0]], np.int32)
    with pytest.raises(IndexError, match=r"sparse_indices\[5\] = 7 is out of range for table 1 \(7 rows; sample 1\)"):
        stage.run_numpy(lengths, np.array([3, 2, 0, 9, 6, 7], np.int64))
    with pytest.raises(IndexError, match="= -1 is out of range for table 0"):
        stage.run_numpy(lengths, np.array([-1, 2, 0, 9, 6, 6], np.int64))
    with pytest.raises(IndexError, match="= 1 is out of range for table 2"):
        stage.run_numpy(lengths, np.array([3, 2, 1, 9, 6, 6], np.int64))


def test_malformed_requests():
    stage = HostEmbeddingStage(make_tables())
    with pytest.raises(ValueError, match=r"sum to 4 but sparse_indices has 3 ids"):
        stage.run_numpy(np.ones((1, 4), np.int32), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"must be \[N, 4\]"):
        stage.run_numpy(np.ones((1, 3), np.int32), np.zeros(3, np.int64))
    with pytest.raises(ValueError, match="negative"):
        stage.run_numpy(np.array([[1, -1, 1, 0]], np.int32), np.zeros(1, np.int64))


def test_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        HostEmbeddingStage(tmp_path / "nope")
    (tmp_path / "t").mkdir()
    np.save(tmp_path / "t" / "table_001.npy", np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match=r"tables \[0\] missing"):
        HostEmbeddingStage(tmp_path / "t")


# ---- as a backend ----------------------------------------------------------------------------------


def _artifact(payload, **meta):
    return PartitionArtifact(name="host", format="tables", payload=payload,
                             input_names=("sparse_lengths", "sparse_indices"),
                             output_names=("host_embedding_bag",), metadata=meta)


async def test_backend_loads_a_directory_and_runs(tmp_path):
    tables = make_tables()
    src = save_tables(tables, tmp_path / "tables")
    backend = HostEmbeddingBackend()
    assert backend.available() == (True, "")
    exe = backend.load(_artifact(str(src), precision=["fp32", "int8", "fp32", "fp16"]), device(kind="host"))
    try:
        lengths, indices = make_request(exe.stage.table_rows, seed=11)
        out = await exe.infer({"sparse_lengths": lengths, "sparse_indices": indices, "dense_features": None})
        assert list(out) == ["host_embedding_bag"]
        exact = reference(tables, lengths, indices).reshape(5, 4, 8)
        np.testing.assert_allclose(out["host_embedding_bag"].reshape(5, 4, 8)[:, [0, 2]], exact[:, [0, 2]],
                                   atol=1e-6)
        assert exe.memory_bytes() == exe.stage.nbytes > 0
        with pytest.raises(BackendError, match="out of range for table"):
            exe.run({"sparse_lengths": np.ones((1, 4), np.int32),
                     "sparse_indices": np.array([0, 0, 5, 0], np.int64)})
        with pytest.raises(BackendError, match="missing input 'sparse_indices'"):
            exe.run({"sparse_lengths": lengths})
    finally:
        exe.close()
    with pytest.raises(BackendError, match="is closed"):
        exe.run({"sparse_lengths": lengths, "sparse_indices": indices})


def test_backend_refusals():
    backend = HostEmbeddingBackend()
    with pytest.raises(BackendError, match="takes tables partitions"):
        backend.load(PartitionArtifact("d", "onnx", b"", ("x",), ("y",)), device(kind="host"))
    with pytest.raises(BackendError, match="unknown precision"):
        backend.load(_artifact(make_tables(), precision="bf8"), device(kind="host"))
    with pytest.raises(BackendError, match="unknown option"):
        HostEmbeddingBackend(threads=2)
    with pytest.raises(BackendError, match="option check_ids must be true or false, got 'no'"):
        HostEmbeddingBackend(check_ids="no")


def test_check_ids_off_skips_the_range_check_for_callers_that_did_it():
    """The server validates every id before queueing, so its host stage need not check again."""
    tables = make_tables(rows=(50, 7, 1, 30))
    lengths = np.array([[1, 1, 1, 1]], np.int32)
    good = np.array([3, 2, 0, 9], np.int64)
    checked = HostEmbeddingBackend().load(_artifact(tables), device(kind="host"))
    trusting = HostEmbeddingBackend(check_ids=False).load(_artifact(tables), device(kind="host"))
    assert trusting.stage.check_ids is False and checked.stage.check_ids is True
    for stage in (checked.stage, trusting.stage):
        np.testing.assert_array_equal(stage.run_numpy(lengths, good), checked.stage.run_numpy(lengths, good))
    with pytest.raises(IndexError, match="out of range for table 1"):
        checked.stage.run_numpy(lengths, np.array([3, 7, 0, 9], np.int64))


def test_the_numpy_path_stays_exact_as_batches_grow_and_shrink():
    """Its per-bag row offsets are cached and grown on demand; a smaller batch after a larger one reads a prefix."""
    tables = make_tables(rows=(50, 7, 1, 30, 400))
    stage = HostEmbeddingStage(tables)
    for n in (3, 500, 2, 90):
        lengths, indices = make_request(stage.table_rows, n=n, seed=n, empty_every=3)
        np.testing.assert_allclose(stage.run_numpy(lengths, indices), reference(tables, lengths, indices),
                                   atol=1e-6, rtol=0)
