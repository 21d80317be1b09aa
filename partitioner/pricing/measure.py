"""Does the plan's cost model predict this host for *your* model? Estimate vs measured, stage by stage.

``sixfold-partition --measure`` (any model: built-in, .pt2 or .onnx):

1. calibrate this host (``sixfold.backends.host.calibrate.calibrate_host``, one thread) and
   re-plan the same model with that spec as the host *and* as the card (a
   "card" that is ONNX Runtime on this CPU, no link to cross): the estimate;
2. load the partitions on the backends the server uses (the host stage by its
   format: torch, host-embedding or ONNX Runtime; ONNX Runtime with one
   thread for each dense stage; table shards on cards are not measured) and
   time each stage on its own over ``batches`` distinct batches of the plan's
   ``batch_rows`` items from the plan's own traffic (``accuracy.plan_requests``),
   median of ``runs`` runs after a warm-up: the measurement;
3. report estimate, measured and their ratio per stage (a ratio near 1 means
   the plan's bottleneck and throughput bound can be trusted on this host).

Each stage is timed alone, as the device it models sees it (see
bench/estimate_vs_measured.py, the zoo-wide version, for why).

A plan priced with ``--table-memory`` (``PartitionPlan.tiers``) also gets its tiers measured
(``measure_tiers``): for each budget the host stage is loaded from the written tables behind
a row cache of that size (as ``sixfold-serve --table-memory`` loads it), the cache is brought
to its steady state (``warm_tier``), then timed over distinct batches (a repeated batch would
be all hits); the hit rate is counted over the timed batches. Estimate: this host's resident
host-stage estimate plus the plan's read time at that budget (its disk spec); the hit rate is
the plan's, which prices a warm cache.

Warming, in two steps, each until it stops changing (or ``warm_seconds`` runs out):

1. rank: batches of the priced traffic (Zipf ``alpha``) are drawn, not served, in rounds that
   double in size, and their ids counted, until a round adds < 0.5 point to the fill (rows
   the ranking would cache / slots) and the ranking's hit rate on the round (its top rows
   by the counts before it) gains < 0.25 point; the cache is then loaded with the most
   counted rows in one pass (``HostEmbeddingStage.warm``). A ranking from a few hundred
   batches misses the most popular rows by a few points of hit rate (rm2 at 10%: 82.5% from
   400 batches, 84.4% from 3,200; the estimate, from the exact popularity, 84.6%);
2. serve: rounds of ``warm_round`` batches are served through the cache (its own admission
   and eviction take over) until a round's hit rate is within 1 point of the round before.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sixfold.backends.spec import DeviceSpec

from sixfold.partitioner.partitioned import HOST_PARTITION, PartitionedModel

__all__ = ["StageMeasure", "TierMeasure", "MeasureReport", "measure_plan", "measure_tiers", "print_measure",
           "host_as_card"]


@dataclass(frozen=True)
class StageMeasure:
    stage: str
    """Partition name: "sparse" (host), "dense" or a pipeline stage "dense.k"."""
    device: str
    estimate_s: float
    measured_s: float
    best_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.estimate_s if self.estimate_s > 0 else float("inf")


@dataclass(frozen=True)
class TierMeasure:
    """One priced table memory: the plan's estimate beside the tiered host stage measured on this host."""

    budget: str
    """As priced (``10%``, ``1GiB``)."""
    budget_bytes: int
    items: int
    """Items per batch."""
    estimate_hit_rate: float
    measured_hit_rate: float
    estimate_s: float
    """Host stage per batch: this host's resident estimate + the plan's read time at this budget."""
    measured_s: float
    """Median over runs of the mean time per batch."""
    best_s: float
    reads_per_batch: float
    """Distinct rows read from disk per timed batch (the plan estimates ``reads_per_batch`` too)."""
    estimate_reads: float
    warm_ranked: int = 0
    """Batches of traffic drawn (not served) to rank the rows the cache was loaded with."""
    warm_served: int = 0
    """Batches served through the cache after that, until its hit rate settled."""
    warm_fill: float = 0.0
    """Rows cached / cache slots when timing began."""
    warm_seconds: float = 0.0
    warm_settled: bool = False
    """The warm-up stopped because the ranking and the hit rate stopped moving, not because time ran out."""
    read_s: float = 0.0
    """Disk read time per timed batch (the stores' own clock), the part of ``measured_s`` the reads took."""

    @property
    def hit_ratio(self) -> float:
        return self.measured_hit_rate / self.estimate_hit_rate if self.estimate_hit_rate > 0 else float("inf")

    @property
    def ratio(self) -> float:
        return self.measured_s / self.estimate_s if self.estimate_s > 0 else float("inf")


