"""Tables larger than memory: rows on disk behind a DRAM row cache with a byte budget.

``TieredRows`` serves one weight (the tables of one precision group of a
``HostEmbeddingStage``) from its ``table_NNN.npy`` files with positional reads,
keeping the rows that are read often in a DRAM cache. The lookup kernel does not
know which tier answered: ``lookup(rows)`` returns, for every id of a batch, the
index of its row in ``data`` (a cache slot, or a staging row read for this batch),
and the caller runs its ``embedding_bag`` over ``data`` as if it were the weight.

One batch, under the store's lock::

    slot = index[rows]                       # int32 per table row: its cache slot, or -1
    misses = rows[slot < 0], deduplicated     # O(ids), by scattering positions into index
    read misses -> staging rows               # sorted by offset, split over io threads
    hits: reference bit set, pinned for this batch
    admit some misses (policy) into victim slots chosen by CLOCK (never a pinned slot)

Policy (measured on rm2 at full size, Zipf ids: see BENCHMARKS.md, "Tiered tables"):

- ``clock``: every miss is admitted; victims by CLOCK (second chance, an LRU
  approximation whose sweep is a vectorised scan).
- ``tinylfu`` (default): a miss is admitted only when a small frequency sketch
  (a count-min sketch of uint8 counters, ``len(SKETCH_HASHES)`` per row, conservative
  update, halved every ``8 x counters`` updates) has seen the row miss ``ADMIT_MISSES``
  times, or a slot is still free. Power-law ids have a long tail of rows read once or
  twice; admitting them evicts hot rows for nothing. (With one hashed counter and a
  second miss admitting, rm2 at a 10% budget settled at an 80.2% hit rate; with four
  and a fourth miss, 82.4%: BENCHMARKS.md, "Tier estimate vs measured".)

Memory (all inside the budget): the row index, 4 bytes per table row; per slot
the row, its owner (8 B), a reference bit and a pin (5 B); the staging rows (a
share of the budget, at least one item's ids); the sketch. A budget below the
minimum (index + one item's ids staged + one way of slots) is refused with the
numbers. A batch with more distinct misses than staging rows is split into
smaller runs of bags by the caller (``TooManyMisses``), all under the lock between
``begin_split(rows)`` and ``end_split()``: the runs share one tick (what a run hits
or admits stays pinned until the batch ends), and a missed row that a later run
reads again is admitted whatever the policy says, so each distinct missed row of
the batch is read from disk once (unless no unpinned slot is left to keep it in).

Files changed under the store: each table file's identity (device, inode, size, modification
time) is taken when it is opened, and every batch that reads rows from a file checks that file's
identity again after its reads (one ``stat`` per table read). A file overwritten in place or
replaced by another would mix rows of two versions in one model; from the first batch that sees
it, every lookup fails with ``TableChanged`` naming the file (the server answers UNAVAILABLE) until
the model is loaded again.

Reads: files are opened with ``O_DIRECT`` where the file system allows it (no page
cache: the budget is the memory), else buffered with ``POSIX_FADV_DONTNEED`` after
each batch. ``sixfold.backends.host.pread`` does the reads (a C helper through ctypes, no GIL).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
import bisect
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from sixfold.backends.host import pread

__all__ = ["TieredRows", "RowOverlay", "TableFile", "TableMemoryError", "TableReadError", "TableChanged", "TooManyMisses",
           "CacheStats",
           "split_budget", "parse_bytes", "parse_table_memory", "open_table_file", "POLICIES", "READ_BUCKETS"]

log = logging.getLogger(__name__)

Policy = Literal["tinylfu", "clock"]
POLICIES = ("tinylfu", "clock")
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BLOCK = 4096
_SLOT_OVERHEAD = 8 + 1 + 4  # owner row, reference bit, pin tick
_INDEX_BYTES = 4
READ_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
"""Upper bounds (seconds) of the read-time histogram: one batch's misses read together."""
LOG_EVERY_BATCHES = 1000
"""The hit rate is logged (INFO) every this many batches that read from disk."""
SKETCH_HASHES = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
"""Multipliers of the admission sketch's hashes (one counter each per row; a row's count is their minimum)."""
ADMIT_MISSES = 4
"""``tinylfu`` admits a missed row (once the cache is full) when the sketch has counted this many misses of it."""
IO_THREADS = 32
"""Readers of one batch's misses by default: the depth ``sixfold-partition calibrate`` measures the disk at."""


