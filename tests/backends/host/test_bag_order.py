"""Table-major bag order (backends/host/bag_order.py): the C helper's rows and offsets equal a numpy
reorder; the host stage's sums are the same bit for bit with it and without it, in every precision;
the opt-out variable and a machine without a C compiler leave the sample-major path."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from sixfold.backends.host import bag_order
from sixfold.backends.host.host_embedding import HostEmbeddingStage
from sixfold.backends.host.native import NativeHelper
from tests.backends.host.test_host_embedding import make_request, make_tables

pytestmark = pytest.mark.skipif(not bag_order.available(), reason="no C compiler: the sample-major path runs")


def _reference(ids, lengths, row_offset):
    """Table-major rows and bag offsets by a plain Python walk."""
    n, t = lengths.shape
    ends = np.cumsum(lengths.reshape(-1))
    starts = ends - lengths.reshape(-1)
    rows, offsets = [], []
    for table in range(t):
        for sample in range(n):
            bag = sample * t + table
            offsets.append(len(rows))
            rows.extend(int(i) + int(row_offset[table]) for i in ids[starts[bag]:ends[bag]])
    return np.asarray(rows, np.int64), np.asarray(offsets, np.int64)


@pytest.mark.parametrize("n", [2, 7, 300])
def test_rows_and_offsets_equal_a_python_reorder(n):
    rows_per_table = (50, 7, 1, 30, 400)
    lengths, ids = make_request(rows_per_table, n=n, seed=n, empty_every=3)  # some bags empty
    row_offset = np.concatenate([[0], np.cumsum(rows_per_table)[:-1]]).astype(np.int64)
    flat = lengths.reshape(-1).astype(np.int64)
    ends = np.cumsum(flat)
    got_rows, got_offsets = bag_order.table_major(ids, ends - flat, flat, n, row_offset)
    want_rows, want_offsets = _reference(ids, lengths, row_offset)
    assert np.array_equal(got_rows, want_rows) and np.array_equal(got_offsets, want_offsets)
    # Read-only and int32 inputs (a gRPC buffer, a narrower client) give the same answer.
    frozen = ids.astype(np.int32)
    frozen.flags.writeable = False
    again_rows, _ = bag_order.table_major(frozen, ends - flat, flat, n, row_offset)
    assert np.array_equal(again_rows, want_rows)


def test_sample_major_puts_pooled_rows_back():
    pooled = np.arange(3 * 4 * 2, dtype=np.float32).reshape(3 * 4, 2)  # 3 tables x 4 samples, table-major
    back = bag_order.sample_major(pooled, samples=4, tables=3)
    assert back.shape == (12, 2)
    assert np.array_equal(back[1 * 3 + 2], pooled[2 * 4 + 1])  # sample 1, table 2


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int4"])
def test_the_stage_sums_the_same_bits_in_either_order(monkeypatch, precision):
    stage = HostEmbeddingStage(make_tables(rows=(50, 7, 1, 30, 400)), precision)
    requests = {(n, longest): make_request(stage.table_rows, n=n, max_len=longest, seed=n + 7, empty_every=5)
                for n in (1, 2, 64, 900) for longest in (6, 120)}
    calls = []
    real = bag_order.table_major
    monkeypatch.setattr(bag_order, "table_major", lambda *a: calls.append(a[3]) or real(*a))
    table_major = {key: stage.run_numpy(*request) for key, request in requests.items()}
    # One sample is in table-major order already; short bags (~2.4 ids a bag) stay sample-major.
    assert calls == [2, 64, 900]
    monkeypatch.setattr(bag_order.HELPER, "_lib", None)  # as on a machine without the helper
    for (n, longest), request in requests.items():
        sample_major = stage.run_numpy(*request)
        assert table_major[n, longest].shape == (n * 5, stage.dim)
        assert np.array_equal(table_major[n, longest], sample_major)


def test_worth_it_needs_two_samples_and_long_bags():
    assert bag_order.worth_it(samples=2, ids=64 * 32, bags=64)
    assert not bag_order.worth_it(samples=2, ids=64 * 32 - 1, bags=64)
    assert not bag_order.worth_it(samples=1, ids=32 * 1000, bags=32)


def test_opt_out_variable_keeps_the_sample_major_order(monkeypatch, tmp_path):
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SIXFOLD_BAG_ORDER", "sample")
    helper = NativeHelper("_bag_order.c", bag_order._declare, opt_out=("SIXFOLD_BAG_ORDER", "sample"), purpose="test")
    assert helper.load() is None and list(tmp_path.iterdir()) == []


def test_without_a_compiler_it_warns_once_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.setenv("CC", "no-such-compiler")
    helper = NativeHelper("_bag_order.c", bag_order._declare, opt_out=("SIXFOLD_BAG_ORDER", "sample"),
                          purpose="lookups keep the sample-major order")
    with caplog.at_level(logging.WARNING, logger="sixfold.backends.host.native"):
        assert helper.load() is None and helper.load() is None
    assert [r.getMessage() for r in caplog.records] == [
        "lookups keep the sample-major order (C helper _bag_order.c unavailable: no C compiler (cc) on PATH)"]


def test_compiled_once_per_source_into_the_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    first = NativeHelper("_bag_order.c", bag_order._declare, opt_out=("SIXFOLD_BAG_ORDER", "sample"), purpose="test")
    assert first.load() is not None
    built = list(tmp_path.glob("sixfold_bag_order_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    second = NativeHelper("_bag_order.c", bag_order._declare, opt_out=("SIXFOLD_BAG_ORDER", "sample"), purpose="test")
    assert second.load() is not None and built[0].stat().st_mtime_ns == stamp