@dataclass(frozen=True)
class MeasureReport:
    model: str
    batch_rows: int
    spec: str
    """The calibrated spec's description."""
    stages: list[StageMeasure]
    tiers: list[TierMeasure] = field(default_factory=list)
    """The plan's priced table memories, measured (empty: not priced, or not measured)."""
    tier_notes: list[str] = field(default_factory=list)
    """Why a priced budget was not measured."""

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "batch_rows": self.batch_rows, "spec": self.spec,
                "stages": [{**dataclasses.asdict(s), "ratio": s.ratio} for s in self.stages],
                "tiers": [{**dataclasses.asdict(t), "hit_ratio": t.hit_ratio, "ratio": t.ratio} for t in self.tiers],
                "tier_notes": list(self.tier_notes)}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def host_as_card(host: DeviceSpec) -> DeviceSpec:
    """The calibrated host spec standing in for a card: ONNX Runtime on this CPU, no link."""
    return dataclasses.replace(host, name=f"{host.name}-as-card", kind="card", link_bandwidth=0,
                               link_latency_s=0.0)


def _time(run: Callable[[dict], Any], inputs: list[dict], runs: int) -> list[float]:
    for x in inputs:  # warm-up
        run(x)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for x in inputs:
            run(x)
        times.append((time.perf_counter() - t0) / len(inputs))
    return times


def measure_plan(partitioned: PartitionedModel, replan: Callable[[DeviceSpec, DeviceSpec], PartitionedModel], *,
                 spec: DeviceSpec | None = None, calibrate_seconds: float = 3.0, runs: int = 5, batches: int = 5,
                 seed: int = 7, tables_dir: str | Path | None = None, warm_seconds: float = 240.0,
                 progress: Callable[[str], None] | None = None) -> MeasureReport:
    """Estimate vs measured per stage of ``partitioned`` on this host (module docstring).

    ``replan(host_spec, card_spec)``: the same model planned for other specs
    (the estimate; it need not compile). ``spec``: this host's spec (default:
    calibrate it now, ``calibrate_seconds``). ``tables_dir``: the written
    ``tables/`` folder; with it, a plan carrying tier prices (``plan.tiers``) has
    each priced table memory measured too (``measure_tiers``; ``warm_seconds``, ``progress``: its).
    """
    from sixfold.backends import registry

    from sixfold.partitioner.precision.accuracy import _HOST_BACKENDS, plan_requests

    if min(runs, batches) < 1:
        raise ValueError(f"runs and batches must be >= 1, got {runs} and {batches}")
    if spec is None:
        from sixfold.backends.host.calibrate import calibrate_host
        spec = calibrate_host(calibrate_seconds, threads=1, name="host-calibrated-1t")
    estimated = replan(spec, host_as_card(spec)).plan
    est = {}
    for d in estimated.estimates.per_device:
        for name in d.partitions:
            est.setdefault(name, (d.device, d.batch_seconds / max(1, len(d.partitions))))
    plan = partitioned.plan
    rows = estimated.estimates.batch_rows
    make = plan_requests(plan, seed).make
    requests = [make(rows) for _ in range(batches)]
    host_art = partitioned.artifacts[HOST_PARTITION]  # NOTE: as sixfold.server.loading.loader picks its backend (no shards)
    host = registry.get_backend(_HOST_BACKENDS[host_art.format]).load(host_art, spec)
    ort = registry.get_backend("onnxruntime", intra_op_threads=1, inter_op_threads=1)
    dense = {name: ort.load(partitioned.artifact_for(name, ort), spec) for name in plan.dense_stages()}
    import torch
    threads = torch.get_num_threads()
    # NOTE: one thread, as the spec was calibrated (threads=1) and as the dense stage runs: torch's own
    # pool of every core spins against the other processes of a busy host (the one-hot DLRM wrapper's
    # host stage measured 55-74x its estimate so on a 2-core VM under load, 1.5-2x with one thread).
    torch.set_num_threads(1)
    try:
        measured = {HOST_PARTITION: _time(host.run, requests, runs)}
        feeds = [{**r, **host.run(r)} for r in requests]
        for name, exe in dense.items():  # each stage alone, on what the stage before it produced
            measured[name] = _time(exe.run, feeds, runs)
            feeds = [{**f, **exe.run(f)} for f in feeds]
    finally:
        torch.set_num_threads(threads)
        host.close()
        for exe in dense.values():
            exe.close()
    stages = [StageMeasure(stage=name, device=est[name][0], estimate_s=est[name][1],
                           measured_s=statistics.median(times), best_s=min(times))
              for name, times in measured.items() if name in est]
    tiers: list[TierMeasure] = []
    notes: list[str] = []
    if plan.tiers is not None and tables_dir is not None and HOST_PARTITION in est:
        resident = est[HOST_PARTITION][1] * plan.tiers.items / rows
        tiers, notes = measure_tiers(partitioned, tables_dir, spec, resident_s=resident, runs=runs, batches=batches,
                                     warm_seconds=warm_seconds, seed=seed, progress=progress)
    elif plan.tiers is not None:
        notes.append("table tiers not measured: no tables folder (write the artifacts: --out without --plan-only)")
    return MeasureReport(model=plan.model, batch_rows=rows, spec=spec.description, stages=stages, tiers=tiers,
                         tier_notes=notes)