_SKETCH_MULTIPLIERS = np.asarray(SKETCH_HASHES, np.int64)[:, None]


def parse_bytes(text: str | int) -> int:
    """``512MiB``, ``4GiB``, ``1.5GB``, ``1000000`` -> bytes. ValueError says what is accepted."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{text!r} is not a size; write bytes or e.g. 512MiB, 4GiB, 1.5GB")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"{text!r}: a size must be > 0 bytes")
    return value


def parse_table_memory(text: str | int | float | None) -> int | float | None:
    """A ``--table-memory`` value: bytes (``4GiB``), a share of the tables' bytes (``10%`` -> 0.1), or None."""
    if text is None or text == "":
        return None
    if isinstance(text, float):
        return text
    s = str(text).strip()
    if s.endswith("%"):
        share = float(s[:-1]) / 100
        if not 0 < share <= 1:
            raise ValueError(f"{text!r}: a share of the table bytes must be in (0%, 100%]")
        return share
    return parse_bytes(s)


class TableMemoryError(ValueError):
    """The budget cannot hold one batch's minimum working set (the message says the minimum)."""


class TableReadError(OSError):
    """A row read failed (I/O error or a file shorter than its header says): the batch fails, the store stays."""


class TableChanged(TableReadError):
    """A table file changed (size, modification time or inode) since the store opened it: reload the model."""


class TooManyMisses(Exception):
    """This run of bags has more distinct misses than staging rows: split it and look the halves up."""

    def __init__(self, misses: int, staging: int) -> None:
        super().__init__(f"{misses} distinct misses > {staging} staging rows")
        self.misses, self.staging = misses, staging


@dataclass(frozen=True)
class TableFile:
    """Where one table's rows are in its .npy file."""

    path: Path
    offset: int
    """Byte offset of row 0 (the .npy header's length)."""
    rows: int
    width: int
    dtype: np.dtype

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize


