"""Embedding tables on cards: table-, row- or column-wise shards, balanced by lookup cost.

Policy only, plain data in and out (like ``strategy.py``): ``plan_shards`` takes
the plan's table facts (``{rows, dim, pooling, zipf}``), the cards and how much
memory each has left after its dense work, and returns a ``ShardPlan``: which
block of which table lives where, its bytes and its modelled lookup time per
batch. ``shard_tables`` applies it to a ``PartitionedModel`` (the CLI's
``--sparse-on-cards``); ``sixfold.backends.builtin.sharded_embedding`` executes it.

Shapes of shards (TorchRec's names):

* table-wise: a whole table on one card; the card gets all of its ids.
* row-wise: a table cut into contiguous row ranges on distinct cards; each
  card gets the ids in its range and returns partial sums (added on the host).
* column-wise: a table cut into equal column slices on distinct cards; every
  slice's card gets all of the table's ids and returns its part of the dim.

Cost of one shard per batch of ``B`` items, on the card's ``DeviceSpec``::

    ids      = B * pooling * share
    seconds  = roofline(ids * cols adds, ids * (row bytes + 8))        # gather
             + (ids * 8 + B * 4 + B * cols * 4) / link bandwidth       # ids, lengths in; pooled out

and a card pays its link latency twice per batch (one transfer each way),
however many shards it holds: the same arithmetic the simulated card applies.

Skew: ids follow a power law (``zipf``), scattered over the rows by hashing,
so a row range's expected share of the lookups is its share of the rows, but
the hottest row alone takes ``hot_row_share`` of them and lands in one range.
Row-wise planning assumes every range may hold it (share = f (1 - p1) + p1):
row-wise splitting cannot spread the hottest row, and the estimate says so.

Placement is greedy, like TorchRec's greedy partitioner: tables by cost,
largest first; each table's shards, largest first, each onto the card where it
would finish soonest that has the memory (a table's shards on distinct cards).
A table whose shards do not all fit stays on the host, with a note that quotes
the numbers. ``auto`` plans every mode and keeps the lowest bottleneck.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from sixfold.backends.memory import format_bytes
from sixfold.backends.spec import DeviceSpec

from sixfold.partitioner.plan import DeviceInfo, PartitionPlan, TableShard
from sixfold.partitioner.placement.strategy import ACTIVATION_HEADROOM, PlanError

if TYPE_CHECKING:
    from sixfold.partitioner.partitioned import PartitionedModel

__all__ = ["ShardMode", "MODES", "ShardPlan", "plan_shards", "shard_tables", "hot_row_share",
           "lookup_seconds", "host_table_arrays", "card_loads", "HOST"]

ShardMode = Literal["table", "row", "column", "auto"]
MODES: tuple[str, ...] = ("table", "row", "column")
HOST = "host"
_ID_BYTES = 8
_LENGTH_BYTES = 4
_POOLED_BYTES = 4  # pooled rows travel back as fp32 whatever the table precision

BytesPerRow = Callable[[int], int]
"""Bytes one row of ``cols`` columns takes in the tables' precision."""


def _fp32_row(cols: int) -> int:
    return 4 * cols


@dataclass
class ShardPlan:
    """Where every table block goes, what each device holds and how long its lookups take per batch."""

    mode: str
    """The mode planned ("table", "row" or "column"; ``auto`` resolved)."""
    shards: list[TableShard]
    """Every table's blocks; a table left on the host is one "table" block on device "host"."""
    loads: dict[str, float]
    """Device -> modelled lookup seconds per batch (cards: shards + two link latencies)."""
    bytes_used: dict[str, int]
    """Device -> bytes of table blocks it holds."""
    batch_rows: int
    notes: list[str] = field(default_factory=list)
    """Why tables stayed on the host, and what ``auto`` compared."""

    @property
    def bottleneck(self) -> str:
        """The device with the longest lookup time per batch."""
        return max(self.loads, key=lambda d: self.loads[d]) if self.loads else HOST  # first of equals

    @property
    def bottleneck_seconds(self) -> float:
        return self.loads.get(self.bottleneck, 0.0)

    @property
    def host_tables(self) -> list[int]:
        return sorted(s.table for s in self.shards if s.device == HOST)

    def summary(self) -> dict[str, Any]:
        """Plain data for ``PartitionPlan.tables["sharding"]`` (explain reads it)."""
        return {"mode": self.mode, "batch_rows": self.batch_rows, "loads": dict(self.loads),
                "bytes": dict(self.bytes_used), "bottleneck": self.bottleneck,
                "bottleneck_seconds": self.bottleneck_seconds, "host_tables": self.host_tables,
                "notes": list(self.notes)}


