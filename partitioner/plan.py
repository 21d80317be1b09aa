"""PartitionPlan: what runs where, as plain data that round-trips through JSON.

The plan never holds a device handle or a tensor: it can be written, read,
diffed and explained without loading anything (Glow's partitioner -> DAG
split, StyLE.md lesson 2).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sixfold.backends.api import TensorLayout
from sixfold.backends.spec import DeviceSpec

from sixfold.partitioner.pricing.tiers import TierPricing

__all__ = ["TensorInfo", "PartitionInfo", "DeviceInfo", "Placement", "DeviceEstimate",
           "Estimates", "TableShard", "PartitionPlan", "PLAN_FORMAT_VERSION"]

PLAN_FORMAT_VERSION = 1


@dataclass
class TensorInfo:
    name: str
    datatype: str
    """KServe v2 datatype (FP32, INT32, INT64)."""
    shape: list[int]
    """-1 for a dimension that varies per request."""
    rows_per_item: int | None = None
    """Rows per batch item (k: item i's rows are [i*k, (i+1)*k)); None: ragged (see ``ragged_by``) or,
    in a plan written before layouts were recorded, unknown. A batch is split only on known k."""
    ragged_by: str | None = None
    """Ragged rows (one per id): the model input whose per-item sums count each item's rows."""
    consumed: bool = True
    """A partition input the partition reads (False: it only passes it on to a later pipeline stage)."""
    passed_on: bool = False
    """A partition input a later pipeline stage reads too (carried past this partition unchanged)."""

    def layout(self) -> TensorLayout:
        return TensorLayout(rows_per_item=self.rows_per_item, ragged_by=self.ragged_by, consumed=self.consumed,
                            passed_on=self.passed_on)


@dataclass
class PartitionInfo:
    name: str
    kind: str
    """"sparse" (embedding lookups, host) or "dense" (MLPs and interaction, cards)."""
    format: str
    """Artifact format: "torch-fx" (host stage) or "onnx"."""
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    nodes: list[str]
    """Names of the graph nodes in this partition (for explanation and checks)."""
    param_bytes: int
    flops_per_item: float
    bytes_per_item: float
    artifact: str | None = None
    """File of the artifact relative to the plan, when written to disk."""
    dtype: str = "fp32"
    """Compute dtype of the partition ("fp32", "fp16"): what the cost model prices it at."""
    unsplittable: str = ""
    """Why a batch's rows of this partition can never be split across cards or merged from parts
    (a ragged input, say); empty: every input and output has known rows per item."""

    def layouts(self) -> dict[str, TensorLayout]:
        """Each input's and output's layout, as ``PartitionArtifact.layouts`` carries it to a backend."""
        return {t.name: t.layout() for t in [*self.inputs, *self.outputs]}


@dataclass
class DeviceInfo:
    id: str
    """"host" or "card0".."cardN-1"."""
    spec: DeviceSpec


@dataclass
class Placement:
    partition: str
    device: str
    replica: int = 0


@dataclass
class DeviceEstimate:
    device: str
    partitions: list[str]
    memory_bytes: int
    memory_capacity: int
    batch_seconds: float
    """Modelled time for one batch of ``Estimates.batch_rows`` rows on this device."""
    utilisation: float
    """Share of time busy at the plan's throughput bound."""
    transfer_seconds: float = 0.0
    """Part of ``batch_seconds`` spent moving inputs and outputs over the device's link."""


@dataclass
class Estimates:
    batch_rows: int
    per_device: list[DeviceEstimate]
    bottleneck: str
    throughput_items_per_s: float
    latency_ms: float
    """Unloaded latency of one batch: host stage + transfers + card stage."""
    served: dict[str, Any] | None = None
    """A lone query's latency terms at any size, serving path included (``sixfold.partitioner.pricing.served_latency
    .ServedLatency.to_dict``); None in plans made before it."""


@dataclass
class TableShard:
    """A block of one embedding table (rows x columns) on one device (sixfold.partitioner.placement.sharding)."""

    table: int
    device: str
    """"host" or a card id."""
    kind: str
    """"table" (whole table), "row" (a row range) or "column" (a column range)."""
    row_start: int
    row_end: int
    col_start: int
    col_end: int
    bytes: int
    est_seconds: float
    """Modelled lookup time per batch (gather + link bytes; the per-transfer latency is per device)."""


@dataclass
class PartitionPlan:
    model: str
    strategy: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    partitions: list[PartitionInfo]
    devices: list[DeviceInfo]
    placements: list[Placement]
    estimates: Estimates
    tables: dict[str, Any] = field(default_factory=dict)
    """Per-table facts the server needs: {"rows": [...], "dim": D, "pooling": [...]}."""
    shards: list[TableShard] = field(default_factory=list)
    """Where table blocks live when tables go on cards; empty: every table on the host."""
    format_version: int = PLAN_FORMAT_VERSION
    tiers: TierPricing | None = None
    """The table tiers priced at the budgets ``sixfold-partition --table-memory`` was given (hit rate,
    distinct misses and host time per batch, the disk and Zipf exponent used); None: not priced.
    Optional in plan.json: a plan written without it loads with None."""

    def partition(self, name: str) -> PartitionInfo:
        for p in self.partitions:
            if p.name == name:
                return p
        raise KeyError(f"plan has no partition {name!r}; it has {[p.name for p in self.partitions]}")

    def resize_partition(self, name: str, param_bytes: int) -> None:
        """Record a partition's new weight size (e.g. after quantizing it); the devices holding it
        get the difference back in their memory estimate."""
        info = self.partition(name)
        saved = info.param_bytes - param_bytes
        info.param_bytes = param_bytes
        for d in self.estimates.per_device:
            if name in d.partitions:
                d.memory_bytes = max(0, d.memory_bytes - saved)

    def device(self, device_id: str) -> DeviceInfo:
        for d in self.devices:
            if d.id == device_id:
                return d
        raise KeyError(f"plan has no device {device_id!r}")

    def devices_of(self, partition: str) -> list[str]:
        return [p.device for p in self.placements if p.partition == partition]

    def dense_stages(self) -> list[str]:
        """Dense partitions in pipeline order: ["dense"] when replicated, ["dense.0", "dense.1", ...] when pipelined."""
        dense = [p.name for p in self.partitions if p.kind == "dense"]
        return sorted(dense, key=lambda n: int(n.rsplit(".", 1)[1]) if "." in n else -1)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PartitionPlan":
        version = data.get("format_version")
        if version != PLAN_FORMAT_VERSION:
            raise ValueError(f"plan format_version {version!r}; this sixfold reads {PLAN_FORMAT_VERSION}")
        tensors = lambda items: [TensorInfo(**t) for t in items]  # noqa: E731
        est = data["estimates"]
        return cls(
            model=data["model"], strategy=data["strategy"],
            inputs=tensors(data["inputs"]), outputs=tensors(data["outputs"]),
            partitions=[PartitionInfo(**{**p, "inputs": tensors(p["inputs"]),
                                         "outputs": tensors(p["outputs"])}) for p in data["partitions"]],
            devices=[DeviceInfo(id=d["id"], spec=DeviceSpec.from_dict(d["spec"])) for d in data["devices"]],
            placements=[Placement(**p) for p in data["placements"]],
            estimates=Estimates(**{**est, "per_device": [DeviceEstimate(**d) for d in est["per_device"]]}),
            shards=[TableShard(**s) for s in data.get("shards", [])],
            tables=data.get("tables", {}), format_version=version,
            tiers=TierPricing.from_dict(data["tiers"]) if data.get("tiers") else None,
        )

    @classmethod
    def from_json(cls, text: str) -> "PartitionPlan":
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | Path) -> "PartitionPlan":
        return cls.from_json(Path(path).read_text())
