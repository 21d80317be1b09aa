"""Pricing the table tiers: what a DRAM row cache in front of disk costs the host stage.

Three inputs, one formula per batch::

    hit rate   h = expected share of ids whose row is cached, for a cache of S rows
                   holding the most popular rows (power-law ids, exponent alpha)
    reads      D = expected distinct rows among one batch's missed ids
    time       host_s(resident) + D / disk.iops + disk.read_latency_s (one round of reads)

The popularity model is the one ``models.RequestGenerator`` (and so the loadgen) draws
ids from: a bounded continuous power law, P(rank <= k) = (k^(1-a) - 1) / (R^(1-a) - 1)
per table of R rows. The cache's S rows are spread over the tables where they catch the
most ids (water-filling on each table's density, weighted by its pooling), which is
what a frequency-admitting cache converges to; the hit rate is therefore an upper bound
for a warm cache (cold starts and CLOCK's approximations lose some).

``DiskSpec`` holds the disk's measured random 4 KiB read latency (one at a time) and
IOPS (at a queue depth of ``depth`` threads): ``measure_disk(directory)`` measures them
with O_DIRECT reads of a scratch file (deleted after). ``sixfold-partition tiers
calibrate --dir /data --out disk.json`` writes one; ``sixfold-partition tiers
PLAN.json --disk-spec disk.json --zipf 1.05`` prints the tier table for a plan.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

__all__ = ["DiskSpec", "TierEstimate", "TierPricing", "measure_disk", "zipf_hit_rate", "distinct_misses",
           "price_tiers", "price_plan_tiers", "print_tier_table", "print_pricing", "print_plan_tiers", "GENERIC_SSD"]

_BLOCK = 4096


@dataclass(frozen=True)
class DiskSpec:
    """A disk as the tier model sees it: random 4 KiB reads."""

    name: str
    read_latency_s: float
    """One random 4 KiB read, queue depth 1."""
    iops: float
    """Random 4 KiB reads per second at ``depth`` concurrent readers."""
    depth: int = 16

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> "DiskSpec":
        return cls(**json.loads(Path(path).read_text()))


GENERIC_SSD = DiskSpec("generic-nvme", read_latency_s=80e-6, iops=400_000, depth=32)
"""A datacenter NVMe SSD's 4 KiB random read figures (order of magnitude), when none was measured."""


