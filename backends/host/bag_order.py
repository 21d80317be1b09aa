"""Table-major bag order: a fused lookup that reads one table's rows at a time.

Requests carry their ids sample-major (sample 0's bag for every table, then sample 1's).
One ``embedding_bag`` call over the fused weight in that order reads rows from every table
for each sample, so a large batch's working set is all the tables' hot rows at once: for a
700-item rm2 query (2.69M ids over 32 tables of 50k rows) the lookup took 26 ms that way and
12 ms with the same ids in table-major order, on this project's 2-core VM (BENCHMARKS.md,
"rm2's lookups read one table at a time").

Worth it only for long bags: the pooled rows go back to sample-major order with a copy of the
output, which costs as much as the locality saves below ~32 ids per bag (``MIN_IDS_PER_BAG``;
in-process, 2 threads, 100 and 700 items: one-hot dlrm-mlperf 0.98 -> 2.31 ms at 700 items, 24 ids
per bag 0.95x, 32 ids 1.04-1.06x, 64 ids 1.06-1.18x, rm2's 120 ids 1.10-1.23x).

``table_major`` copies the ids into table-major order with each table's first row added,
in one pass of the C helper ``_bag_order.c`` (the same pass the numpy path spends on
``np.repeat`` and an add), and ``sample_major`` puts the pooled rows back. Each bag keeps
its ids in order, so every sum is the same bit for bit and any kernel (fp32, fp16, int8,
int4) runs unchanged. Without a C compiler, or with ``SIXFOLD_BAG_ORDER=sample``, callers
keep the sample-major order.
"""

from __future__ import annotations

import ctypes

import numpy as np

from sixfold.backends.host.native import NativeHelper

__all__ = ["MIN_IDS_PER_BAG", "available", "worth_it", "table_major", "sample_major"]


def _declare(lib: ctypes.CDLL) -> None:
    for fn in (lib.sixfold_table_major, lib.sixfold_table_major_i32):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]


HELPER = NativeHelper("_bag_order.c", _declare, opt_out=("SIXFOLD_BAG_ORDER", "sample"),
                      purpose="embedding lookups keep the requests' sample-major bag order", flags=("-O3",))


MIN_IDS_PER_BAG = 32
"""Mean ids per bag from which ``worth_it`` says yes (see the module docstring)."""


def worth_it(samples: int, ids: int, bags: int) -> bool:
    """Whether a batch gains from table-major order: two or more samples, long bags on average."""
    return samples > 1 and ids >= MIN_IDS_PER_BAG * bags


def available() -> bool:
    """Whether ``table_major`` can run (the helper compiled and loaded)."""
    return HELPER.load() is not None


def table_major(ids: np.ndarray, starts: np.ndarray, lengths: np.ndarray, samples: int,
                row_offset: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The fused weight's rows and bag offsets in table-major order, or None without the helper.

    ``ids``: the batch's ids, sample-major (int32 ones are read as they are; the rows are int64);
    ``starts``/``lengths``: each bag's first id and count ([samples * tables], sample-major, int64);
    ``row_offset``: each table's first row in the fused weight. Checks are the caller's (counts and
    ids were checked before).
    """
    lib = HELPER.load()
    if lib is None:
        return None
    tables = int(row_offset.shape[0])
    assert starts.shape == lengths.shape == (samples * tables,)
    narrow = ids.dtype == np.int32
    ids = np.ascontiguousarray(ids, dtype=np.int32 if narrow else np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    row_offset = np.ascontiguousarray(row_offset, dtype=np.int64)
    rows = np.empty(ids.shape[0], np.int64)
    offsets = np.empty(samples * tables, np.int64)
    reorder = lib.sixfold_table_major_i32 if narrow else lib.sixfold_table_major
    reorder(ids.ctypes.data, starts.ctypes.data, lengths.ctypes.data, samples, tables, row_offset.ctypes.data,
            rows.ctypes.data, offsets.ctypes.data)
    return rows, offsets


def sample_major(pooled: np.ndarray, samples: int, tables: int) -> np.ndarray:
    """Pooled rows in table-major bag order -> [samples * tables, dim] in the requests' order."""
    dim = pooled.shape[1]
    return pooled.reshape(tables, samples, dim).transpose(1, 0, 2).reshape(samples * tables, dim)