def measure_tiers(partitioned: PartitionedModel, tables_dir: str | Path, spec: DeviceSpec, *, resident_s: float,
                  runs: int = 5, batches: int = 5, warm_seconds: float = 240.0, warm_round: int = 20, seed: int = 7,
                  progress: Callable[[str], None] | None = None) -> tuple[list[TierMeasure], list[str]]:
    """Each table memory priced in ``partitioned.plan.tiers``, measured (module docstring); and notes on any not.

    ``resident_s``: this host's estimate of the all-resident host stage per batch of
    ``plan.tiers.items`` items (the estimate adds the plan's read time to it). ``warm_seconds``:
    the most each budget's warming may take (``warm_tier``); ``progress``: called with a line
    on each warming round.
    """
    import numpy as np

    from sixfold.backends import registry
    from sixfold.backends.api import BackendError
    from sixfold.models.requests import RequestGenerator

    from sixfold.partitioner.precision.accuracy import plan_requests

    plan = partitioned.plan
    pricing = plan.tiers
    assert pricing is not None
    artifact = partitioned.artifacts[HOST_PARTITION]
    if artifact.format != "tables":
        return [], [f"table tiers not measured: the host stage is {artifact.format!r}, not table-batched"]
    base = plan_requests(plan, seed)  # the plan's traffic, at the skew the tiers were priced for
    gen = RequestGenerator(tuple(int(r) for r in base.table_rows), int(base.dense_dim),
                           tuple(int(p) for p in base.pooling), zipf=pricing.alpha, seed=seed,
                           fixed_pooling=base.fixed_pooling)
    keys = artifact.input_names
    make = lambda: {k: v for k, v in gen.make(pricing.items).items() if k in keys}  # noqa: E731
    timed = [[make() for _ in range(batches)] for _ in range(runs)]  # distinct: a repeat would be all hits
    pooling = plan.tables.get("pooling") or [1]
    out: list[TierMeasure] = []
    notes: list[str] = []
    for budget, priced in zip(pricing.budgets, pricing.estimates):
        tiered = dataclasses.replace(artifact, payload=Path(tables_dir), metadata={
            **artifact.metadata, "table_memory": priced.budget_bytes, "cache_policy": "tinylfu",
            "item_ids": int(sum(pooling))})
        try:
            exe = registry.get_backend("host-embedding", check_ids=False).load(tiered, spec)
        except (BackendError, ValueError) as exc:
            notes.append(f"table memory {budget}: not measured ({exc})")
            continue
        try:
            stage = exe.stage
            say = (lambda line: progress(f"table memory {budget}: {line}")) if progress else None
            warmed = warm_tier(exe, make, tuple(int(r) for r in base.table_rows), keys, seconds=warm_seconds,
                               round_batches=warm_round, progress=say)
            for s in stage.stores:  # count the timed batches only
                s.reset_stats()
            times = []
            for run in timed:
                t0 = time.perf_counter()
                for b in run:
                    exe.run(b)
                times.append((time.perf_counter() - t0) / len(run))
            hits = sum(s.stats.hits for s in stage.stores)
            misses = sum(s.stats.misses for s in stage.stores)
            read = sum(s.stats.rows_read for s in stage.stores)
            read_s = sum(s.stats.read_seconds for s in stage.stores)
        finally:
            exe.close()
        out.append(TierMeasure(budget=budget, budget_bytes=priced.budget_bytes, items=pricing.items,
                               estimate_hit_rate=priced.hit_rate,
                               measured_hit_rate=hits / (hits + misses) if hits + misses else 0.0,
                               estimate_s=resident_s + priced.read_seconds, measured_s=statistics.median(times),
                               best_s=min(times), reads_per_batch=read / (runs * batches),
                               estimate_reads=priced.reads_per_batch, warm_ranked=warmed.ranked,
                               warm_served=warmed.served, warm_fill=warmed.fill, warm_seconds=warmed.seconds,
                               warm_settled=warmed.settled,
                               read_s=read_s / (runs * batches)))
    return out, notes


