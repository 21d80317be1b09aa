"""The host (sparse) stage: table-batched embedding bags with a precision per table.

``HostEmbeddingStage`` takes the canonical jagged request (``sparse_lengths``
[N, T] int32, sample-major ``sparse_indices`` int64 holding per-table local
ids) and returns the sum-pooled bags, [N * T, dim] float32 in bag order
(sample 0 table 0, sample 0 table 1, ...): the same tensor as
``sixfold.models.dlrm.TableBatchedEmbedding.forward``, so it is a drop-in for the host
partition (bit-identical for fp32 tables in the fused layout).

Precision is row-wise, per table:

==========  =================================================  ====================
precision   kernel                                             bytes per row (dim)
==========  =================================================  ====================
fp32        ``F.embedding_bag``                                4 * dim
fp16        ``F.embedding_bag`` on a half weight               2 * dim
int8        ``quantized.embedding_bag_byte_rowwise_offsets``   dim + 8 (fp32 scale, bias)
int4        ``quantized.embedding_bag_4bit_rowwise_offsets``   dim / 2 + 4 (fp16 scale, bias)
==========  =================================================  ====================

Tables come as a list of 2-D arrays or as a directory of ``table_NNN.npy``
files (what ``sixfold.partitioner.artifacts`` writes). A directory is memory-mapped
(``np.load(mmap_mode="r")``): a restart copies nothing and pages in only the
rows that are read. Quantized and fp16 tables are converted once and cached in
the cache folder (``cache_dir``, ``sixfold.backends.host.derived_cache``: never
inside the tables' folder, which may be read-only), keyed by the tables'
contents, so the next start maps them too and changed rows are never served
from an old cache.

Layout. Tables of one precision are looked up by one kernel call over one
weight ("fused", the default, FBGEMM TBE style) or by one call per table
("per-table"). Fused needs the group's tables in one buffer, so it
concatenates them: in memory for a list; for a directory once, into a
fused file in the cache folder, which later starts map with no copy. Per-table
never copies a table: fp32 tables from a directory are used straight from their
own memory maps, and no fused file is written, at a measured cost (rm2-like, 1
thread: ~1.5x the fused time, from the extra id permutation and 32 calls; see
BENCHMARKS.md). With no writable cache folder (or a full disk), fused fp32
tables are served per-table and other precisions are converted in memory; the
reason is logged and kept in ``uncached``.

Index arithmetic (the model's): ``rows = ids + repeat_interleave(bag row
offset, lengths)``, one ``embedding_bag`` per group. With several groups the
bags are first put group-major (an O(ids) permutation built from the lengths
alone, no sort), and each group's output is scattered back to bag order.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from sixfold.backends.host import bag_order, derived_cache
from sixfold.backends.api import Arrays, Backend, BackendError, Executable, PartitionArtifact
from sixfold.backends.memory import check_fits
from sixfold.backends.options import reject_unknown
from sixfold.backends.spec import DeviceSpec
from sixfold.backends.host.table_store import IO_THREADS

__all__ = [
    "PRECISIONS", "Layout", "HostEmbeddingStage", "HostEmbeddingBackend", "HostEmbeddingExecutable",
    "bytes_per_row", "table_files",
]

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8", "int4")
Layout = Literal["fused", "per-table"]
_TABLE_FILE = re.compile(r"^table_(\d+)\.npy$")
_CHUNK_ROWS = 1 << 16  # rows converted at a time, so packing a 10 GB table needs no 10 GB buffer


def bytes_per_row(precision: str, dim: int) -> int:
    """Bytes one row of ``dim`` takes in ``precision`` (the packed layout's, scale and bias included)."""
    _check_precision(precision)
    return {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + 8, "int4": (dim + 1) // 2 + 4}[precision]


def table_files(directory: str | Path) -> list[Path]:
    """The ``table_NNN.npy`` files in ``directory``, by table number; ValueError if numbers are missing."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no tables directory {str(directory)!r}")
    found = {int(m.group(1)): p for p in directory.iterdir() if (m := _TABLE_FILE.match(p.name))}
    if not found:
        raise ValueError(f"{directory}: no table_NNN.npy files")
    missing = sorted(set(range(max(found) + 1)) - set(found))
    if missing:
        raise ValueError(f"{directory}: tables {missing} missing (found {len(found)} table_NNN.npy files)")
    return [found[i] for i in range(len(found))]


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")


@dataclass
class _Group:
    """Tables sharing one weight (and one kernel call)."""

    precision: str
    tables: list[int]
    array: np.ndarray
    """The weight's numpy buffer (an ``np.memmap`` view when mapped from disk)."""
    row_offsets: list[int]
    """Each table's first row in the weight."""
    weight: Any = None
    """``torch.from_numpy(array)``: shares its memory."""
    store: Any = None
    """A ``table_store.TieredRows`` when the rows live on disk (``array`` is then its cache)."""

    def __post_init__(self) -> None:
        import torch

        with warnings.catch_warnings():  # a read-only map; no kernel here writes to a weight
            warnings.simplefilter("ignore", UserWarning)
            self.weight = torch.from_numpy(self.array)


class HostEmbeddingStage:
    """Sum-pooled embedding bags over T tables, each in its own precision. See the module docstring.

    ``tables``: a list of 2-D float arrays (numpy or torch; one per table, same
    dim) or a directory of ``table_NNN.npy``. ``precision``: one name for all
    tables or one per table. ``cache``: for a directory, keep converted tables
    on disk in ``cache_dir`` (default ``derived_cache.default_cache_dir()``; off:
    convert in memory at every start). ``fingerprints``: file name -> checksum of
    the tables (plan.json's ``tables.checksums``), the cache's key; computed from
    the files when not given.
    ``check_ids``: check every id against its table (an O(ids) pass; off when the caller has
    checked them already, as the server does before a request is queued).
    Call it like the model's module: ``stage(sparse_lengths, sparse_indices)``
    with torch tensors, or ``stage.run_numpy`` with arrays.
    """

    def __init__(self, tables: Sequence[Any] | str | Path, precision: str | Sequence[str] = "fp32", *,
                 layout: Layout = "fused", cache: bool = True, check_ids: bool = True,
                 table_memory: int | float | None = None, cache_policy: str = "tinylfu", item_ids: int = 1,
                 io_threads: int = IO_THREADS, cache_dir: str | Path | None = None,
                 fingerprints: Mapping[str, str] | None = None) -> None:
        import torch

        if layout not in ("fused", "per-table"):
            raise ValueError(f"unknown layout {layout!r}; known: fused, per-table")
        self.source: Path | None = None
        if isinstance(tables, (str, os.PathLike)):
            self.source = Path(tables)
            files = table_files(self.source)
            arrays = [np.load(f, mmap_mode="r") for f in files]
        else:
            arrays = [t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in tables]
            files = []
        if not arrays:
            raise ValueError("no tables")
        for t, a in enumerate(arrays):
            if a.ndim != 2 or a.shape[0] < 1:
                raise ValueError(f"table {t}: expected a 2-D array with >= 1 row, got shape {a.shape}")
        precisions = [precision] * len(arrays) if isinstance(precision, str) else list(precision)
        if len(precisions) != len(arrays):
            raise ValueError(f"{len(precisions)} precisions given for {len(arrays)} tables")
        for p in precisions:
            _check_precision(p)
        # NOTE: a uint8 table of an int8/int4 precision is already row-wise packed (written so by
        # sixfold.partitioner.tables.build for tables too large to keep in fp32): its dim is the packed width's.
        self.packed = frozenset(t for t, (a, p) in enumerate(zip(arrays, precisions))
                                if a.dtype == np.uint8 and p in ("int8", "int4"))
        dims = {_logical_dim(a.shape[1], precisions[t]) if t in self.packed else a.shape[1]
                for t, a in enumerate(arrays)}
        if len(dims) != 1:
            raise ValueError(f"tables differ in dim: {sorted(dims)}; all tables must share one dim")
        self.dim = dims.pop()
        self.table_rows = tuple(int(a.shape[0]) for a in arrays)
        if "int4" in precisions and self.dim % 2:
            raise ValueError(f"int4 needs an even dim; tables have dim {self.dim}")
        self.precisions = tuple(precisions)
        self.layout = layout
        self._cache = cache and self.source is not None
        self.cache_dir = Path(cache_dir) if cache_dir else derived_cache.default_cache_dir()
        self._fingerprints = dict(fingerprints or {})
        self.cache_paths: list[Path] = []
        """The derived files this stage maps (in ``cache_dir``)."""
        self.uncached: str | None = None
        """Why the cache could not be used (the tables are then served as they are), or None."""
        self.check_ids = check_ids
        self.table_memory: int | None = None
        if table_memory is not None:
            self._build_tiered(files, table_memory, cache_policy, item_ids, io_threads)
            return

        self.groups: list[_Group] = []
        for p in PRECISIONS:
            members = [t for t, q in enumerate(self.precisions) if q == p]
            if not members:
                continue
            for part in ([members] if layout == "fused" else [[t] for t in members]):
                self.groups.extend(self._build_groups(p, part, arrays, files))
        self._prepare_index_arithmetic()

    # ---- loading -------------------------------------------------------------------------------

    def _build_groups(self, precision: str, members: list[int], arrays: list[np.ndarray],
                      files: list[Path]) -> list[_Group]:
        """One group of ``members``; fused fp32 tables that cannot be cached: one group per table (no copy)."""
        offsets = np.concatenate([[0], np.cumsum([self.table_rows[t] for t in members])[:-1]]).tolist()
        if len(members) == 1 and members[0] in self.packed:  # already in its precision's layout: map it
            return [_Group(precision, members, arrays[members[0]], offsets)]
        if len(members) == 1 and precision == "fp32":
            a = arrays[members[0]]
            # NOTE: zero copy when the table is already C-contiguous fp32 (a memory map is).
            weight = a if a.dtype == np.float32 and a.flags.c_contiguous else np.ascontiguousarray(a, np.float32)
            return [_Group(precision, members, weight, offsets)]
        if precision == "fp32":
            adjacent = _adjacent_rows([arrays[t] for t in members])
            if adjacent is not None:  # already one buffer (a model's fused weight, sliced per table): use it
                return [_Group(precision, members, adjacent, offsets)]
        if len(members) == 1 and (provided := self._provided(precision, members[0], files)) is not None:
            return [_Group(precision, members, np.load(provided, mmap_mode="r"), offsets)]
        if self._cache:
            weight = self._cached(precision, members, arrays, files)
            if weight is not None:
                return [_Group(precision, members, weight, offsets)]
            if precision == "fp32":  # the tables as they are: one kernel call each, zero copies
                return [g for t in members for g in self._build_groups(precision, [t], arrays, files)]
        return [_Group(precision, members, self._convert(precision, [arrays[t] for t in members], None), offsets)]

    def _provided(self, precision: str, table: int, files: list[Path]) -> Path | None:
        """The repository's own ``<precision>/table_NNN.npy`` (``tables build`` writes them), when plan.json's
        checksums list it (so the loader has verified its contents) and its shape fits; else None."""
        if self.source is None or precision == "fp32" or f"{precision}/{files[table].name}" not in self._fingerprints:
            return None
        path = self.source / precision / files[table].name
        width = bytes_per_row(precision, self.dim) if precision in ("int8", "int4") else self.dim
        return path if _mapped(path, (self.table_rows[table], width)) is not None else None

    def _cache_path(self, precision: str, members: list[int], files: list[Path]) -> Path:
        """Where the derived weight of ``members`` in ``precision`` lives: named by the tables' contents."""
        sources = []
        for t in members:
            name = files[t].name
            checksum = self._fingerprints.get(name)
            if checksum is None:
                checksum = self._fingerprints[name] = derived_cache.source_checksum(files[t])
            sources.append((name, checksum))
        key = derived_cache.content_key("tables", sources, precision=precision, dim=self.dim,
                                        rows=[self.table_rows[t] for t in members])
        return self.cache_dir / "tables" / f"{precision}-{len(members)}t-{key[:40]}.npy"

    def _cached(self, precision: str, members: list[int], arrays: list[np.ndarray],
                files: list[Path]) -> np.ndarray | None:
        """The derived weight from the cache (written first if missing), or None (logged) when it cannot be."""
        width = bytes_per_row(precision, self.dim) if precision in ("int8", "int4") else self.dim
        expected = (sum(self.table_rows[t] for t in members), width)
        try:
            path = self._cache_path(precision, members, files)
            weight = _mapped(path, expected)
            if weight is None:
                derived_cache.prepare_dir(path.parent)
                weight = self._convert(precision, [arrays[t] for t in members], path)
            self.cache_paths.append(path)
            return weight
        except OSError as exc:
            self.uncached = str(exc)
            log.warning("tables in %s: no %s cache (%s); serving them %s", self.source, precision, exc,
                        "per table from their own files" if precision == "fp32" else "converted in memory")
            return None

    def _build_tiered(self, files: list[Path], table_memory: int | float, policy: str, item_ids: int,
                      io_threads: int) -> None:
        """One group per precision, its rows on disk behind a row cache (``sixfold.backends.host.table_store``).

        ``table_memory``: bytes, or a share (0, 1] of the tables' bytes; split between the groups
        by their bytes on disk. fp32 rows are read from the source files; other precisions from
        per-table converted files (``tables/<precision>/table_NNN.npy``, written once).
        """
        from sixfold.backends.host.table_store import TieredRows, open_table_file

        if self.source is None:
            raise ValueError("table_memory needs the tables as a directory of table_NNN.npy files")
        members = {p: [t for t, q in enumerate(self.precisions) if q == p] for p in PRECISIONS}
        paths: dict[str, list[Path]] = {}
        for p, tables in members.items():
            for t in tables:
                own = p == "fp32" or t in self.packed
                path = files[t] if own else self._tiered_file(p, t, files)
                paths.setdefault(p, []).append(path)
        heads = {p: [open_table_file(f) for f in fs] for p, fs in paths.items()}
        group_bytes = {p: sum(h.rows * h.row_bytes for h in hs) for p, hs in heads.items()}
        total = sum(group_bytes.values())
        budget = int(table_memory * total) if isinstance(table_memory, float) else int(table_memory)
        self.table_memory = budget
        self.groups = []
        for p in PRECISIONS:
            if p not in heads:
                continue
            share = budget * group_bytes[p] // total
            ids = max(1, item_ids * len(members[p]) // self.num_tables)
            store = TieredRows(heads[p], share, policy=policy, min_staging_rows=ids,  # type: ignore[arg-type]
                               io_threads=io_threads)
            offsets = store.table_starts[:-1].tolist()
            self.groups.append(_Group(p, members[p], store.data, offsets, store=store))
        self._prepare_index_arithmetic()

    def _tiered_file(self, precision: str, table: int, files: list[Path]) -> Path:
        """The converted file a tiered table of ``precision`` reads its rows from (in the cache; written once)."""
        provided = self._provided(precision, table, files)
        if provided is not None:
            return provided
        expected = (self.table_rows[table], bytes_per_row(precision, self.dim) if precision in ("int8", "int4")
                    else self.dim)
        try:
            path = self._cache_path(precision, [table], files)
            if _mapped(path, expected) is None:
                derived_cache.prepare_dir(path.parent)
                self._convert(precision, [np.load(files[table], mmap_mode="r")], path)
        except OSError as exc:
            raise ValueError(f"table {table} ({files[table]}): tiered {precision} rows are read from a converted "
                             f"file in the cache folder, and it cannot be written: {exc}; give a writable "
                             f"--cache-dir or serve these tables in fp32") from None
        self.cache_paths.append(path)
        return path

    def close(self) -> None:
        """Close the tiered stores' files (a resident stage holds none)."""
        for g in self.groups:
            if g.store is not None:
                g.store.close()

    def warm(self, sparse_lengths: np.ndarray, sparse_indices: np.ndarray, counts: np.ndarray | None = None) -> int:
        """Fill the tiered stores' caches with the rows these (recorded) requests read most; returns rows loaded.

        Rows are ranked by how often the ids ask for them (``counts``: each id's weight, default 1)
        and read in file order (``TieredRows.warm``). A resident stage has nothing to warm (returns 0).
        """
        loaded = 0
        for store, mine, rows in self._tiered_rows(sparse_lengths, sparse_indices):
            if counts is None:
                unique, wanted = np.unique(rows, return_counts=True)
            else:
                unique, inverse = np.unique(rows, return_inverse=True)
                wanted = np.bincount(inverse.reshape(-1), weights=np.asarray(counts)[mine], minlength=unique.shape[0])
            loaded += store.warm(unique[np.argsort(-wanted, kind="stable")])
        return loaded

    def cached(self, sparse_lengths: np.ndarray, sparse_indices: np.ndarray) -> np.ndarray:
        """Per id of these requests, whether a lookup now would find its row in DRAM (bool, like ``sparse_indices``).

        Ids of resident groups are True. Counts nothing and moves nothing (no hit, no reference
        bit); reads the row index without the stores' locks, so it is exact only while no batch
        runs (e.g. after ``warm``, before serving).
        """
        out = np.ones(np.shape(sparse_indices)[0], dtype=bool)
        for store, mine, rows in self._tiered_rows(sparse_lengths, sparse_indices):
            out[mine] = store.index[rows] >= 0
        return out

    def _tiered_rows(self, sparse_lengths: np.ndarray,
                     sparse_indices: np.ndarray) -> Iterator[tuple[Any, np.ndarray, np.ndarray]]:
        """Per tiered store: (the store, the positions of the ids its tables own, their rows in its weight)."""
        if not self.stores:
            return
        lengths = np.asarray(sparse_lengths).reshape(-1).astype(np.int64)
        ids = np.asarray(sparse_indices, dtype=np.int64)
        table = np.repeat(np.tile(np.arange(self.num_tables), lengths.shape[0] // self.num_tables), lengths)
        for group in self.groups:
            if group.store is not None:
                mine = np.flatnonzero(np.isin(table, group.tables))
                yield group.store, mine, ids[mine] + self._row_offset_np[table[mine]]

    @property
    def stores(self) -> list[Any]:
        """The tiered row stores (``TieredRows``), one per precision group; empty when all rows are resident."""
        return [g.store for g in self.groups if g.store is not None]

    def _convert(self, precision: str, parts: list[np.ndarray], path: Path | None) -> np.ndarray:
        """Concatenate ``parts`` in ``precision`` (packed for int8/int4), written to ``path`` when given.

        A file is written through ``derived_cache.write_npy`` (allocated first, no memory map):
        a full disk is an OSError naming the file, never a SIGBUS.
        """
        rows = sum(a.shape[0] for a in parts)
        dtype = {"fp32": np.float32, "fp16": np.float16}.get(precision, np.uint8)
        width = self.dim if precision in ("fp32", "fp16") else bytes_per_row(precision, self.dim)
        if path is not None:
            derived_cache.write_npy(path, dtype, (rows, width), _converted(precision, parts))
            log.info("cached %s tables at %s", precision, path)
            return np.load(path, mmap_mode="r")
        out = np.empty((rows, width), dtype)
        start = 0
        for chunk in _converted(precision, parts):
            out[start:start + chunk.shape[0]] = chunk
            start += chunk.shape[0]
        return out

    def _prepare_index_arithmetic(self) -> None:
        import torch

        t_count = self.num_tables
        group_of = np.empty(t_count, np.int64)
        row_offset = np.empty(t_count, np.int64)  # each table's first row in its group's weight
        for g, group in enumerate(self.groups):
            for t, off in zip(group.tables, group.row_offsets):
                group_of[t], row_offset[t] = g, off
        self._row_offset = torch.from_numpy(row_offset)
        self._row_offset_np = row_offset
        self._bag_row_offsets = np.tile(row_offset, 64)  # grown by _row_offsets_of_bags as batches grow
        self._table_rows_np = np.asarray(self.table_rows, dtype=np.int64)
        self._table_rows = torch.tensor(self.table_rows, dtype=torch.int64)
        self._min_rows = min(self.table_rows)
        # Tables in group-major order: the bag permutation is (group, sample, table-in-group).
        self._order = torch.tensor([t for group in self.groups for t in group.tables], dtype=torch.int64)
        self._group_sizes = [len(group.tables) for group in self.groups]
        if len(self.groups) == 1:
            bag_order.available()  # NOTE: compile (or find) the helper at load, not on the first request

    # ---- introspection ---------------------------------------------------------------------------

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    @property
    def nbytes(self) -> int:
        """Bytes of weights this stage reads from (memory-mapped or resident; a tiered group: its DRAM bytes)."""
        return sum(int(g.store.nbytes) if g.store is not None else int(g.weight.numel() * g.weight.element_size())
                   for g in self.groups)

    def weights(self) -> list[Any]:
        """Each group's weight tensor (for tests and tools)."""
        return [g.weight for g in self.groups]

    def __repr__(self) -> str:
        counts = {p: self.precisions.count(p) for p in PRECISIONS if p in self.precisions}
        return (f"HostEmbeddingStage({self.num_tables} tables, dim {self.dim}, "
                f"{', '.join(f'{n} {p}' for p, n in counts.items())}, {len(self.groups)} kernel call(s))")

    # ---- compute ---------------------------------------------------------------------------------

    def __call__(self, sparse_lengths: Any, sparse_indices: Any) -> Any:
        return self.forward(sparse_lengths, sparse_indices)

    def forward(self, sparse_lengths: Any, sparse_indices: Any) -> Any:
        """Sum-pool every (sample, table) bag; returns [N * T, dim] float32 in bag order."""
        import torch

        self._check_shapes(tuple(sparse_lengths.shape), tuple(sparse_indices.shape))
        n = sparse_lengths.shape[0]
        lengths = sparse_lengths.reshape(-1).to(torch.int64)
        total = sparse_indices.shape[0]
        self._check_counts(int(lengths.min()) if n else 0, int(lengths.sum()) if n else 0, total)
        ids = sparse_indices.to(torch.int64)
        if total and self.check_ids:
            self._check_ids(ids, lengths)
        if len(self.groups) == 1:
            g = self.groups[0]
            starts = torch.cumsum(lengths, 0) - lengths
            bag_off = (torch.zeros_like(sparse_lengths, dtype=torch.int64) + self._row_offset).reshape(-1)
            rows = torch.repeat_interleave(bag_off, lengths, output_size=total)
            rows += ids  # NOTE: in place: one fewer id-sized buffer to allocate and fault in per batch
            return self._bag(g, rows, starts)
        # Several groups: put bags group-major, look each group up, scatter back to bag order.
        t_count = self.num_tables
        bag = (torch.arange(n, dtype=torch.int64).unsqueeze(1) * t_count)  # [N, 1]
        perm_parts, sizes = [], []
        start_t = 0
        for size in self._group_sizes:
            cols = self._order[start_t:start_t + size]
            perm_parts.append((bag + cols).reshape(-1))  # this group's bags: sample-major, table-in-group
            sizes.append(n * size)
            start_t += size
        perm = torch.cat(perm_parts)  # new bag k is old bag perm[k]
        old_starts = torch.cumsum(lengths, 0) - lengths
        new_lengths = lengths[perm]
        new_ends = torch.cumsum(new_lengths, 0)
        new_starts = new_ends - new_lengths
        id_perm = torch.arange(total, dtype=torch.int64) + torch.repeat_interleave(
            old_starts[perm] - new_starts, new_lengths, output_size=total)
        tables_of_bag = perm % t_count
        rows = ids[id_perm] + torch.repeat_interleave(self._row_offset[tables_of_bag], new_lengths,
                                                      output_size=total)
        out = torch.empty(n * t_count, self.dim, dtype=torch.float32)
        bag_lo = 0
        for g, count in zip(self.groups, sizes):
            if count:
                id_lo = int(new_starts[bag_lo]) if bag_lo < new_starts.shape[0] else total
                id_hi = int(new_ends[bag_lo + count - 1])
                pooled = self._bag(g, rows[id_lo:id_hi], new_starts[bag_lo:bag_lo + count] - id_lo)
                out.index_copy_(0, perm[bag_lo:bag_lo + count], pooled)
            bag_lo += count
        return out

    def _check_shapes(self, lengths: tuple[int, ...], indices: tuple[int, ...]) -> None:
        if len(lengths) != 2 or lengths[1] != self.num_tables:
            raise ValueError(f"sparse_lengths must be [N, {self.num_tables}], got {list(lengths)}")
        if len(indices) != 1:
            raise ValueError(f"sparse_indices must be 1-D, got shape {list(indices)}")

    @staticmethod
    def _check_counts(smallest_length: int, counted: int, total: int) -> None:
        if smallest_length < 0:
            raise ValueError("sparse_lengths has negative entries")
        if counted != total:
            raise ValueError(f"sparse_lengths sum to {counted} but sparse_indices has {total} ids")

    def _check_ids(self, ids: Any, lengths: Any) -> None:
        import torch

        lo_t, hi_t = torch.aminmax(ids)  # one pass over the ids
        lo, hi = int(lo_t), int(hi_t)
        if lo >= 0 and hi < self._min_rows:
            return  # every id fits every table: the common case costs two reductions
        limits = torch.repeat_interleave(self._table_rows.repeat(lengths.shape[0] // self.num_tables),
                                         lengths, output_size=ids.shape[0])
        bad = (ids < 0) | (ids >= limits)
        if bool(bad.any()):
            k = int(bad.nonzero()[0, 0])
            bag = int(torch.searchsorted(torch.cumsum(lengths, 0), k, right=True))
            sample, table = divmod(bag, self.num_tables)
            raise IndexError(f"sparse_indices[{k}] = {int(ids[k])} is out of range for table {table} "
                             f"({self.table_rows[table]} rows; sample {sample})")

    @staticmethod
    def _bag(group: _Group, rows: Any, offsets: Any) -> Any:
        if group.store is not None:
            return _tiered_bag(group, rows, offsets)
        return _kernel(group.precision, group.weight, rows, offsets)

    def _pool_numpy(self, sparse_lengths: np.ndarray, sparse_indices: np.ndarray) -> np.ndarray:
        """``forward`` for one resident group with the index arithmetic in numpy.

        NOTE: a served batch of a few items spends most of its ~60 us in a dozen small torch ops
        (a dispatch each, and each releases and retakes the GIL, which the event loop's other
        threads then contend for); numpy does the same index arithmetic in a few microseconds.
        A large batch gains too: for 2.69M ids (a 700-item rm2 query) ``np.repeat`` takes ~1.5 ms
        where ``torch.repeat_interleave`` took 4-7, and the add is in place (whole stage, medians of
        40 alternated runs on 4 queries: 25.8 -> 23.6 ms at 700 items, 12.2 -> 10.7 at 270). The
        lookup is the same kernel call, so the sums are the same bit for bit. Checks and messages
        are ``forward``'s.
        """
        import torch

        lengths, ids = sparse_lengths, sparse_indices
        self._check_shapes(lengths.shape, ids.shape)
        flat = lengths.reshape(-1).astype(np.int64)
        total = ids.shape[0]
        ends = np.cumsum(flat)
        self._check_counts(int(flat.min()) if flat.size else 0, int(ends[-1]) if flat.size else 0, total)
        if total and self.check_ids and (int(ids.min()) < 0 or int(ids.max()) >= self._min_rows):
            limits = np.repeat(np.tile(self._table_rows_np, lengths.shape[0]), flat)
            if ((ids < 0) | (ids >= limits)).any():
                self._check_ids(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(flat))  # names the bad id
        samples = lengths.shape[0]
        # Long bags of two or more samples: the ids in table-major order, so the lookup reads one table at a time.
        ordered = (bag_order.table_major(ids, ends - flat, flat, samples, self._row_offset_np)
                   if bag_order.worth_it(samples, total, flat.shape[0]) else None)
        if ordered is None:
            rows = np.repeat(self._row_offsets_of_bags(flat.shape[0]), flat)  # int64, a new array
            rows += ids  # NOTE: in place: one id-sized buffer per batch, not two
            offsets = ends - flat
        else:
            rows, offsets = ordered
        group = self.groups[0]
        if group.precision == "fp32":
            # NOTE: the op itself, not F.embedding_bag's argument checks, and no inference_mode
            # context: no input needs grad, so neither changes the result, and each costs a few us.
            pooled = torch.embedding_bag(group.weight, torch.from_numpy(rows), torch.from_numpy(offsets),
                                         False, 0, False, None, False, None)[0].numpy()
        else:
            with torch.inference_mode():
                pooled = self._bag(group, torch.from_numpy(rows), torch.from_numpy(offsets)).numpy()
        return pooled if ordered is None else bag_order.sample_major(pooled, samples, self.num_tables)

    def _row_offsets_of_bags(self, bags: int) -> np.ndarray:
        """Each bag's table's first row in the fused weight, for ``bags`` bags (sample-major)."""
        tiled = self._bag_row_offsets
        if tiled.shape[0] < bags:
            copies = max(2 * tiled.shape[0], bags) // self.num_tables + 1
            tiled = self._bag_row_offsets = np.tile(self._row_offset_np, copies)
        return tiled[:bags]

    def run_numpy(self, sparse_lengths: np.ndarray, sparse_indices: np.ndarray) -> np.ndarray:
        """``forward`` on numpy arrays (zero-copy views in and out).

        One resident group (every table in one weight, not tiered) does its index arithmetic in
        numpy (``_pool_numpy``): the same result, bit for bit, at a third of the cost for a small
        batch and ~10% less for a large one.
        """
        import torch

        if (len(self.groups) == 1 and self.groups[0].store is None and np.ndim(sparse_indices) == 1
                and np.ndim(sparse_lengths) == 2):
            return self._pool_numpy(np.asarray(sparse_lengths), np.asarray(sparse_indices))

        with torch.inference_mode(), warnings.catch_warnings():
            # NOTE: inputs may be read-only gRPC buffers; nothing here writes to them.
            warnings.simplefilter("ignore", UserWarning)
            args = torch.from_numpy(np.asarray(sparse_lengths)), torch.from_numpy(np.asarray(sparse_indices))
        with torch.inference_mode():
            return self.forward(*args).numpy()


def _logical_dim(width: int, precision: str) -> int:
    """The dim of a packed row ``width`` bytes wide (int8: fp32 scale and bias; int4: fp16 ones)."""
    return width - 8 if precision == "int8" else (width - 4) * 2


def _kernel(precision: str, weight: Any, rows: Any, offsets: Any) -> Any:
    import torch
    from torch.nn import functional as F

    if precision == "fp32":
        return F.embedding_bag(rows, weight, offsets, mode="sum")
    if precision == "fp16":
        return F.embedding_bag(rows, weight, offsets, mode="sum").float()
    op = (torch.ops.quantized.embedding_bag_byte_rowwise_offsets if precision == "int8"
          else torch.ops.quantized.embedding_bag_4bit_rowwise_offsets)
    return op(weight, rows, offsets, False, 0, False, None, None, False)


def _tiered_bag(group: _Group, rows: Any, offsets: Any) -> Any:
    """``_kernel`` over a tiered group: the cache answers each id's row position, the kernel runs on the cache.

    A batch with more distinct misses than the store stages is looked up in runs of bags
    (``_tiered_halves``), under the store's lock from the first run to the last, so that each
    distinct missed row is read from disk once (``TieredRows.begin_split``).
    """
    import torch

    from sixfold.backends.host.table_store import TooManyMisses

    store = group.store
    with store.lock:
        try:
            positions = store.lookup(rows.numpy())
        except TooManyMisses:
            positions = None
        if positions is not None:
            return _kernel(group.precision, group.weight, torch.from_numpy(positions), offsets)
        store.begin_split(rows.numpy())
        try:
            return _tiered_halves(group, rows, offsets, 0)
        finally:
            store.end_split()


def _tiered_halves(group: _Group, rows: Any, offsets: Any, start: int) -> Any:
    """The bags of a split batch whose ids begin at ``start`` (too many misses at once), looked up in two halves.

    Each bag stays whole, so every bag sums its rows in the same order as a resident weight.
    """
    import torch

    bags = offsets.shape[0]
    if bags <= 1:
        raise BackendError(f"one bag of {rows.shape[0]} ids reads more distinct rows than the table memory "
                           f"stages ({group.store.staging_rows} rows); raise the table memory")
    mid = bags // 2
    cut = int(offsets[mid])
    first = _tiered_run(group, rows[:cut], offsets[:mid], start)
    second = _tiered_run(group, rows[cut:], offsets[mid:] - cut, start + cut)
    return torch.cat([first, second])


def _tiered_run(group: _Group, rows: Any, offsets: Any, start: int) -> Any:
    """One run of a split batch: looked up and summed now (the next run reuses the staging rows), or halved."""
    import torch

    from sixfold.backends.host.table_store import TooManyMisses

    try:
        positions = group.store.lookup(rows.numpy(), start=start)
    except TooManyMisses:
        return _tiered_halves(group, rows, offsets, start)
    return _kernel(group.precision, group.weight, torch.from_numpy(positions), offsets)


def _adjacent_rows(parts: list[np.ndarray]) -> np.ndarray | None:
    """One C-contiguous fp32 array spanning ``parts`` when they are consecutive rows of one buffer, else None.

    NOTE: the built-in models hand their tables over as per-table views of one fused weight;
    concatenating them again would double the tables' memory and, measured on rm2, run the
    lookups ~20% slower than on the model's own (huge-page) buffer.
    """
    first = parts[0]
    if not all(p.dtype == np.float32 and p.flags.c_contiguous and p.ndim == 2 and p.shape[1] == first.shape[1]
               for p in parts):
        return None
    address = first.__array_interface__["data"][0]
    for p in parts:
        if p.__array_interface__["data"][0] != address:
            return None
        address += p.nbytes
    rows = sum(p.shape[0] for p in parts)
    root = first  # the array that owns the memory: adjacent views of two allocations must not be joined
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.dtype != np.float32 or not root.flags.c_contiguous:
        return None
    flat = root.reshape(-1)
    start = (first.__array_interface__["data"][0] - flat.__array_interface__["data"][0]) // 4
    if start < 0 or start + rows * first.shape[1] > flat.size:
        return None
    return flat[start:start + rows * first.shape[1]].reshape(rows, first.shape[1])


def _mapped(path: Path, shape: tuple[int, int]) -> np.ndarray | None:
    """``path`` mapped read-only when it is a whole .npy of ``shape``, else None (missing or unusable)."""
    try:
        weight = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return None
    return weight if weight.shape == shape else None


def _converted(precision: str, parts: list[np.ndarray]) -> Iterator[np.ndarray]:
    """``parts``' rows in ``precision`` (packed for int8/int4), ``_CHUNK_ROWS`` at a time: no table-sized buffer."""
    import torch

    for a in parts:
        for lo in range(0, a.shape[0], _CHUNK_ROWS):
            if a.dtype == np.uint8 and precision in ("int8", "int4"):  # packed already: the rows as they are
                yield np.ascontiguousarray(a[lo:lo + _CHUNK_ROWS])
                continue
            chunk = np.ascontiguousarray(a[lo:lo + _CHUNK_ROWS], dtype=np.float32)
            if precision == "fp32":
                yield chunk
            elif precision == "fp16":
                yield chunk.astype(np.float16)
            else:
                op = (torch.ops.quantized.embedding_bag_byte_prepack if precision == "int8"
                      else torch.ops.quantized.embedding_bag_4bit_prepack)
                yield op(torch.from_numpy(chunk)).numpy()


# ---- the backend ---------------------------------------------------------------------------------


class HostEmbeddingExecutable(Executable):
    """A ``HostEmbeddingStage`` behind the Executable interface: arrays in, the pooled bags out."""

    def __init__(self, artifact: PartitionArtifact, device: DeviceSpec, stage: HostEmbeddingStage) -> None:
        super().__init__(artifact, device)
        self.stage: HostEmbeddingStage | None = stage

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        stage, name = self.stage, self.artifact.name
        if stage is None:
            raise BackendError(f"partition {name} on {self.device.name} is closed")
        try:
            lengths, indices = (inputs[n] for n in self.input_names)
        except KeyError as exc:
            raise BackendError(f"partition {name}: missing input {exc.args[0]!r}; "
                               f"got {', '.join(sorted(inputs)) or 'none'}") from None
        try:
            pooled = stage.run_numpy(lengths, indices)
        except (ValueError, IndexError) as exc:
            raise BackendError(f"partition {name}: {exc}") from exc
        return {self.output_names[0]: pooled}

    def memory_bytes(self) -> int:
        stage = self.stage
        return stage.nbytes if stage is not None else 0

    def close(self) -> None:
        super().close()
        if self.stage is not None:
            self.stage.close()
        self.stage = None


class HostEmbeddingBackend(Backend):
    """Format "tables": the payload is a tables directory or a list of 2-D arrays.

    ``artifact.metadata``: ``precision`` (one name or one per table, default
    fp32), ``layout`` (fused | per-table), ``cache`` (bool); ``table_memory``
    (bytes, or a share of the table bytes: rows stay on disk behind a DRAM row
    cache of that size, ``sixfold.backends.host.table_store``), ``cache_policy`` (tinylfu |
    clock), ``item_ids`` (ids one item reads at most: the budget's minimum stages them),
    ``io_threads``; ``cache_dir`` (where derived tables go, ``derived_cache``) and
    ``fingerprints`` (file name -> checksum, plan.json's: the cache's key). Inputs are
    ``artifact.input_names`` (sparse_lengths, sparse_indices); the one output
    is named by ``artifact.output_names`` (e.g. ("host_embedding_bag",)).
    """

    name = "host-embedding"
    formats = ("tables",)

    def __init__(self, *, check_ids: bool = True, **options: Any) -> None:
        reject_unknown(self.name, options, ())
        if not isinstance(check_ids, bool):
            raise BackendError(f"backend {self.name}: option check_ids must be true or false, got {check_ids!r}")
        self.check_ids = check_ids
        """Check every id against its table (off: the caller has, e.g. the server's request validation)."""
        super().__init__(check_ids=check_ids)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import torch
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        if not hasattr(torch.ops.quantized, "embedding_bag_byte_rowwise_offsets"):
            return False, "this torch build lacks the quantized embedding_bag ops"
        return True, ""

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> HostEmbeddingExecutable:
        if not self.supports(artifact):
            raise BackendError(f"backend {self.name} takes {', '.join(self.formats)} partitions; "
                               f"partition {artifact.name} is {artifact.format!r}")
        if len(artifact.input_names) != 2 or len(artifact.output_names) != 1:
            raise BackendError(f"partition {artifact.name}: expected 2 inputs (sparse_lengths, sparse_indices) "
                               f"and 1 output; got {artifact.input_names} -> {artifact.output_names}")
        meta = artifact.metadata
        budget = meta.get("table_memory")
        if budget is None:
            check_fits(artifact, device)
        else:  # tiered: the rows stay on disk; what must fit in the host's memory is the budget
            held = int(budget * artifact.param_bytes) if isinstance(budget, float) else int(budget)
            check_fits(dataclasses.replace(artifact, param_bytes=min(held, artifact.param_bytes)), device)
        try:
            stage = HostEmbeddingStage(artifact.payload, meta.get("precision", "fp32"),
                                       layout=meta.get("layout", "fused"), cache=meta.get("cache", True),
                                       check_ids=self.check_ids, table_memory=meta.get("table_memory"),
                                       cache_policy=meta.get("cache_policy", "tinylfu"),
                                       item_ids=meta.get("item_ids", 1), io_threads=meta.get("io_threads", IO_THREADS),
                                       cache_dir=meta.get("cache_dir"), fingerprints=meta.get("fingerprints"))
        except (ValueError, FileNotFoundError) as exc:
            raise BackendError(f"partition {artifact.name}: {exc}") from exc
        return HostEmbeddingExecutable(artifact, device, stage)