def measure_disk(directory: str | Path, *, size: int = 512 << 20, seconds: float = 4.0, depth: int = 32,
                 name: str = "disk-calibrated") -> DiskSpec:
    """Time random O_DIRECT 4 KiB reads of a scratch file in ``directory`` (written, then deleted)."""
    from sixfold.backends.host import pread

    fd_w, path = tempfile.mkstemp(prefix=".sixfold-disk-", dir=directory)
    try:
        chunk = os.urandom(8 << 20)
        with os.fdopen(fd_w, "wb") as f:
            for _ in range(size // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags)
            block = _BLOCK
        except OSError:
            fd, block = os.open(path, os.O_RDONLY), 0
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            rng = np.random.default_rng(0)
            blocks = size // _BLOCK

            def reads(n: int) -> np.ndarray:
                return rng.integers(0, blocks, n) * _BLOCK

            out = np.empty((4096, 64), np.uint8)
            # depth 1: latency
            n, spent = 0, 0.0
            while spent < seconds / 2 and n < 200_000:
                offs = reads(256)
                t = time.perf_counter()
                pread.gather(fd, offs, 64, out[:256], block)
                spent += time.perf_counter() - t
                n += 256
            latency = spent / n
            # depth N: throughput
            pool = ThreadPoolExecutor(depth)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds / 2:
                offs = [reads(256) for _ in range(depth)]
                bufs = [np.empty((256, 64), np.uint8) for _ in range(depth)]
                list(pool.map(lambda k: pread.gather(fd, offs[k], 64, bufs[k], block), range(depth)))
                n += 256 * depth
            iops = n / (time.perf_counter() - t0)
            pool.shutdown()
        finally:
            os.close(fd)
    finally:
        os.unlink(path)
    return DiskSpec(name, read_latency_s=latency, iops=iops, depth=depth)


def _cdf(k: np.ndarray | float, rows: int, alpha: float) -> np.ndarray | float:
    """P(rank <= k) for the bounded power law over ``rows`` ranks."""
    if abs(alpha - 1.0) < 1e-9:
        return np.log(np.maximum(k, 1)) / math.log(rows)
    return (np.power(np.maximum(k, 1), 1 - alpha) - 1) / (rows ** (1 - alpha) - 1)


def _cached_rows(table_rows: Sequence[int], pooling: Sequence[float], alpha: float, slots: int) -> list[float]:
    """Rows of each table to cache so that ``slots`` rows catch the most ids (water-filling on density)."""
    total = float(sum(table_rows))
    if slots >= total:
        return [float(r) for r in table_rows]
    weights = np.asarray(pooling, float) / float(sum(pooling))
    rows = np.asarray(table_rows, float)
    a = max(alpha, 1.0 + 1e-6)
    norm = (a - 1) / (1 - rows ** (1 - a))  # density at rank k: w * norm * k^-a

    def take(lam: float) -> np.ndarray:
        return np.clip((weights * norm / lam) ** (1 / a), 0, rows)

    lo, hi = 1e-30, 1e3
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if take(mid).sum() > slots:
            lo = mid
        else:
            hi = mid
    return take(hi).tolist()


def zipf_hit_rate(table_rows: Sequence[int], pooling: Sequence[float], alpha: float, slots: int) -> float:
    """Expected share of ids answered by a cache of the ``slots`` most popular rows (per-id weighting)."""
    cached = _cached_rows(table_rows, pooling, alpha, slots)
    weights = np.asarray(pooling, float) / float(sum(pooling))
    return float(sum(w * _cdf(k, r, alpha) for w, k, r in zip(weights, cached, table_rows)))


def distinct_misses(table_rows: Sequence[int], pooling: Sequence[float], alpha: float, slots: int,
                    items: int) -> float:
    """Expected distinct uncached rows read by one batch of ``items`` items."""
    cached = _cached_rows(table_rows, pooling, alpha, slots)
    total = 0.0
    for k, r, pool in zip(cached, table_rows, pooling):
        if k >= r:
            continue
        draws = items * pool
        edges = np.unique(np.geomspace(max(k, 1.0), r, 400))
        p = np.diff(_cdf(edges, r, alpha))  # probability of the ranks in each bin
        n = np.diff(edges)  # ranks per bin
        per_rank = p / np.maximum(n, 1e-12)
        total += float(np.sum(n * (1 - np.exp(-draws * per_rank))))
    return total


@dataclass(frozen=True)
class TierEstimate:
    budget_bytes: int
    cache_rows: int
    hit_rate: float
    reads_per_batch: float
    read_seconds: float
    host_seconds: float
    """Host stage per batch: the all-resident estimate plus the reads."""


@dataclass(frozen=True)
class TierPricing:
    """A plan's table tiers priced at some budgets: what ``plan.json`` carries (``PartitionPlan.tiers``).

    Written by ``sixfold-partition ... --table-memory B`` and printed with the plan
    (``sixfold-partition show``, ``sixfold-serve``); ``sixfold-partition --measure`` measures
    each budget on this host against it (``sixfold.partitioner.pricing.measure``).
    """

    budgets: list[str]
    """The budgets as given (``10%``, ``1GiB``), one per estimate."""
    alpha: float
    """Power-law exponent of the ids the hit rates assume."""
    items: int
    """Items per batch the reads and times are for."""
    table_bytes: int
    row_bytes: int
    resident_seconds: float
    """The plan's host stage per batch with every row resident (the tier time adds the reads to it)."""
    disk: DiskSpec
    estimates: list[TierEstimate]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TierPricing":
        return cls(budgets=[str(b) for b in data["budgets"]], alpha=float(data["alpha"]), items=int(data["items"]),
                   table_bytes=int(data["table_bytes"]), row_bytes=int(data["row_bytes"]),
                   resident_seconds=float(data["resident_seconds"]), disk=DiskSpec(**data["disk"]),
                   estimates=[TierEstimate(**e) for e in data["estimates"]])


def _cache_slots(budget: int, rows_total: int, row_bytes: int, min_staging_rows: int) -> int:
    """Cache slots ``TieredRows`` makes of ``budget`` (tinylfu): less the row index, the staging rows, the sketch."""
    from sixfold.backends.host.table_store import split_budget

    slots, _, _ = split_budget(budget, rows_total, row_bytes, min_staging_rows=min_staging_rows)
    return min(rows_total, max(0, slots))


def price_tiers(table_rows: Sequence[int], pooling: Sequence[float], row_bytes: int, alpha: float,
                budgets: Sequence[int], items: int, disk: DiskSpec, resident_seconds: float, *,
                min_staging_rows: int = 1) -> list[TierEstimate]:
    """One estimate per budget (bytes; the row index, staging and sketch taken out first, as the store does).

    ``min_staging_rows``: the ids one item reads (the store stages at least that many rows).
    """
    rows_total = int(sum(table_rows))
    out = []
    for budget in budgets:
        slots = _cache_slots(int(budget), rows_total, row_bytes, min_staging_rows)
        hit = zipf_hit_rate(table_rows, pooling, alpha, slots)
        reads = distinct_misses(table_rows, pooling, alpha, slots, items)
        read_s = reads / disk.iops + (disk.read_latency_s if reads > 0 else 0.0)
        out.append(TierEstimate(int(budget), slots, hit, reads, read_s, resident_seconds + read_s))
    return out


def _budget_text(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:,.1f} GiB"
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def print_tier_table(estimates: Sequence[TierEstimate], table_bytes: int, disk: DiskSpec, items: int,
                     alpha: float, console=None, *, title: str = "table tiers") -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"{title}: {_budget_text(table_bytes)} of rows, Zipf {alpha}, {items} items per batch, "
                        f"disk {disk.name} ({disk.iops:,.0f} IOPS, {disk.read_latency_s * 1e6:.0f} us)")
    for col in ("table memory", "share", "rows cached", "hit rate", "disk reads/batch", "read ms", "host ms/batch",
                "items/s"):
        table.add_column(col, justify="right")
    for e in estimates:
        table.add_row(_budget_text(e.budget_bytes), f"{100 * e.budget_bytes / table_bytes:.0f}%",
                      f"{e.cache_rows:,}", f"{100 * e.hit_rate:.1f}%", f"{e.reads_per_batch:,.0f}",
                      f"{e.read_seconds * 1e3:.1f}", f"{e.host_seconds * 1e3:.1f}",
                      f"{items / e.host_seconds:,.0f}")
    console.print(table)