def open_table_file(path: str | Path) -> TableFile:
    """Read a .npy header (no data) and check the file holds every row; ValueError naming the file if not."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0(f) if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0(f))
            offset = f.tell()
    except FileNotFoundError:
        raise FileNotFoundError(f"table file {str(path)!r} is missing") from None
    except (ValueError, OSError) as exc:
        raise ValueError(f"table file {str(path)!r} is not a readable .npy file: {exc}") from None
    if fortran or len(shape) != 2 or dtype.hasobject:
        raise ValueError(f"table file {str(path)!r}: expected a C-ordered 2-D array, got shape {shape}"
                         f"{' (Fortran order)' if fortran else ''}")
    table = TableFile(path, offset, int(shape[0]), int(shape[1]), np.dtype(dtype))
    size = path.stat().st_size
    need = offset + table.rows * table.row_bytes
    if size < need:
        raise ValueError(f"table file {str(path)!r} is truncated: {size} bytes, its header says {need}")
    return table


@dataclass
class CacheStats:
    """Counters since the store opened (ids, not distinct rows)."""

    hits: int = 0
    misses: int = 0
    rows_read: int = 0
    read_seconds: float = 0.0
    batches: int = 0
    read_buckets: list[int] = field(default_factory=lambda: [0] * (len(READ_BUCKETS) + 1))
    """Batches' read times: counts per ``READ_BUCKETS`` upper bound (seconds), the last one above all."""

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def split_budget(budget: int, total_rows: int, row_bytes: int, *, policy: Policy = "tinylfu",
                 min_staging_rows: int = 1, staging_share: float = 0.125, ways: int = 8) -> tuple[int, int, int]:
    """How ``TieredRows`` splits ``budget`` bytes: (cache slots, staging rows, sketch bytes).

    The row index comes out first (4 B a table row), then the staging rows for one batch's distinct
    misses (``staging_share`` of the rest, at least ``min_staging_rows``), then the admission sketch
    (tinylfu only); the rest is cache slots of a row and its bookkeeping each. The slot count is not
    clamped (it may be below ``ways`` or above ``total_rows``): the store and the tier pricing
    (``sixfold.partitioner.pricing.tiers``) clamp it each their way.
    """
    slot_bytes = row_bytes + _SLOT_OVERHEAD
    rest = budget - _INDEX_BYTES * total_rows
    staging = max(max(1, int(min_staging_rows)), int(rest * staging_share) // row_bytes)
    sketch = 0
    if policy == "tinylfu":
        sketch = 1 << max(10, int(np.ceil(np.log2(max(1, (rest - staging * row_bytes) // slot_bytes)))))
        if rest - staging * row_bytes - sketch < ways * slot_bytes:
            sketch = 1024
    return int((rest - staging * row_bytes - sketch) // slot_bytes), int(staging), sketch


class TieredRows:
    """Rows of ``files`` (one weight, tables back to back) on disk behind a DRAM cache of ``budget`` bytes.

    ``min_staging_rows``: the most ids one item reads (sum of the tables' pooling):
    the budget must stage at least that many rows. ``staging_share``: the share of
    the budget (after the index) kept for one batch's distinct misses.
    """

    def __init__(self, files: Sequence[str | Path | TableFile], budget: int, *, policy: Policy = "tinylfu",
                 min_staging_rows: int = 1, staging_share: float = 0.125, io_threads: int = IO_THREADS,
                 direct: bool = True, ways: int = 8) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown cache policy {policy!r}; known: {', '.join(POLICIES)}")
        self.tables = [f if isinstance(f, TableFile) else open_table_file(f) for f in files]
        if not self.tables:
            raise ValueError("no table files")
        first = self.tables[0]
        for t in self.tables:
            if (t.width, t.dtype) != (first.width, first.dtype):
                raise ValueError(f"table file {str(t.path)!r} has rows of {t.width} x {t.dtype}; "
                                 f"{str(first.path)!r} has {first.width} x {first.dtype}")
        self.width, self.dtype, self.row_bytes = first.width, first.dtype, first.row_bytes
        self.policy = policy
        self.table_starts = np.cumsum([0] + [t.rows for t in self.tables]).astype(np.int64)
        self.total_rows = int(self.table_starts[-1])
        self.table_bytes = self.total_rows * self.row_bytes

        index_bytes = _INDEX_BYTES * self.total_rows
        slot_bytes = self.row_bytes + _SLOT_OVERHEAD
        min_staging = max(1, int(min_staging_rows))
        minimum = index_bytes + min_staging * self.row_bytes + ways * slot_bytes
        if budget < minimum:
            raise TableMemoryError(
                f"table memory {_fmt(budget)} is below this model's minimum of {_fmt(minimum)}: "
                f"a row index of {_fmt(index_bytes)} ({_INDEX_BYTES} B x {self.total_rows} rows), one item's "
                f"{min_staging} ids staged ({_fmt(min_staging * self.row_bytes)}) and {ways} cache slots")
        slots, staging, sketch = split_budget(budget, self.total_rows, self.row_bytes, policy=policy,
                                              min_staging_rows=min_staging, staging_share=staging_share, ways=ways)
        slots = min(max(ways, slots), self.total_rows)  # never more slots than rows
        self.slots, self.staging_rows = int(slots), int(staging)
        self.budget = budget

        self.index = np.full(self.total_rows, -1, np.int32)
        self.owner = np.full(self.slots, -1, np.int64)
        self.ref = np.zeros(self.slots, np.uint8)
        self.pin = np.zeros(self.slots, np.int32)
        self.data = np.empty((self.slots + self.staging_rows, self.width), self.dtype)
        self.sketch = np.zeros(sketch, np.uint8) if sketch else None
        self._sketch_updates = 0
        self.free = self.slots
        self.hand = 0
        self.tick = 0
        self.stats = CacheStats()
        self._logged = (0, 0, 0)  # batches, hits, misses when the hit rate was last logged
        self._split: _Split | None = None
        """A batch being looked up in runs (``begin_split``): its rows' last uses and the slots it admitted."""
        self.overlay: RowOverlay | None = None
        """Rows replaced by table deltas (``sixfold.backends.host.row_updates``): read from the overlay, not the files."""
        self.lock = threading.Lock()
        """Held from ``lookup`` until the kernel has read ``data`` (another batch may evict)."""
        self._pool = ThreadPoolExecutor(max(1, io_threads), thread_name_prefix="table-io") if io_threads > 1 else None
        self.io_threads = max(1, io_threads)
        self._fds: list[int] = []
        self.direct = False
        for t in self.tables:
            fd = -1
            if direct and hasattr(os, "O_DIRECT"):
                try:
                    fd = os.open(t.path, os.O_RDONLY | os.O_DIRECT)
                    self.direct = True
                except OSError:
                    fd = -1
            if fd < 0:
                fd = os.open(t.path, os.O_RDONLY)
            self._fds.append(fd)
        if self.direct and not all(_is_direct(fd) for fd in self._fds):
            self.direct = False
        self._identity = [_identity(os.fstat(fd)) for fd in self._fds]
        """Each file as opened: (device, inode, size, mtime ns); a batch's reads compare the path's to it."""
        self.changed: str | None = None
        """Set by the first batch that found a file changed (what changed): every lookup fails until reloaded."""
        log.info("tiered rows: %d tables, %s on disk, budget %s: %d cache slots (%.1f%% of rows), %d staging "
                 "rows, policy %s, %s reads, %s", len(self.tables), _fmt(self.table_bytes), _fmt(budget),
                 self.slots, 100 * self.slots / self.total_rows, self.staging_rows, policy,
                 "O_DIRECT" if self.direct else "buffered", "C helper" if pread.native_available() else "Python")

    # ---- introspection -------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes this store holds in DRAM (index, slots, staging, sketch): at most the budget."""
        return int(self.index.nbytes + self.owner.nbytes + self.ref.nbytes + self.pin.nbytes + self.data.nbytes
                   + (self.sketch.nbytes if self.sketch is not None else 0))

    @property
    def cached_rows(self) -> int:
        return self.slots - self.free

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        if self._pool is not None:
            self._pool.shutdown(wait=False)

    # ---- warming ------------------------------------------------------------------------------

    def warm(self, rows: np.ndarray, *, chunk_rows: int = 1 << 18, span: int = 1 << 20) -> int:
        """Load ``rows`` (global rows, most wanted first) into the cache with sequential reads; returns rows loaded.

        For a start (or a restart) from recorded traffic: the rows are read in file order in
        ``span``-byte spans (one read serves every wanted row inside it), not one read per row.
        Rows already cached are skipped; slots are taken by CLOCK as for misses.
        """
        rows = np.asarray(rows, dtype=np.int64)
        _, first = np.unique(rows, return_index=True)
        rows = rows[np.sort(first)]
        loaded = 0
        with self.lock:
            rows = rows[self.index[rows] < 0][:self.slots]
            for lo in range(0, rows.shape[0], chunk_rows):
                self.tick += 1
                part = np.sort(rows[lo:lo + chunk_rows])
                victims = self._victims(int(part.shape[0]), self.tick)
                part = part[:victims.shape[0]]
                if part.shape[0] == 0:
                    break
                buf = np.empty((part.shape[0], self.width), self.dtype)
                bounds = np.searchsorted(part, self.table_starts)
                read = []
                for t, table in enumerate(self.tables):
                    a, b = int(bounds[t]), int(bounds[t + 1])
                    if a < b:
                        offsets = table.offset + (part[a:b] - self.table_starts[t]) * self.row_bytes
                        pread.gather(self._fds[t], offsets, self.row_bytes, buf[a:b], span)
                        read.append(t)
                self._check_unchanged(read)
                overlay = self.overlay
                if overlay is not None and overlay.rows.shape[0]:  # rows a table delta replaced: not the files'
                    mine = overlay.holds(part)
                    if mine.any():
                        overlay.gather(part[mine], buf, np.flatnonzero(mine))
                old = self.owner[victims]
                self.index[old[old >= 0]] = -1
                self.free -= int(victims.shape[0] - np.count_nonzero(old >= 0))
                self.data[victims] = buf
                self.index[part] = victims.astype(np.int32)
                self.owner[victims] = part
                self.ref[victims] = 1
                loaded += int(part.shape[0])
            if not self.direct:
                for fd in self._fds:
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    except OSError:
                        pass
        return loaded

    # ---- one batch -----------------------------------------------------------------------------

    def begin_split(self, rows: np.ndarray) -> None:
        """``rows`` (a whole batch) will be looked up in runs (``lookup(part, start=...)``); hold ``lock`` until ``end_split``.

        Each distinct row the batch misses is then read once: a run's missed row that a later
        run reads again is admitted (the policy is not asked) and, like every slot the batch
        hits or fills, pinned until ``end_split``. Counters count ids as one unsplit batch
        would: an id whose row an earlier run of the batch read is a miss, not a hit.
        """
        rows = np.asarray(rows, dtype=np.int64)
        n = rows.shape[0]
        self.tick += 1
        # Each id's row's last position in the batch, in O(ids) with the index as scratch (as lookup dedupes).
        last = np.zeros(n, np.int64)
        if n:
            saved = self.index[rows]
            positions = np.arange(n, dtype=np.int64)
            self.index[rows] = -2 - positions.astype(np.int32)
            rep = (-2 - self.index[rows]).astype(np.int64)  # one position per row, the same for all its ids
            self.index[rows] = saved
            np.maximum.at(last, rep, positions)
            last = last[rep]
        self._split = _Split(tick=self.tick, last=last, admitted=[])

    def end_split(self) -> None:
        """The batch ``begin_split`` started is done (one batch in the counters): its slots are no longer pinned."""
        self._split = None
        self.stats.batches += 1
        if self.stats.batches - self._logged[0] >= LOG_EVERY_BATCHES:
            self._log_hit_rate()

    def lookup(self, rows: np.ndarray, *, start: int = 0) -> np.ndarray:
        """Row positions in ``data`` for ``rows`` (global rows of this weight). Hold ``lock`` until done with data.

        ``start``: between ``begin_split`` and ``end_split``, where ``rows`` begin in that batch.
        Raises TooManyMisses (nothing changed) when the distinct misses exceed the staging rows,
        TableReadError when a read fails (the cache stays consistent; the batch fails).
        """
        if self.changed is not None:
            raise TableChanged(errno.ESTALE, self.changed)
        rows = np.asarray(rows, dtype=np.int64)
        n = rows.shape[0]
        split = self._split
        if split is None:
            self.tick += 1
        tick = self.tick if split is None else split.tick
        slots = self.index[rows]
        miss = slots < 0
        m_rows = rows[miss]
        nm = int(m_rows.shape[0])
        out = slots.astype(np.int64)
        again = 0  # hits on rows an earlier run of this split batch read: misses, as in the batch unsplit
        if split is not None and split.admitted and nm < n:
            again = int(np.isin(slots[~miss], np.concatenate(split.admitted)).sum())
        if nm == 0:
            self.ref[slots] = 1
            if split is not None:
                self.pin[slots] = tick
            else:
                self.stats.batches += 1
            self.stats.hits += n - again
            self.stats.misses += again
            return out
        # Distinct misses in O(ids): each id writes its position into the index, the survivor
        # of each row is its representative. NOTE: the index holds -1 for every missing row and
        # is restored below before anything can raise.
        positions = np.arange(nm, dtype=np.int32)
        self.index[m_rows] = -2 - positions
        rep_of = -2 - self.index[m_rows]
        is_rep = rep_of == positions
        uniq = m_rows[is_rep]
        self.index[uniq] = -1
        u = int(uniq.shape[0])
        if u > self.staging_rows:
            raise TooManyMisses(u, self.staging_rows)
        # Read in file order (each table's rows ascending): sort the distinct misses.
        order = np.argsort(uniq, kind="stable")
        uniq = uniq[order]
        where = np.empty(u, np.int64)
        where[order] = np.arange(u)
        miss_pos = where[(np.cumsum(is_rep) - 1)[rep_of]]
        keep = None
        if split is not None:  # which distinct misses a later run of the batch reads again
            end = start + n
            first_pos = np.flatnonzero(miss)[is_rep]  # one id of each distinct miss, in uniq's former order
            keep = np.empty(u, bool)
            keep[where] = split.last[start + first_pos] >= end
        hit_slots = slots[~miss]
        self.ref[hit_slots] = 1
        self.pin[hit_slots] = tick
        staging = self.data[self.slots:self.slots + u]
        self._read(uniq, staging)
        self.stats.hits += n - nm - again
        self.stats.misses += nm + again
        self.stats.rows_read += u
        out[miss] = self.slots + miss_pos
        admitted = self._admit(uniq, staging, tick, keep)
        if split is not None:
            split.admitted.append(admitted)
            return out
        self.stats.batches += 1
        if self.stats.batches - self._logged[0] >= LOG_EVERY_BATCHES:
            self._log_hit_rate()
        return out

    def reset_stats(self) -> None:
        """Start the counters afresh (the rows cached stay): lookups before it were not traffic, e.g. a warm-up."""
        with self.lock:
            self.stats = CacheStats()
            self._logged = (0, 0, 0)

    def _log_hit_rate(self) -> None:
        batches, hits, misses = self._logged
        s = self.stats
        window = (s.hits - hits) / max(1, s.hits - hits + s.misses - misses)
        log.info("table cache (%s...): hit rate %.1f%% over the last %d batches, %.1f%% since start; %d of %d "
                 "slots used, %d rows read in %.2f s", self.tables[0].path.parent, 100 * window, s.batches - batches,
                 100 * s.hit_rate, self.cached_rows, self.slots, s.rows_read, s.read_seconds)
        self._logged = (s.batches, s.hits, s.misses)

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows ``rows`` (ascending, distinct) as served now: the overlay's or the files' (not the cache's: equal)."""
        out = np.empty((rows.shape[0], self.width), self.dtype)
        self._read(np.asarray(rows, np.int64), out)
        return out

    def replace_rows(self, rows: np.ndarray, values: np.ndarray, overlay: RowOverlay) -> None:
        """Serve ``values`` for ``rows`` from now on (``overlay`` holds them); hold ``lock``, between batches."""
        self.overlay = overlay
        slots = self.index[rows]
        cached = slots >= 0
        self.data[slots[cached]] = values[cached]

    def _read(self, uniq: np.ndarray, out: np.ndarray) -> None:
        overlay = self.overlay
        if overlay is not None and overlay.rows.shape[0]:
            mine = overlay.holds(uniq)
            if mine.any():
                overlay.gather(uniq[mine], out, np.flatnonzero(mine))
                rest = np.flatnonzero(~mine)
                if rest.shape[0]:
                    scratch = np.empty((rest.shape[0], self.width), self.dtype)
                    self._read_files(uniq[rest], scratch)
                    out[rest] = scratch
                return
        self._read_files(uniq, out)

    def _read_files(self, uniq: np.ndarray, out: np.ndarray) -> None:
        start = time.perf_counter()
        bounds = np.searchsorted(uniq, self.table_starts)
        jobs = []
        per_job = max(256, -(-uniq.shape[0] // self.io_threads))
        for t, table in enumerate(self.tables):
            lo, hi = int(bounds[t]), int(bounds[t + 1])
            for a in range(lo, hi, per_job):
                b = min(hi, a + per_job)
                offsets = table.offset + (uniq[a:b] - self.table_starts[t]) * self.row_bytes
                jobs.append((t, offsets, a, b))
        block = _BLOCK if self.direct else 0

        def run(job: tuple[int, np.ndarray, int, int]) -> None:
            t, offsets, a, b = job
            try:
                pread.gather(self._fds[t], offsets, self.row_bytes, out[a:b], block)
            except OSError as exc:
                path = self.tables[t].path
                raise TableReadError(exc.errno or 5, f"reading {b - a} rows of table file {str(path)!r}: "
                                     f"{exc.strerror or exc}") from exc

        if self.changed is not None:
            raise TableChanged(errno.ESTALE, self.changed)
        if self._pool is None or len(jobs) == 1:
            for job in jobs:
                run(job)
        else:
            errors = [f.exception() for f in [self._pool.submit(run, job) for job in jobs]]
            failed = [e for e in errors if e is not None]
            if failed:
                raise failed[0]
        self._check_unchanged(sorted({job[0] for job in jobs}))
        if not self.direct:
            for fd in self._fds:  # NOTE: keep the page cache out of it: the budget is the memory
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
        elapsed = time.perf_counter() - start
        self.stats.read_seconds += elapsed
        self.stats.read_buckets[bisect.bisect_left(READ_BUCKETS, elapsed)] += 1

    def _check_unchanged(self, tables: list[int]) -> None:
        """TableChanged (kept: every later lookup fails too) when one of ``tables``' files is not the one opened."""
        for t in tables:
            path = self.tables[t].path
            try:
                now = _identity(os.stat(path))
            except OSError as exc:
                now = (exc.strerror or str(exc),)
            was = self._identity[t]
            if now == was:
                continue
            what = ("is gone: " + now[0] if len(now) == 1 else
                    ", ".join(f"{name} {a} -> {b}" for name, a, b in zip(("device", "inode", "bytes", "mtime_ns"),
                                                                         was, now) if a != b))
            self.changed = (f"table file {str(path)!r} changed under the server since it was opened ({what}); "
                            f"load the model again to serve its new rows")
            log.error("%s", self.changed)
            raise TableChanged(errno.ESTALE, self.changed)

    def _admit(self, uniq: np.ndarray, staged: np.ndarray, tick: int, keep: np.ndarray | None = None) -> np.ndarray:
        """Put some of this batch's misses into cache slots (policy), evicting by CLOCK; returns the slots filled.

        ``keep``: misses to admit first whatever the policy says (a later run of a split batch reads them).
        """
        candidates = np.arange(uniq.shape[0])
        if self.policy == "tinylfu" and self.sketch is not None:
            mask = self.sketch.shape[0] - 1
            h = ((uniq[None, :] * _SKETCH_MULTIPLIERS) >> 7) & mask  # (hashes, rows)
            held = self.sketch[h].astype(np.int32)
            counts = held.min(axis=0) + 1
            np.minimum(counts, 255, out=counts)
            self.sketch[h] = np.maximum(held, counts)  # conservative update: only the counters at the minimum rise
            self._sketch_updates += uniq.shape[0]
            if self._sketch_updates > 8 * self.sketch.shape[0]:
                self.sketch >>= 1  # age: old popularity fades
                self._sketch_updates = 0
            if self.free < uniq.shape[0]:
                seen = candidates[counts >= ADMIT_MISSES]
                fresh = candidates[counts < ADMIT_MISSES][:self.free]
                candidates = np.concatenate([seen, fresh])
        if keep is not None and keep.any():  # kept first (a later run reads them), then the policy's choice
            candidates = np.concatenate([np.flatnonzero(keep), candidates[~keep[candidates]]])
        if candidates.shape[0] == 0:
            return np.empty(0, np.int64)
        victims = self._victims(int(candidates.shape[0]), tick)
        if victims.shape[0] == 0:
            return victims
        chosen = candidates[:victims.shape[0]]
        old = self.owner[victims]
        evicted = old[old >= 0]
        self.index[evicted] = -1
        self.free -= int(victims.shape[0] - evicted.shape[0])
        rows = uniq[chosen]
        self.data[victims] = staged[chosen]
        self.index[rows] = victims.astype(np.int32)
        self.owner[victims] = rows
        self.ref[victims] = 0
        self.pin[victims] = tick
        return victims

    def _victims(self, need: int, tick: int) -> np.ndarray:
        """Up to ``need`` slots by CLOCK: skip (and clear) referenced slots, never a pinned one."""
        found: list[np.ndarray] = []
        got = scanned = 0
        limit = 2 * self.slots
        while got < need and scanned < limit:
            lo = self.hand
            hi = min(self.slots, lo + max(4 * (need - got), 4096))
            free = (self.ref[lo:hi] == 0) & (self.pin[lo:hi] != tick)
            cand = np.flatnonzero(free)[:need - got]
            end = int(cand[-1]) + 1 if got + cand.shape[0] == need and cand.shape[0] else hi - lo
            self.ref[lo:lo + end] = 0
            self.pin[cand + lo] = tick  # NOTE: taken; a second revolution of the hand must not take it again
            found.append(cand + lo)
            got += int(cand.shape[0])
            scanned += end
            self.hand = (lo + end) % self.slots
        return np.concatenate(found) if found else np.empty(0, np.int64)


@dataclass
class _Split:
    """A batch looked up in runs (``TieredRows.begin_split``)."""

    tick: int
    """The batch's one tick: every slot it hits or fills stays pinned until it ends."""
    last: np.ndarray
    """Per id of the batch, the last position in the batch of its row."""
    admitted: list[np.ndarray]
    """Slots each run filled (their rows were read by this batch)."""


class RowOverlay:
    """Rows that replace some of a store's rows on disk: sorted global rows -> (source array, row in it).

    Immutable: ``merged`` returns a new overlay (newer rows win), so a swap is one assignment.
    Sources are arrays backed by files beside the version (memory maps of the rows as stored).
    """

    def __init__(self, rows: np.ndarray, source: np.ndarray, position: np.ndarray, sources: list[np.ndarray]) -> None:
        self.rows, self.source, self.position, self.sources = rows, source, position, sources

    @classmethod
    def empty(cls) -> "RowOverlay":
        return cls(np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int64), [])

    def merged(self, rows: np.ndarray, values: np.ndarray) -> "RowOverlay":
        """This overlay with ``rows`` (global) now read from ``values`` (row i of it for rows[i])."""
        rows = np.asarray(rows, np.int64)
        all_rows = np.concatenate([self.rows, rows])
        source = np.concatenate([self.source, np.full(rows.shape[0], len(self.sources), np.int32)])
        position = np.concatenate([self.position, np.arange(rows.shape[0], dtype=np.int64)])
        age = np.concatenate([np.zeros(self.rows.shape[0], np.int8), np.ones(rows.shape[0], np.int8)])
        order = np.lexsort((age, all_rows))  # by row, the newer last
        all_rows, source, position = all_rows[order], source[order], position[order]
        keep = np.ones(all_rows.shape[0], bool)
        keep[:-1] = all_rows[1:] != all_rows[:-1]
        return RowOverlay(all_rows[keep], source[keep], position[keep], [*self.sources, values])

    def holds(self, rows: np.ndarray) -> np.ndarray:
        """Which of ``rows`` the overlay replaces (a bool mask)."""
        at = np.minimum(np.searchsorted(self.rows, rows), self.rows.shape[0] - 1)
        return self.rows[at] == rows

    def gather(self, rows: np.ndarray, out: np.ndarray, where: np.ndarray) -> None:
        """``out[where[i]]`` = the overlay's row ``rows[i]`` (every row held)."""
        at = np.searchsorted(self.rows, rows)
        src, pos = self.source[at], self.position[at]
        for s in np.unique(src).tolist():
            mine = src == s
            out[where[mine]] = self.sources[s][pos[mine]]


def _identity(st: os.stat_result) -> tuple:
    """What says a table file is the one opened: device, inode, size and modification time."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _is_direct(fd: int) -> bool:
    try:
        import fcntl
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
    except (OSError, AttributeError):
        return False


def _fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