# ---- cost model ----------------------------------------------------------------------------------


def hot_row_share(rows: int, zipf: float) -> float:
    """Share of a table's lookups that hit its hottest row under a bounded power law of exponent ``zipf``.

    The continuous bounded law the zoo's traffic draws ranks from (``sixfold.models.requests``):
    P(rank 0) = (2^(1-s) - 1) / (rows^(1-s) - 1); ``zipf <= 0`` is uniform.
    """
    if rows <= 1:
        return 1.0
    s = float(zipf)
    if s <= 0:
        return 1.0 / rows
    if abs(s - 1.0) < 1e-9:
        return min(1.0, math.log(2.0) / math.log(rows))
    return min(1.0, (2.0 ** (1 - s) - 1) / (rows ** (1 - s) - 1))


def lookup_seconds(spec: DeviceSpec, ids: float, cols: int, batch_rows: int, bytes_per_row: BytesPerRow = _fp32_row) -> float:
    """Modelled time for ``spec`` to gather and pool ``ids`` rows of ``cols`` columns for a batch.

    Gather is a roofline of one add per value against row + id bytes read;
    on a card (link bandwidth > 0) the ids and lengths go in and the pooled
    [batch_rows, cols] fp32 block comes back. Link latency is left to the device.
    """
    gather = spec.compute_seconds(ids * cols, ids * (bytes_per_row(cols) + _ID_BYTES))
    if spec.link_bandwidth <= 0:
        return gather
    link = ids * _ID_BYTES + batch_rows * _LENGTH_BYTES + batch_rows * cols * _POOLED_BYTES
    return gather + link / spec.link_bandwidth


def _device_overhead(spec: Any) -> float:
    """Per-batch fixed cost of using a device at all: one transfer each way."""
    return 2.0 * spec.link_latency_s if spec.link_bandwidth > 0 else 0.0


def card_loads(shards: Sequence[TableShard], specs: Mapping[str, Any]) -> dict[str, float]:
    """Device -> lookup seconds per batch: its shards' times plus, on a card, two link latencies."""
    loads: dict[str, float] = {}
    for s in shards:
        loads[s.device] = loads.get(s.device, 0.0) + s.est_seconds
    for device in loads:
        if device in specs:
            loads[device] += _device_overhead(specs[device])
    return loads


# ---- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Facts:
    rows: list[int]
    dim: int
    pooling: list[float]
    zipf: list[float]

    @classmethod
    def parse(cls, tables: Mapping[str, Any]) -> "_Facts":
        for key in ("rows", "dim", "pooling"):
            if key not in tables:
                raise PlanError(f"table facts lack {key!r}; have {sorted(tables)} (need rows, dim, pooling)")
        rows = [int(r) for r in tables["rows"]]
        pooling = [float(p) for p in tables["pooling"]]
        dim = int(tables["dim"])
        if not rows:
            raise PlanError("table facts list no tables (rows is empty)")
        if len(pooling) != len(rows):
            raise PlanError(f"table facts: {len(pooling)} pooling factors for {len(rows)} tables")
        if min(rows) < 1 or dim < 1 or min(pooling) < 0:
            raise PlanError(f"table facts: rows >= 1, dim >= 1 and pooling >= 0 needed; got min rows "
                            f"{min(rows)}, dim {dim}, min pooling {min(pooling)}")
        z = tables.get("zipf", 0.0) or 0.0
        zipf = [float(z)] * len(rows) if isinstance(z, (int, float)) else [float(x) for x in z]
        if len(zipf) == 1:
            zipf *= len(rows)
        if len(zipf) != len(rows):
            raise PlanError(f"table facts: {len(zipf)} zipf exponents for {len(rows)} tables")
        return cls(rows, dim, pooling, zipf)


@dataclass(frozen=True)
class _Piece:
    table: int
    kind: str
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    share: float
    """Share of the table's ids this piece's card receives."""


def _column_split(dim: int, cards: int) -> int:
    """The most equal column slices (2..cards) that divide ``dim``; 0 when none does."""
    return max((k for k in range(2, min(cards, dim) + 1) if dim % k == 0), default=0)


