"""A platform to simulate: a model's plan on a host and N cards, each stage priced by the cost model.

``build_platform`` partitions a built-in model (plan only: no ONNX export) and keeps, per
stage, what ``sixfold.partitioner.pricing.cost.stage_seconds`` needs to price a batch of any size on its
device: the ``PartitionCost`` (with its op profile, so a calibrated host spec prices the
host stage op by op) and the bytes per item crossing the device's link. Those are the
figures the printed plan's estimates come from, so the simulation and the plan agree.

The plan is made on tables capped at ``PROBE_ROWS`` rows: the cost of a lookup does not
depend on the table's length (the cost model prices ids and row bytes), and a full-size
model (dlrm-mlperf: ~90 GiB of tables) could not be built here. The full-size tables are
still counted, from the model's config, against the host spec's memory.

Precisions: ``table_precision`` prices each looked-up row at its packed size
(``sixfold.backends.host.host_embedding.bytes_per_row``); ``dense_precision`` "fp16" ("int8") prices the dense
partition at the card's fp16 (int8) peak with half (a quarter of) its weight bytes (what
``sixfold.partitioner.precision.dense.apply_dense_precision`` does to the plan).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from sixfold import models
from sixfold.backends.emulation_calibrate import EmulationCalibration
from sixfold.backends.host.host_embedding import PRECISIONS, bytes_per_row
from sixfold.backends.spec import DeviceSpec
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.pricing.cost import PartitionCost, stage_seconds
from sixfold.partitioner.pricing.emulated_card import DEFAULT_MIN_SPLIT_ROWS, EmulatedCards
from sixfold.partitioner.pricing.host_stage_fit import HostStageFit
from sixfold.partitioner.pricing.served_latency import ServingPath, _interpolate
from sixfold.partitioner.plan import PartitionPlan
from sixfold.partitioner.precision.dense import DENSE_PRECISIONS
from sixfold.partitioner.placement.strategy import ACTIVATION_HEADROOM
from sixfold.server.scheduling.admission import PER_REQUEST_S

__all__ = ["StageModel", "EmulatedStage", "MeasuredStage", "fit_stage", "Platform", "build_platform", "resolve_spec", "PROBE_ROWS", "DENSE_PRECISIONS"]

PROBE_ROWS = 10_000
"""Rows per table of the model the plan and its costs are measured on."""


@dataclass(eq=False)
class StageModel:
    """One stage on one device: modelled seconds of a batch of ``rows`` items (memoized per row count)."""

    name: str
    device: DeviceSpec
    cost: PartitionCost
    in_per_item: float = 0.0
    """Bytes per item sent to the device over its link."""
    out_per_item: float = 0.0
    _memo: dict[int, float] = field(default_factory=dict, repr=False)

    def seconds(self, rows: int) -> float:
        s = self._memo.get(rows)
        if s is None:
            s = self._memo[rows] = stage_seconds(self.device, self.cost, rows, self.in_per_item * rows,
                                                 self.out_per_item * rows)
        return s


@dataclass(eq=False)
class MeasuredStage(StageModel):
    """A stage priced by a measured line, ``fixed_s + per_item_s x rows`` (``fit_stage``), not the cost model."""

    fixed_s: float = 0.0
    per_item_s: float = 0.0

    def seconds(self, rows: int) -> float:
        return self.fixed_s + self.per_item_s * rows


class _Sharing:
    """The emulated cards computing now, on the simulator's virtual clock: each lane's last priced finish."""

    def __init__(self) -> None:
        self.busy_until: dict[str, float] = {}
        self.loop: object | None = None

    def price(self, lane: str, seconds_at: Callable[[int], float]) -> float:
        """``seconds_at(k)`` with ``k`` the lanes busy now (this one included), recorded as this lane's finish."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # priced outside a simulation (a report, a bound): alone
            return seconds_at(1)
        if loop is not self.loop:  # a new simulation (its own virtual clock): nothing computes yet
            self.loop = loop
            self.busy_until.clear()
        now = loop.time()
        k = 1 + sum(1 for name, until in self.busy_until.items() if name != lane and until > now)
        seconds = seconds_at(k)
        self.busy_until[lane] = now + seconds
        return seconds


@dataclass(eq=False)
class TimedStage(StageModel):
    """A stage priced by the (rows, seconds) points the server timed at load (``pricing.loaded_stages``)."""

    points: tuple[tuple[int, float], ...] = ()

    def seconds(self, rows: int) -> float:
        return _interpolate(self.points, rows)