@dataclass(frozen=True)
class TierWarming:
    """What ``warm_tier`` did."""

    ranked: int
    """Batches drawn (not served) to rank the rows."""
    served: int
    """Batches served through the cache afterwards."""
    fill: float
    """Rows cached / slots at the end."""
    hit_rate: float
    """The last served round's hit rate."""
    seconds: float
    settled: bool
    """Both steps stopped because they stopped changing, not because time ran out."""


def warm_tier(exe: Any, make: Callable[[], dict], table_rows: tuple[int, ...], keys: list[str] | tuple[str, ...], *,
              seconds: float = 120.0, round_batches: int = 20, rank_round: int = 50, max_rank_rounds: int = 12,
              progress: Callable[[str], None] | None = None) -> TierWarming:
    """Bring a tiered host stage's row cache (``exe.stage``) to its steady state for ``make``'s traffic.

    Rank, then serve, each until it stops changing (module docstring); ``seconds`` bounds both
    (ranking stops after half of it; serving gets at least two rounds). ``keys``: the lengths and
    indices input names.
    """
    import numpy as np

    stage = exe.stage
    stores = stage.stores
    slots = sum(s.slots for s in stores)
    start = time.perf_counter()
    if not stores:  # all rows resident: nothing to warm
        return TierWarming(ranked=0, served=0, fill=1.0, hit_rate=1.0, seconds=0.0, settled=True)
    deadline = start + seconds
    first_row = np.cumsum((0,) + tuple(table_rows)).astype(np.int64)
    tables = len(table_rows)
    counts = np.zeros(int(first_row[-1]), np.int32)

    def rows_of(batch: dict) -> np.ndarray:
        lengths = np.asarray(batch[keys[0]]).reshape(-1)
        table = np.repeat(np.tile(np.arange(tables), lengths.shape[0] // tables), lengths)
        return np.asarray(batch[keys[1]], np.int64) + first_row[table]

    # 1. rank: count the ids of drawn batches until the fill and the ranking's hit rate stop moving
    ranked = rounds = 0
    fill = hit = -1.0
    settled = False
    while rounds < max_rank_rounds:
        size = rank_round << rounds  # doubling: the counts' noise halves each round or so
        seen = int(np.count_nonzero(counts))
        cached = np.zeros(counts.shape[0], bool)  # the ranking's cache before this round
        cached[np.argpartition(counts, -slots)[-slots:] if seen > slots else counts.nonzero()[0]] = True
        hits = ids = 0
        for lo in range(0, size, rank_round):  # in chunks: a round's ids need not all be in memory
            drawn = np.concatenate([rows_of(make()) for _ in range(min(rank_round, size - lo))])
            hits += int(np.count_nonzero(cached[drawn]))
            ids += drawn.shape[0]
            counts += np.bincount(drawn, minlength=counts.shape[0]).astype(np.int32)
        ranked += size
        rounds += 1
        round_hit = hits / max(1, ids)
        round_fill = min(1.0, np.count_nonzero(counts) / max(1, slots))
        if progress:
            progress(f"ranking rows: {ranked:,} batches drawn, fill {100 * round_fill:.1f}%, ranking's hit rate "
                     f"{100 * round_hit:.1f}%")
        if round_fill - fill < 0.005 and round_hit - hit < 0.0025:
            settled = True
            break
        fill, hit = round_fill, round_hit
        if time.perf_counter() > start + seconds / 2:
            break
    seen = int(np.count_nonzero(counts))
    top = np.argsort(-counts, kind="stable")[:min(slots, seen)]
    table = np.searchsorted(first_row, top, side="right") - 1
    order = np.argsort(table, kind="stable")  # one item whose bags hold each table's wanted ids
    lengths = np.bincount(table, minlength=tables).reshape(1, tables).astype(np.int32)
    stage.warm(lengths, (top - first_row[table])[order], counts[top][order].astype(np.float64))
    # 2. serve: the cache's own policy takes over until a round's hit rate settles
    served = 0
    last = -1.0
    round_hit = 0.0
    serve_settled = False
    while True:
        for s in stores:
            s.reset_stats()
        for _ in range(round_batches):
            exe.run(make())
        served += round_batches
        hits = sum(s.stats.hits for s in stores)
        total = hits + sum(s.stats.misses for s in stores)
        round_hit = hits / total if total else 1.0
        fill = sum(s.cached_rows for s in stores) / max(1, slots)
        if progress:
            progress(f"serving: {served:,} batches, hit rate {100 * round_hit:.1f}% (round before "
                     f"{100 * max(last, 0):.1f}%), fill {100 * fill:.1f}%")
        if abs(round_hit - last) < 0.01:
            serve_settled = True
            break
        if last >= 0 and time.perf_counter() > deadline:  # at least two rounds: one to compare with
            break
        last = round_hit
    return TierWarming(ranked=ranked, served=served, fill=fill, hit_rate=round_hit,
                       seconds=time.perf_counter() - start, settled=settled and serve_settled)


def print_measure(report: MeasureReport, console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"{report.model}: plan estimate vs measured on this host "
                        f"(batches of {report.batch_rows} items; host and card = this CPU, 1 thread)")
    for column in ("stage", "device", "estimate ms", "measured ms", "best ms", "measured / estimate"):
        table.add_column(column, justify="left" if column in ("stage", "device") else "right")
    for s in report.stages:
        table.add_row(s.stage, s.device, f"{s.estimate_s * 1e3:.3f}", f"{s.measured_s * 1e3:.3f}",
                      f"{s.best_s * 1e3:.3f}", f"{s.ratio:.2f}")
    console.print(table)
    for s in report.stages:
        if not 0.67 <= s.ratio <= 1.5:  # NOTE: past 1.5x either way the plan's bound and bottleneck mislead
            side = "slower" if s.ratio > 1 else "faster"
            console.print(f"[yellow]{s.stage} runs {s.ratio:.1f}x {side} here than the plan estimates: its "
                          "throughput bound and bottleneck are off by as much on this host[/]")
    if report.tiers:
        _print_tiers(report, console)
    for note in report.tier_notes:
        console.print(f"[yellow]{note}[/]")
    console.print(f"calibrated spec: {report.spec}")


def _print_tiers(report: MeasureReport, console: Any) -> None:
    from rich.table import Table

    items = report.tiers[0].items
    table = Table(title=f"{report.model}: table tiers, plan estimate vs measured on this host (host stage, batches of "
                        f"{items} items, row cache warmed first)")
    for column in ("memory", "warm-up", "hit est.", "hit meas.", "ratio", "reads est.", "reads meas.",
                   "host ms est.", "host ms meas.", "of it reads", "ratio "):
        table.add_column(column, justify="right")
    for t in report.tiers:
        table.add_row(t.budget, f"{t.warm_ranked:,} + {t.warm_served:,}{'' if t.warm_settled else ' (timed out)'}",
                      f"{100 * t.estimate_hit_rate:.1f}%", f"{100 * t.measured_hit_rate:.1f}%",
                      f"{t.hit_ratio:.2f}", f"{t.estimate_reads:,.0f}", f"{t.reads_per_batch:,.0f}",
                      f"{t.estimate_s * 1e3:.3f}", f"{t.measured_s * 1e3:.3f}", f"{t.read_s * 1e3:.3f}",
                      f"{t.ratio:.2f}")
    console.print(table)
    console.print("  warm-up: batches drawn to rank the rows loaded + batches served until the hit rate settled; hit: share of ids the row cache answered (estimate: a warm cache "
                  "of the most popular rows, an upper bound); reads: distinct rows read from disk per batch; host "
                  "ms: host stage per batch (estimate: this host's resident estimate + the plan's reads / IOPS), of "
                  "it reads: the disk reads' own time; ratio: measured / estimate")