def price_plan_tiers(plan, budgets: Sequence[str], *, disk_spec: str | None = None, zipf: float | None = None,
                     items: int | None = None) -> TierPricing:
    """Price ``plan``'s table tiers at ``budgets`` (``4GiB``, ``10%``): what ``PartitionPlan.tiers`` holds.

    ValueError for a plan without table rows (its lookups are not table-batched) or a bad budget.
    """
    from sixfold.backends.host.host_embedding import bytes_per_row
    from sixfold.backends.host.table_store import parse_table_memory

    tables = plan.tables
    if not tables.get("rows"):
        raise ValueError(f"plan of {plan.model} has no table rows (its lookups are not table-batched): no tiers "
                         "to price")
    rows, pooling = tables["rows"], tables.get("pooling") or [1] * len(tables["rows"])
    row_bytes = bytes_per_row(tables.get("precision", "fp32"), tables["dim"])
    table_bytes = sum(rows) * row_bytes
    disk = DiskSpec.load(disk_spec) if disk_spec else GENERIC_SSD
    alpha = zipf or float(tables.get("zipf") or 1.05)
    items = items or plan.estimates.batch_rows
    sizes = []
    for text in budgets:
        value = parse_table_memory(text)
        if value is None:
            raise ValueError(f"table memory {text!r}: give a size such as 4GiB or a share such as 10%")
        sizes.append(int(value * table_bytes) if isinstance(value, float) else int(value))
    host = [d for d in plan.estimates.per_device if d.device == "host"]
    resident = host[0].batch_seconds * items / plan.estimates.batch_rows if host else 0.0
    estimates = price_tiers(rows, pooling, row_bytes, alpha, sizes, items, disk, resident,
                            min_staging_rows=int(sum(pooling)))
    return TierPricing(budgets=[str(b) for b in budgets], alpha=float(alpha), items=int(items),
                       table_bytes=int(table_bytes), row_bytes=int(row_bytes), resident_seconds=float(resident),
                       disk=disk, estimates=estimates)


def print_pricing(pricing: TierPricing, console=None, *, title: str = "table tiers") -> None:
    """The tier table of a stored pricing (``PartitionPlan.tiers``)."""
    print_tier_table(pricing.estimates, pricing.table_bytes, pricing.disk, pricing.items, pricing.alpha, console,
                     title=title)


def print_plan_tiers(plan, budgets: Sequence[str], *, disk_spec: str | None = None, zipf: float | None = None,
                     items: int | None = None, console=None) -> list[TierEstimate]:
    """Price ``plan``'s table tiers at ``budgets`` (``4GiB``, ``10%``) and print the tier table."""
    pricing = price_plan_tiers(plan, budgets, disk_spec=disk_spec, zipf=zipf, items=items)
    print_pricing(pricing, console)
    return pricing.estimates