@dataclass(eq=False)
class EmulatedStage(StageModel):
    """A card emulated on this host's cores: ``EmulatedCards.part_seconds`` with the cards that compute at the
    same virtual moment sharing the cores (the parts of a split batch, priced as they are dispatched, see each
    other: the last part, which the batch waits for, is priced with all of them)."""

    emulated: EmulatedCards | None = None
    sharing: _Sharing | None = None

    def seconds(self, rows: int) -> float:
        spec = super().seconds
        flops = self.cost.flops_per_item
        return self.sharing.price(self.name, lambda k: self.emulated.part_seconds(flops, rows, k, spec))


def fit_stage(stage: StageModel, rows: list[int], seconds: list[float]) -> MeasuredStage:
    """``stage`` repriced by the least-squares line through measured (rows, seconds) points."""
    import numpy as np

    slope, intercept = np.polyfit(np.asarray(rows, dtype=float), np.asarray(seconds, dtype=float), 1)
    return MeasuredStage(stage.name, stage.device, stage.cost, stage.in_per_item, stage.out_per_item,
                         fixed_s=max(0.0, float(intercept)), per_item_s=max(0.0, float(slope)))


@dataclass(eq=False)
class Platform:
    """What a simulation runs: the plan, its stages' prices, and the facts capacity planning reports."""

    model: str
    plan: PartitionPlan | None
    """The plan (admission prices requests from it; None: no work-based admission)."""
    host: StageModel
    lanes: list[list[StageModel]]
    """Per card lane (a card, or a pipeline replica's cards), its dense stages in order."""
    host_dense: StageModel | None
    """The dense partition on the host CPU (small batches may run there); None: no fallback."""
    card_spec: DeviceSpec
    host_spec: DeviceSpec
    cards: int
    """Cards on the platform (those the plan leaves idle included: they are bought and powered)."""
    ids_per_item: float
    """Mean looked-up ids per item (sum of the tables' pooling)."""
    table_bytes: int
    """Host memory the tables take at full size (or ``max_rows``) in ``table_precision``."""
    table_precision: str = "fp32"
    dense_precision: str = "fp32"
    per_request_s: float = PER_REQUEST_S
    """Serving cost of one request on the event loop (decode, validate, queue, encode)."""
    per_item_s: float = 0.0
    """Front-end cost per item of a request (the id checks of validation grow with the ids)."""
    serving_path: ServingPath | None = None
    """The serving path a request pays outside the stages (decode .. encode, gRPC both ways), calibrated on this
    host (``sixfold.partitioner.pricing.served_latency``): what of it the front end's costs above do not already
    charge is added to every answered request as a delay (no shared resource: gRPC's own threads and the client).
    None: not priced (a spec-only what-if of another host)."""
    emulated: EmulatedCards | None = None
    """The cards are emulated on this host's cores and priced at the speed they reach here; None: at their spec."""

    def path_delay_s(self, items: int) -> float:
        """The serving path's delay for an ``items``-item request beyond the front end's charged costs."""
        if self.serving_path is None:
            return 0.0
        return max(0.0, self.serving_path.seconds(items, self.ids_per_item) - self.per_request_s
                   - self.per_item_s * items)

    @property
    def power_watts(self) -> float:
        """The cards' power (``DeviceSpec.power_watts`` x cards); 0 when the spec does not say."""
        return self.cards * self.card_spec.power_watts

    @property
    def label(self) -> str:
        return f"{self.model} on {self.cards} x {self.card_spec.name}"

    def throughput_items_per_s(self) -> float:
        """The plan-style bound at 256-item batches: the slowest of host, lanes and event loop."""
        rows = 256

        def rate(seconds: float) -> float:
            return rows / seconds if seconds > 0 else float("inf")

        return min(rate(self.host.seconds(rows)), sum(rate(max(s.seconds(rows) for s in lane)) for lane in self.lanes))

    def describe(self) -> str:
        rows = 256
        lane = self.lanes[0]
        card_ms = sum(s.seconds(rows) for s in lane) * 1e3
        cards = self.emulated.describe() if self.emulated else "cards at their spec"
        return (f"{self.label} (host {self.host_spec.name}; {cards}; tables {self.table_precision}, dense "
                f"{self.dense_precision}): per {rows}-item batch host {self.host.seconds(rows) * 1e3:.3f} ms, "
                f"card lane {card_ms:.3f} ms x {len(self.lanes)} lanes"
                + (f", host dense {self.host_dense.seconds(rows) * 1e3:.3f} ms" if self.host_dense else "")
                + f"; bound {self.throughput_items_per_s():,.0f} items/s")