def _pieces(t: int, facts: _Facts, mode: str, cards: int) -> list[_Piece]:
    rows, dim = facts.rows[t], facts.dim
    if mode == "table":
        return [_Piece(t, "table", 0, rows, 0, dim, 1.0)]
    if mode == "row":
        k = min(cards, rows)
        p1 = hot_row_share(rows, facts.zipf[t])
        cuts = [rows * i // k for i in range(k + 1)]
        return [_Piece(t, "row", a, b, 0, dim, min(1.0, (b - a) / rows * (1 - p1) + p1))
                for a, b in zip(cuts[:-1], cuts[1:])]
    k = _column_split(dim, cards)
    width = dim // k
    return [_Piece(t, "column", 0, rows, i * width, (i + 1) * width, 1.0) for i in range(k)]


def _check_request(mode: str, facts: _Facts, cards: list[DeviceInfo]) -> None:
    if mode not in MODES:
        raise PlanError(f"unknown sharding mode {mode!r}; known: {', '.join(MODES)}, auto")
    if not cards:
        raise PlanError("--sparse-on-cards needs at least one card (got --cards 0)")
    if mode == "column" and not _column_split(facts.dim, len(cards)):
        raise PlanError(f"column-wise shards need a dim that splits evenly over 2..{len(cards)} cards; "
                        f"tables have dim {facts.dim} and there are {len(cards)} card(s)")


def _plan_mode(mode: str, facts: _Facts, cards: list[DeviceInfo], free: dict[str, int],
               bytes_per_row: BytesPerRow, host: DeviceInfo | None, batch_rows: int) -> ShardPlan:
    _check_request(mode, facts, cards)
    spec = {c.id: c.spec for c in cards}
    order = {c.id: i for i, c in enumerate(cards)}
    load = {c.id: 0.0 for c in cards}
    used = {c.id: 0 for c in cards}

    def piece_bytes(p: _Piece) -> int:
        return (p.row_end - p.row_start) * bytes_per_row(p.col_end - p.col_start)

    def piece_seconds(p: _Piece, device: Any) -> float:
        ids = batch_rows * facts.pooling[p.table] * p.share
        return lookup_seconds(device, ids, p.col_end - p.col_start, batch_rows, bytes_per_row)

    reference = cards[0].spec
    pieces = {t: _pieces(t, facts, mode, len(cards)) for t in range(len(facts.rows))}
    by_cost = sorted(pieces, key=lambda t: (-sum(piece_seconds(p, reference) for p in pieces[t]), t))
    shards: list[TableShard] = []
    notes: list[str] = []
    left: list[int] = []
    for t in by_cost:
        chosen: list[TableShard] = []
        extra_load: dict[str, float] = {}
        extra_used: dict[str, int] = {}
        for p in sorted(pieces[t], key=lambda p: (-piece_seconds(p, reference), p.row_start, p.col_start)):
            nbytes = piece_bytes(p)
            taken = {s.device for s in chosen}
            fits = [c for c in load if c not in taken
                    and used[c] + extra_used.get(c, 0) + nbytes <= free.get(c, 0)]
            if not fits:
                room = {c: free.get(c, 0) - used[c] - extra_used.get(c, 0) for c in load if c not in taken}
                best = max(room, key=lambda c: (room[c], -order[c])) if room else None
                where = (f"the most free card, {best}, has {format_bytes(max(room[best], 0))}" if best
                         else "no other card is left for it")
                notes.append(f"table {t} ({facts.rows[t]} rows) stays on the host: its {mode}-wise shard "
                             f"rows {p.row_start}:{p.row_end} cols {p.col_start}:{p.col_end} needs "
                             f"{format_bytes(nbytes)}; {where}")
                chosen = []
                break

            def finish(c: str) -> tuple[float, int]:
                start = load[c] + extra_load.get(c, 0.0)
                fresh = load[c] == 0.0 and c not in extra_load
                return start + piece_seconds(p, spec[c]) + (_device_overhead(spec[c]) if fresh else 0.0), order[c]

            c = min(fits, key=finish)
            seconds = piece_seconds(p, spec[c])
            extra_load[c] = extra_load.get(c, 0.0) + seconds + (
                _device_overhead(spec[c]) if load[c] == 0.0 and c not in extra_load else 0.0)
            extra_used[c] = extra_used.get(c, 0) + nbytes
            chosen.append(TableShard(table=t, device=c, kind=p.kind, row_start=p.row_start, row_end=p.row_end,
                                     col_start=p.col_start, col_end=p.col_end, bytes=nbytes, est_seconds=seconds))
        if not chosen:
            left.append(t)
            continue
        for c, extra in extra_load.items():
            load[c] += extra
        for c, extra_b in extra_used.items():
            used[c] += extra_b
        shards.extend(chosen)
    if len(left) == len(facts.rows):
        raise PlanError(f"--sparse-on-cards {mode}: no table fits on the cards; " + "; ".join(notes))
    for t in sorted(left):
        nbytes = facts.rows[t] * bytes_per_row(facts.dim)
        seconds = (lookup_seconds(host.spec, batch_rows * facts.pooling[t], facts.dim, batch_rows, bytes_per_row)
                   if host is not None else 0.0)
        shards.append(TableShard(table=t, device=HOST, kind="table", row_start=0, row_end=facts.rows[t],
                                 col_start=0, col_end=facts.dim, bytes=nbytes, est_seconds=seconds))
    shards.sort(key=lambda s: (order.get(s.device, len(order)), s.table, s.row_start, s.col_start))
    specs = {**spec, **({HOST: host.spec} if host is not None else {})}
    bytes_used: dict[str, int] = {}
    for s in shards:
        bytes_used[s.device] = bytes_used.get(s.device, 0) + s.bytes
    return ShardPlan(mode=mode, shards=shards, loads=card_loads(shards, specs), bytes_used=bytes_used,
                     batch_rows=batch_rows, notes=notes)


def plan_shards(tables: Mapping[str, Any], cards: list[DeviceInfo], card_free_bytes: Mapping[str, int],
                mode: ShardMode = "auto", bytes_per_row: BytesPerRow = _fp32_row, *,
                host: DeviceInfo | None = None, batch_rows: int = 256) -> ShardPlan:
    """Place the tables described by ``tables`` ({rows, dim, pooling, zipf}) on ``cards``.

    ``card_free_bytes``: memory each card has for tables (after its dense work).
    ``bytes_per_row(cols)``: a row's bytes in the tables' precision. ``host``:
    to estimate the tables left there. Tables that do not fit stay on the host
    (see ``ShardPlan.notes``); PlanError when the request cannot be met at all
    (no cards, a dim column-wise cannot split, no table fits anywhere).
    """
    facts = _Facts.parse(tables)
    if batch_rows < 1:
        raise PlanError(f"batch_rows must be >= 1, got {batch_rows}")
    free = {c.id: max(0, int(card_free_bytes.get(c.id, 0))) for c in cards}
    if mode != "auto":
        return _plan_mode(mode, facts, cards, free, bytes_per_row, host, batch_rows)
    plans: list[ShardPlan] = []
    refused: list[str] = []
    for m in MODES:
        try:
            plans.append(_plan_mode(m, facts, cards, free, bytes_per_row, host, batch_rows))
        except PlanError as exc:
            refused.append(f"{m}: {exc}")
    if not plans:
        raise PlanError("--sparse-on-cards auto: no mode places any table; " + " | ".join(refused))
    best = min(plans, key=lambda p: (round(p.bottleneck_seconds, 12), len(p.host_tables), MODES.index(p.mode)))
    best.notes.append("auto: bottleneck " + ", ".join(f"{p.mode} {p.bottleneck_seconds * 1e3:.3f} ms ({p.bottleneck})"
                                                      for p in plans)
                      + "".join(f"; {r}" for r in refused) + f" -> {best.mode}")
    return best


# ---- applying it to a partitioned model ----------------------------------------------------------


def shard_tables(partitioned: "PartitionedModel", mode: ShardMode) -> ShardPlan:
    """Put the host stage's tables on the plan's cards (``--sparse-on-cards``): shards, notes, estimates.

    Only for a table-batched embedding host stage (the zoo's, fp32 or fp16
    tables). Each card keeps its dense work's weights x ACTIVATION_HEADROOM;
    the rest of its memory is for table shards.
    """
    from sixfold.partitioner.partitioned import HOST_PARTITION
    from sixfold.partitioner.tables.probe import table_batched

    plan, split = partitioned.plan, partitioned.split
    tables = plan.tables
    if split is None:
        raise ValueError("--sparse-on-cards needs a torch host stage; an ONNX model's tables stay on the host")
    arrays = None if partitioned.artifacts[HOST_PARTITION].format == "tables" else table_batched(
        split.host, split.host_inputs, split.boundary, tables.get("rows"))
    if arrays is not None:
        tables.setdefault("dim", int(arrays[0].shape[1]))  # a model file's plan learns its dim here
    elif partitioned.artifacts[HOST_PARTITION].format != "tables":
        raise ValueError("--sparse-on-cards needs a table-batched host stage: one sum-pooled bag per (item, table) "
                         f"from the lengths and ids over one weight of all tables (the zoo's layout); this one "
                         f"takes {split.host_inputs} -> {split.boundary}"
                         + ("" if tables.get("rows") else " and its tables could not be told apart")
                         + " (see docs/bring-your-own-model.md, Limits)")
    precision = tables.get("precision", "fp32")
    if precision not in ("fp32", "fp16"):
        raise ValueError(f"--sparse-on-cards serves fp32 or fp16 tables; these are {precision} "
                         "(drop --table-precision or use fp16)")
    from sixfold.backends.host.host_embedding import bytes_per_row

    host_id = plan.devices_of(HOST_PARTITION)[0]
    host = plan.device(host_id)
    cards = [d for d in plan.devices if d.id != host_id]
    held = {d.device: d.memory_bytes for d in plan.estimates.per_device}
    free = {c.id: c.spec.memory_bytes - int(held.get(c.id, 0) * ACTIVATION_HEADROOM) for c in cards}
    result = plan_shards(tables, cards, free, mode, lambda cols: bytes_per_row(precision, cols), host=host,
                         batch_rows=plan.estimates.batch_rows)
    plan.shards = list(result.shards)
    tables["sharding"] = result.summary()
    _update_estimates(plan, result, host_id, HOST_PARTITION, bytes_per_row(precision, int(tables["dim"])))
    return result


def _update_estimates(plan: PartitionPlan, result: ShardPlan, host_id: str, host_partition: str,
                      row_bytes: int) -> None:
    """Move the sharded lookups' memory and time from the host to the cards, then re-derive the bound.

    Each device's work per item is read back from the old bound (utilisation /
    throughput), the shards' time per item is added to its card, the host keeps
    only its leftover tables; the new bound is the busiest device's.
    """
    est = plan.estimates
    rows = est.batch_rows
    old_bound = est.throughput_items_per_s
    if not rows or not math.isfinite(old_bound) or old_bound <= 0:
        return
    on_cards = {s.table for s in result.shards if s.device != HOST}
    moved = sum(plan.tables["rows"][t] for t in on_cards) * row_bytes
    work: dict[str, float] = {}
    old_host_seconds = 0.0
    for d in est.per_device:
        per_item = d.utilisation / old_bound
        if d.device == host_id:
            old_host_seconds = d.batch_seconds
            d.memory_bytes = max(0, d.memory_bytes - moved)
            d.batch_seconds = result.loads.get(HOST, 0.0)
            per_item = d.batch_seconds / rows
        elif d.device in result.loads:
            d.memory_bytes += result.bytes_used.get(d.device, 0)
            d.batch_seconds += result.loads[d.device]
            per_item += result.loads[d.device] / rows
            if host_partition not in d.partitions:
                d.partitions.append(host_partition)
        work[d.device] = per_item
    busiest = max(work, key=lambda k: work[k])
    if work[busiest] <= 0:
        return
    bound = 1.0 / work[busiest]
    for d in est.per_device:
        d.utilisation = min(1.0, bound * work[d.device])
    # The busiest card is a lookup bottleneck when its shards are most of its work.
    lookups = result.loads.get(busiest, 0.0) / rows
    busiest_parts = next(d.partitions for d in est.per_device if d.device == busiest)
    est.bottleneck = (host_partition if busiest == host_id or lookups >= work[busiest] / 2
                      else busiest_parts[0])
    sparse_stage = max(result.loads.values(), default=0.0)
    est.latency_ms = max(0.0, est.latency_ms + (sparse_stage - old_host_seconds) * 1e3)
    est.throughput_items_per_s = bound


def host_table_arrays(partitioned: "PartitionedModel") -> list[Any]:
    """The fp32 tables of a table-batched host stage, one [rows, dim] numpy view each (no copy)."""
    rows = partitioned.plan.tables.get("rows") or []
    for name, tensor in partitioned.split.host.named_parameters():
        array = tensor.detach().cpu().numpy()
        if name.endswith("weight") and array.ndim == 2 and array.shape[0] == sum(rows):
            starts = [0]
            for r in rows:
                starts.append(starts[-1] + int(r))
            return [array[a:b] for a, b in zip(starts[:-1], starts[1:])]
    raise ValueError(f"host stage has no [{sum(rows)}, dim] embedding weight for tables {rows}")
