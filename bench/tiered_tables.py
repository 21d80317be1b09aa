"""Tiered tables benchmark: the host stage with tables on disk behind a DRAM row cache.

rm2 at full size (32 tables x 500k rows x dim 64 fp32, 3.8 GiB), written to disk in
chunks (sixfold.partitioner.tables.build), looked up with Zipf-skewed ids (models.RequestGenerator,
the loadgen's id distribution, alpha 1.05 and 1.2). Variants, one after another in one run
over the same batches:

  resident      every row in DRAM: the fused weight memory-mapped and read through once
                before timing (all pages resident in the page cache), the default server path
  mmap B        the same memory map limited to B bytes of page cache: madvise(MADV_RANDOM) (no
                readahead), and after every batch, when mincore() counts more than B bytes of
                the file resident, madvise(MADV_DONTNEED) + posix_fadvise(POSIX_FADV_DONTNEED)
                drop all of them (no cgroup here; the flush counts in the timings)
  tiered B      HostEmbeddingStage(table_memory=B): O_DIRECT reads of one batch's misses by
                --io-threads threads, a row cache (policy tinylfu; clock too at 10%)

B is 5/10/25/100% of the table bytes. Each variant runs --warmup untimed batches, then
--runs runs of --batches batches; a run gives items/s (items / host-stage seconds) and the
p99 of per-batch host-stage time; the table shows the median over runs, the cache hit rate
(ids), and ratios to resident and to mmap at the same memory (medians of per-run ratios,
where both ran). Everything written to disk is deleted at the end (--keep keeps it).

    .venv/bin/python bench/tiered_tables.py                    # writes its BENCHMARKS.md section
    .venv/bin/python bench/tiered_tables.py --quick --no-write
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sixfold.backends.host.host_embedding import HostEmbeddingStage  # noqa: E402
from bench.harness.report import machine_line, publish  # noqa: E402
from sixfold.models import get_config  # noqa: E402
from sixfold.models.requests import RequestGenerator  # noqa: E402
from sixfold.partitioner.tables import build as table_build  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)


class PageBudget:
    """Keep a memory map's resident pages under ``budget`` bytes by dropping them all when over."""

    def __init__(self, array: np.memmap, budget: int) -> None:
        self.map: mmap.mmap = array._mmap  # type: ignore[attr-defined]
        self.map.madvise(mmap.MADV_RANDOM)
        self.addr = array.ctypes.data - array.offset % mmap.ALLOCATIONGRANULARITY  # the map's first byte
        self.length = len(self.map)
        self.vec = np.zeros(-(-self.length // mmap.PAGESIZE), np.uint8)
        self.path = array.filename
        self.budget = budget
        self.flushes = 0
        self.drop()

    def resident(self) -> int:
        rc = _libc.mincore(ctypes.c_void_p(self.addr), ctypes.c_size_t(self.length),
                           self.vec.ctypes.data_as(ctypes.c_void_p))
        if rc:
            raise OSError(ctypes.get_errno(), "mincore")
        return int(np.count_nonzero(self.vec & 1)) * mmap.PAGESIZE

    def drop(self) -> None:
        self.map.madvise(mmap.MADV_DONTNEED)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    def enforce(self) -> None:
        if self.resident() > self.budget:
            self.drop()
            self.flushes += 1


def build(directory: Path, rows: list[int], dim: int) -> None:
    tables = directory / "tables"
    if tables.exists() and len(list(tables.glob("table_*.npy"))) == len(rows):
        return
    advance, stop = table_build._progress(sum(rows) * dim * 4, f"writing {len(rows)} tables", True)
    try:
        for t, r in enumerate(rows):
            table_build.write_table(tables / f"table_{t:03d}.npy", r, dim, table_build._uniform_chunks(r, dim, 0, t),
                                    advance=advance)
    finally:
        stop()


def time_batches(stage: HostEmbeddingStage, batches: list[tuple[np.ndarray, np.ndarray]],
                 between=None) -> tuple[float, float]:
    """(items/s, p99 seconds per batch) over ``batches``; ``between`` runs after each batch and counts."""
    times = []
    items = 0
    for lengths, ids in batches:
        t = time.perf_counter()
        stage.run_numpy(lengths, ids)
        if between is not None:
            between()
        times.append(time.perf_counter() - t)
        items += lengths.shape[0]
    return items / sum(times), float(np.percentile(times, 99))


def resident_share(array: np.memmap) -> float:
    """Share of a memory map's pages resident (mincore)."""
    start = array.ctypes.data - array.offset % mmap.ALLOCATIONGRANULARITY
    length = array.nbytes + array.offset % mmap.ALLOCATIONGRANULARITY
    vec = np.zeros(-(-length // mmap.PAGESIZE), np.uint8)
    if _libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec.ctypes.data_as(ctypes.c_void_p)):
        raise OSError(ctypes.get_errno(), "mincore")
    return float(np.count_nonzero(vec & 1)) / vec.shape[0]


def touch(array: np.ndarray) -> None:
    for lo in range(0, array.shape[0], 1 << 18):
        float(array[lo:lo + (1 << 18), 0].sum())  # one value per row: every page is read


def run_variant(make, batches, args, between=None, warmup: int | None = None, before_run=None) -> dict:
    stage, cleanup = make()
    warmup = args.warmup if warmup is None else warmup
    warm = batches[args.warmup - warmup:args.warmup]  # the same timed batches for every variant
    warm_trace = batches[:args.warmup]
    if stage.stores and args.warm_cache:
        t = time.perf_counter()
        stage.warm(np.concatenate([b[0] for b in warm_trace]), np.concatenate([b[1] for b in warm_trace]))
        print(f"  cache warmed from {len(warm_trace)} batches in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        warm = batches[args.warmup - args.after_warm:args.warmup]
    t0 = time.perf_counter()
    for lengths, ids in warm:
        stage.run_numpy(lengths, ids)
        if between is not None:
            between(stage)
    warm_s = time.perf_counter() - t0
    stores = stage.stores
    before = [(s.stats.hits, s.stats.misses) for s in stores]
    runs = []
    timed = batches[args.warmup:]
    residency = []
    for r in range(args.runs):
        if before_run is not None:
            residency.append(before_run(stage))
        part = timed[r * args.batches:(r + 1) * args.batches]
        runs.append(time_batches(stage, part, (lambda: between(stage)) if between is not None else None))
    hits = sum(s.stats.hits - b[0] for s, b in zip(stores, before))
    misses = sum(s.stats.misses - b[1] for s, b in zip(stores, before))
    memory = sum(s.nbytes for s in stores) if stores else None
    cleanup(stage)
    return {"runs": runs, "hit_rate": hits / (hits + misses) if hits + misses else None, "warm_s": warm_s,
            "memory": memory, "residency": residency}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="rm2")
    p.add_argument("--max-rows", type=int, default=None, help="cap tables (default: full size)")
    p.add_argument("--dir", default="/tmp/sixfold-tiered-bench", help="where the tables are written (deleted after)")
    p.add_argument("--items", type=int, default=16, help="items per batch (one query)")
    p.add_argument("--batches", type=int, default=10, help="timed batches per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=150, help="untimed batches first (fill the row cache)")
    p.add_argument("--mmap-warmup", type=int, default=10,
                   help="untimed batches first for resident and mmap (their page cache is flushed when over budget)")
    p.add_argument("--budgets", default="5,10,25,100", help="table memory, %% of the table bytes")
    p.add_argument("--zipf", default="1.05,1.2")
    p.add_argument("--io-threads", type=int, default=32)
    p.add_argument("--no-warm-cache", dest="warm_cache", action="store_false",
                   help="start the row cache cold (default: warm it from the warm-up batches' id counts)")
    p.add_argument("--after-warm", type=int, default=20, help="batches run untimed after warming the cache")
    p.add_argument("--no-mmap", action="store_true", help="skip the plain-mmap variants")
    p.add_argument("--quick", action="store_true", help="small tables, few batches (a smoke run)")
    p.add_argument("--keep", action="store_true", help="keep the tables on disk")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args()
    if args.quick:
        args.max_rows, args.batches, args.runs, args.warmup, args.mmap_warmup = args.max_rows or 50_000, 3, 2, 5, 2
        args.after_warm = 2
    config = get_config(args.model, max_rows=args.max_rows)
    rows, dim = list(config.table_rows), config.embedding_dim
    table_bytes = sum(rows) * dim * 4
    directory = Path(args.dir)
    item_ids = int(sum(config.pooling))
    budgets = [float(b) for b in args.budgets.split(",")]
    lines = []
    try:
        build(directory, rows, dim)
        tables = directory / "tables"
        for alpha in [float(z) for z in args.zipf.split(",")]:
            gen = RequestGenerator(tuple(rows), 1, tuple(config.pooling), zipf=alpha, seed=1)
            count = args.warmup + args.runs * args.batches
            batches = []
            for _ in range(count):
                lengths = gen.lengths(args.items)
                batches.append((lengths, gen.ids(lengths)))
            results: dict[str, dict] = {}

            def resident():
                stage = HostEmbeddingStage(tables)  # fused: a file in the cache folder, memory-mapped
                return stage, lambda s: PageBudget(s.groups[0].array, 0).drop()

            def all_pages(stage) -> float:  # every page resident before each run (and say how many were)
                touch(stage.groups[0].array)
                return resident_share(stage.groups[0].array)

            print(f"zipf {alpha}: resident", file=sys.stderr)
            results["resident"] = run_variant(resident, batches, args, warmup=args.mmap_warmup, before_run=all_pages)
            print(f"  resident pages before each run: {results['resident']['residency']}", file=sys.stderr)
            results["resident"]["memory"] = table_bytes
            for pct in budgets:
                budget = int(table_bytes * pct / 100)
                if not args.no_mmap and pct < 100:
                    print(f"zipf {alpha}: mmap {pct}%", file=sys.stderr)
                    guard: dict = {}

                    def mapped(budget=budget, guard=guard):
                        stage = HostEmbeddingStage(tables)
                        guard["g"] = PageBudget(stage.groups[0].array, budget)
                        return stage, lambda s: guard["g"].drop()

                    results[f"mmap {pct:g}%"] = run_variant(mapped, batches, args,
                                                            between=lambda s, guard=guard: guard["g"].enforce(),
                                                            warmup=args.mmap_warmup)
                    results[f"mmap {pct:g}%"]["memory"] = budget
                    results[f"mmap {pct:g}%"]["flushes"] = guard["g"].flushes
                policies = ["tinylfu", "clock"] if pct == 10 else ["tinylfu"]
                for policy in policies:
                    print(f"zipf {alpha}: tiered {pct}% {policy}", file=sys.stderr)

                    def tiered(budget=budget, policy=policy):
                        stage = HostEmbeddingStage(tables, table_memory=budget, cache_policy=policy,
                                                   item_ids=item_ids, io_threads=args.io_threads)
                        return stage, lambda s: s.close()

                    name = f"tiered {pct:g}%" + (f" {policy}" if len(policies) > 1 else "")
                    results[name] = run_variant(tiered, batches, args)
            lines += _table(alpha, results, args)
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    load = os.getloadavg()
    head = [
        f"rm2{'' if args.max_rows is None else f' (rows capped at {args.max_rows})'}: {len(rows)} tables, "
        f"{sum(rows):,} rows x {dim} fp32 = {table_bytes / 2**30:.2f} GiB on disk; {args.items} items per batch "
        f"({args.items * item_ids:,} ids); "
        + (f"the row cache warmed from the id counts of {args.warmup} recorded batches (TieredRows.warm: "
           f"sequential reads), then {args.after_warm} untimed batches; " if args.warm_cache else
           f"{args.warmup} warm-up batches for the row cache; ")
        + f"resident and mmap: {args.mmap_warmup} untimed batches (resident: every page touched and counted "
        f"with mincore before each run); then {args.runs} runs x {args.batches} "
        f"batches; medians over runs. io threads {args.io_threads}.",
        "",
        f"Machine: {machine_line(f'load average {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f} at the end')}",
        "",
        "Command: `.venv/bin/python bench/tiered_tables.py " + " ".join(sys.argv[1:]) + "`",
        "",
    ]
    publish("tiered-tables", "\n".join(head + lines), write=not args.no_write)
    return 0


def _table(alpha: float, results: dict[str, dict], args) -> list[str]:
    out = [f"Zipf alpha {alpha}:", "",
           "| variant | memory | cache hit rate (ids) | items/s | host p99 ms/batch | vs resident | vs mmap, same memory |",
           "|---|---|---|---|---|---|---|"]
    base = results["resident"]["runs"]
    for name, r in results.items():
        ips = statistics.median(x[0] for x in r["runs"])
        p99 = statistics.median(x[1] for x in r["runs"]) * 1e3
        vs_res = statistics.median(a[0] / b[0] for a, b in zip(r["runs"], base))
        mm = None
        if name.startswith("tiered"):
            key = "mmap " + name.split()[1]
            if key in results:
                mm = statistics.median(a[0] / b[0] for a, b in zip(r["runs"], results[key]["runs"]))
        hit = "-" if r.get("hit_rate") is None else f"{100 * r['hit_rate']:.1f}%"
        if name.startswith("mmap"):
            hit = f"({r['flushes']} flushes)"
        mem = f"{r['memory'] / 2**20:,.0f} MiB" if r.get("memory") else "-"
        if r.get("residency"):
            mem += f" ({100 * min(r['residency']):.0f}% of pages in)"
        out.append(f"| {name} | {mem} | {hit} | {ips:,.0f} | {p99:.1f} | {vs_res:.3f} | "
                   f"{'-' if mm is None else f'{mm:.2f}x'} |")
    out.append("")
    return out


if __name__ == "__main__":
    sys.exit(main())