def resolve_spec(name_or_path: str | DeviceSpec, what: str) -> DeviceSpec:
    """A spec by name or path; ValueError naming the argument ``what`` when there is none."""
    if isinstance(name_or_path, DeviceSpec):
        return name_or_path
    try:
        return load_spec(name_or_path)
    except FileNotFoundError as exc:
        raise ValueError(f"{what}: {exc.args[0]}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{what}: spec file {name_or_path!r} is not a device spec ({exc})") from None


_PLANS: dict[tuple, object] = {}


def _partition(model: str, cards: int, card: DeviceSpec, host: DeviceSpec, strategy: str):  # noqa: ANN202
    """The plan-only partition, cached per process (a sweep plans each platform once)."""
    key = (model, cards, json.dumps(card.to_dict(), sort_keys=True), json.dumps(host.to_dict(), sort_keys=True),
           strategy)
    if key not in _PLANS:
        if len(_PLANS) >= 64:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = partition_builtin(model, max_rows=PROBE_ROWS, cards=cards, card_spec=card, host_spec=host,
                                        strategy=strategy, compile=False)[1]
    return _PLANS[key]


def _table_precision(cost: PartitionCost, precision: str, dim: int, ids_per_item: float) -> PartitionCost:
    """The host stage's cost with each looked-up row read at its packed size in ``precision``."""
    if precision == "fp32":
        return cost
    row = float(bytes_per_row(precision, dim))
    ops = tuple(dataclasses.replace(op, row_bytes=row) if op.kind == "gather" and op.row_bytes >= 4 * dim
                else op for op in cost.ops)
    return dataclasses.replace(cost, bytes_per_item=ids_per_item * (row + 8.0), ops=ops)


def _dense_precision(cost: PartitionCost, precision: str) -> PartitionCost:
    if precision == "fp32":
        return cost
    shrink = {"fp16": 2, "int8": 4}[precision]  # bytes of an fp32 weight / one at this precision
    weights = cost.param_bytes // shrink
    ops = tuple(dataclasses.replace(op, bytes=(op.bytes[0] / shrink, op.bytes[1] / shrink)) for op in cost.ops)
    return dataclasses.replace(cost, dtype=precision, param_bytes=weights, weight_bytes_per_batch=weights,
                               ops=ops)


def build_platform(model: str, *, cards: int = 6, card_spec: str | DeviceSpec = "m2-card",
                   host_spec: str | DeviceSpec = "host-cpu", table_precision: str = "fp32",
                   dense_precision: str = "fp32", max_rows: int | None = None, strategy: str = "auto",
                   host_dense: bool = True, per_request_s: float = PER_REQUEST_S,
                   host_memory_bytes: int | None = None, serving_path: ServingPath | None = None,
                   emulation: EmulationCalibration | None = None,
                   host_stage_fit: HostStageFit | None = None) -> Platform:
    """Plan ``model`` on ``cards`` cards of ``card_spec`` plus the host, priced for simulation.

    ``emulation``: the cards are emulated on this host (as ``sixfold-serve --backend auto`` runs them with no
    accelerator): each single-stage lane is priced at the speed the emulation reaches here
    (``pricing.emulated_card``), the spec's time the floor; None: at the spec (a what-if of cards not bought).
    ``host_stage_fit``: the host stage's cost per id measured on this host (``pricing.host_stage_fit``) prices the
    host stage instead of the host spec; None: the host spec.

    Raises ValueError naming the argument at fault: an unknown model or spec, no cards, a
    precision that does not exist, tables that do not fit the host, a dense part no card fits.
    """
    if model not in models.names():
        raise ValueError(f"--model: unknown model {model!r}; built-in: {', '.join(models.names())}")
    if not isinstance(cards, int) or cards < 1:
        raise ValueError(f"--cards must be >= 1, got {cards!r}")
    if table_precision not in PRECISIONS:
        raise ValueError(f"--table-precision: unknown {table_precision!r}; known: {', '.join(PRECISIONS)}")
    if dense_precision not in DENSE_PRECISIONS:
        raise ValueError(f"--dense-precision: unknown {dense_precision!r}; known: {', '.join(DENSE_PRECISIONS)}")
    if not per_request_s >= 0:
        raise ValueError(f"--per-request-us must be >= 0, got {per_request_s * 1e6}")
    card = resolve_spec(card_spec, "--card-spec")
    host = resolve_spec(host_spec, "--host-spec")
    if host_memory_bytes is not None:
        if host_memory_bytes <= 0:
            raise ValueError(f"--host-memory-gib must be > 0, got {host_memory_bytes / 2**30:g}")
        host = dataclasses.replace(host, memory_bytes=int(host_memory_bytes))
    config = models.get_config(model, max_rows=max_rows)
    table_bytes = sum(config.table_rows) * bytes_per_row(table_precision, config.embedding_dim)
    if table_bytes > host.memory_bytes:
        raise ValueError(f"--host-spec: {model}'s tables need {table_bytes / 2**30:.1f} GiB in {table_precision} "
                         f"({'full size' if max_rows is None else f'--max-rows {max_rows}'}); host "
                         f"{host.name} has {host.memory_bytes / 2**30:.1f} GiB (--host-memory-gib sets it; or try "
                         "--table-precision int8)")
    try:
        partitioned = _partition(model, cards, card, host, strategy)
    except ValueError as exc:  # PlanError: quotes the numbers
        raise ValueError(f"--card-spec {card.name}: {exc}") from None
    plan = partitioned.plan
    ids_per_item = float(sum(config.pooling))
    host_cost = _table_precision(partitioned.costs[HOST_PARTITION], table_precision, config.embedding_dim,
                                 ids_per_item)
    host_stage: StageModel = StageModel("host", host, host_cost)
    if host_stage_fit is not None:
        host_stage = MeasuredStage("host", host, host_cost, fixed_s=host_stage_fit.fixed_s,
                                   per_item_s=host_stage_fit.per_item_s(ids_per_item, len(config.pooling)))
    stages = plan.dense_stages()
    timing = None
    if emulation is not None and stages == [DENSE_PARTITION]:  # the server timed this plan here: its figures
        from sixfold.partitioner.pricing.loaded_stages import load_stage_timing, plan_fingerprint
        dense_part = next(p for p in plan.partitions if p.name == DENSE_PARTITION)
        timing = load_stage_timing(plan_fingerprint(
            model, dense_part, {"rows": config.table_rows, "pooling": config.pooling, "dim": config.embedding_dim},
            len(plan.devices_of(DENSE_PARTITION)), DEFAULT_MIN_SPLIT_ROWS, True))
    if timing is not None and len(timing.host) >= 2:
        host_stage = TimedStage("host", host, host_cost, points=timing.host)
    lanes: list[list[StageModel]] = []
    if stages == [DENSE_PARTITION]:
        dense_cost = _dense_precision(partitioned.costs[DENSE_PARTITION], dense_precision)
        if dense_cost.param_bytes * ACTIVATION_HEADROOM > card.memory_bytes:
            raise ValueError(f"--card-spec {card.name}: the dense partition needs "
                             f"{dense_cost.param_bytes * ACTIVATION_HEADROOM / 2**30:.2f} GiB")
        io = partitioned.io_bytes[DENSE_PARTITION]
        devices = plan.devices_of(DENSE_PARTITION)
        if emulation is not None:
            emulated = EmulatedCards(emulation, len(devices), timing=timing)
            sharing = _Sharing()
            lanes = [[EmulatedStage(device, plan.device(device).spec, dense_cost, *io, emulated=emulated,
                                    sharing=sharing)] for device in devices]
        else:
            lanes = [[StageModel(device, plan.device(device).spec, dense_cost, *io)] for device in devices]
    else:  # a pipeline: one lane per replica, its stages in order
        replicas: dict[int, list[StageModel]] = {}
        for p in sorted(plan.placements, key=lambda p: (p.replica, stages.index(p.partition)
                                                          if p.partition in stages else -1)):
            if p.partition in stages:
                cost = _dense_precision(partitioned.costs[p.partition], dense_precision)
                replicas.setdefault(p.replica, []).append(
                    StageModel(f"{p.device}:{p.partition}", plan.device(p.device).spec, cost,
                               *partitioned.io_bytes[p.partition]))
        lanes = [replicas[r] for r in sorted(replicas)]
    dense_on_host = None
    if host_dense and stages == [DENSE_PARTITION]:
        # NOTE: as sixfold.server.loading.loader: the dense ONNX on onnxruntime on the host, priced on the host spec (no link).
        dense_on_host = StageModel("host-dense", host, _dense_precision(partitioned.costs[DENSE_PARTITION],
                                                                        dense_precision))
    return Platform(model=model, plan=plan, host=host_stage, lanes=lanes, host_dense=dense_on_host,
                    card_spec=card, host_spec=host, cards=cards, ids_per_item=ids_per_item,
                    table_bytes=table_bytes, table_precision=table_precision, dense_precision=dense_precision,
                    per_request_s=per_request_s, serving_path=serving_path,
                    emulated=lanes[0][0].emulated if isinstance(lanes[0][0], EmulatedStage) else None)

