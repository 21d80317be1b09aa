"""Device specs: what a card (or the host) can do, as plain data.

The partitioner's cost model and the simulated card read the same numbers, so
an estimate and a simulation agree by construction. Named specs ship as JSON
files in ``backends/specs/``; a path to a JSON file works wherever a name does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DeviceSpec", "spec_names", "SPEC_DIR"]

SPEC_DIR = Path(__file__).parent / "specs"


@dataclass(frozen=True)
class DeviceSpec:
    """Capabilities of one device, enough for a roofline cost model."""

    name: str
    memory_bytes: int
    """Usable device memory."""
    peak_flops: dict[str, float]
    """Peak FLOP/s per dtype ("fp32", "fp16", "int8")."""
    memory_bandwidth: float
    """Device memory bandwidth, bytes/s."""
    link_bandwidth: float
    """Host <-> device bandwidth, bytes/s (PCIe); 0 for the host itself."""
    link_latency_s: float = 0.0
    """Fixed cost of one host <-> device transfer (launch + DMA setup)."""
    efficiency: float = 0.5
    """Fraction of peak FLOP/s a real batch reaches (the cost model's one fudge factor)."""
    kind: str = "card"
    """"card" (accelerator), "gpu", or "host"."""
    description: str = field(default="", compare=False)
    power_watts: float = 0.0
    """Typical board power (TDP), watts; 0: not known. Capacity planning (``sixfold-simulate``) sums it."""
    # Calibrated, op-level figures (``sixfold.backends.host.calibrate`` measures them). All optional: a spec
    # without them is priced by the roofline above; with any of them, a partition that carries
    # an op profile is priced op by op (``sixfold.partitioner.pricing.cost.stage_seconds``).
    matmul_efficiency: tuple[tuple[float, float], ...] = ()
    """(FLOPs of one matrix product, fraction of peak reached), rising FLOPs; interpolated in log
    space, clamped at the ends. A batched matmul of 256 products of 33x64x33 is keyed by one
    product's FLOPs, so it is priced like the small GEMM it is. Empty: ``efficiency`` everywhere."""
    gather_bandwidth: float = 0.0
    """Bytes/s of table rows read by a random-row gather (embedding lookups); 0: memory_bandwidth."""
    per_id_seconds: float = 0.0
    """Cost of one gathered index beyond its row's bytes (index arithmetic, a cache miss's latency)."""
    per_index_seconds: float = 0.0
    """Cost of one index of an element-wise index op (``index_select``/``gather``/``take``: ONNX
    Runtime's ``Gather`` in a dense partition, e.g. the interaction's upper-triangle pairs) beyond
    the bytes it moves. Such ops copy a few bytes per index, so this fixed cost is what they cost;
    0: ``per_id_seconds``."""
    per_op_seconds: float = 0.0
    """Fixed cost of launching one operator (dispatch, kernel launch)."""
    per_batch_seconds: float = 0.0
    """Fixed cost of one call into the runtime for a batch (entry, input/output binding)."""

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"spec {self.name}: memory_bytes must be > 0, got {self.memory_bytes}")
        if not self.peak_flops or min(self.peak_flops.values()) <= 0:
            raise ValueError(f"spec {self.name}: peak_flops needs positive values, got {self.peak_flops}")
        if self.memory_bandwidth <= 0:
            raise ValueError(f"spec {self.name}: memory_bandwidth must be > 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"spec {self.name}: efficiency must be in (0, 1], got {self.efficiency}")
        table = tuple((float(f), float(e)) for f, e in self.matmul_efficiency)  # JSON gives lists
        object.__setattr__(self, "matmul_efficiency", table)
        for flops, eff in table:
            if not (flops > 0 and 0 < eff <= 1):
                raise ValueError(f"spec {self.name}: matmul_efficiency entries need FLOPs > 0 and an efficiency "
                                 f"in (0, 1], got ({flops}, {eff})")
        if any(b[0] <= a[0] for a, b in zip(table, table[1:])):
            raise ValueError(f"spec {self.name}: matmul_efficiency FLOPs must rise strictly, got "
                             f"{[f for f, _ in table]}")
        for name in ("gather_bandwidth", "per_id_seconds", "per_index_seconds", "per_op_seconds",
                     "per_batch_seconds", "power_watts"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"spec {self.name}: {name} must be a finite number >= 0, got {value!r}")

    @property
    def calibrated(self) -> bool:
        """Whether any op-level figure is set, so op profiles are priced op by op."""
        return bool(self.matmul_efficiency) or any(
            getattr(self, n) > 0 for n in ("gather_bandwidth", "per_id_seconds", "per_index_seconds",
                                           "per_op_seconds", "per_batch_seconds"))

    def matmul_efficiency_at(self, product_flops: float) -> float:
        """Fraction of peak for a matrix product of ``product_flops`` FLOPs (``efficiency`` without a table)."""
        table = self.matmul_efficiency
        if not table:
            return self.efficiency
        if product_flops <= table[0][0]:
            return table[0][1]
        if product_flops >= table[-1][0]:
            return table[-1][1]
        x = math.log(product_flops)
        for (f0, e0), (f1, e1) in zip(table, table[1:]):
            if product_flops <= f1:
                t = (x - math.log(f0)) / (math.log(f1) - math.log(f0))
                return math.exp(math.log(e0) + t * (math.log(e1) - math.log(e0)))
        return table[-1][1]  # unreachable: the last bracket ends at table[-1]

    def matmul_seconds(self, flops: float, product_flops: float, dtype: str = "fp32") -> float:
        """Time of ``flops`` spent in matrix products of ``product_flops`` FLOPs each."""
        peak = self.peak_flops.get(dtype, self.peak_flops.get("fp32", max(self.peak_flops.values())))
        return flops / (peak * self.matmul_efficiency_at(product_flops))

    def gather_seconds(self, ids: float, row_bytes: float) -> float:
        """Time to gather ``ids`` random rows of ``row_bytes`` each (indices and output not included)."""
        bandwidth = self.gather_bandwidth or self.memory_bandwidth
        return ids * (self.per_id_seconds + row_bytes / bandwidth)

    def index_seconds(self, indices: float) -> float:
        """Fixed cost of ``indices`` indices of an element-wise index op (bytes moved not included)."""
        return indices * (self.per_index_seconds or self.per_id_seconds)

    def flops(self, dtype: str = "fp32") -> float:
        """Achievable FLOP/s for ``dtype`` (falls back to fp32's peak)."""
        peak = self.peak_flops.get(dtype, self.peak_flops.get("fp32", max(self.peak_flops.values())))
        return peak * self.efficiency

    def compute_seconds(self, flops: float, memory_bytes: float, dtype: str = "fp32") -> float:
        """Roofline time: the slower of compute and memory traffic."""
        return max(flops / self.flops(dtype), memory_bytes / self.memory_bandwidth)

    def transfer_seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over the host link (0 on the host itself)."""
        if self.link_bandwidth <= 0:
            return 0.0
        return self.link_latency_s + nbytes / self.link_bandwidth

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeviceSpec":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown device spec fields {unknown}; known: {sorted(known)}")
        return cls(**data)


def spec_names() -> list[str]:
    """Names of the specs shipped in ``backends/specs/`` (``sixfold.backends.spec_catalog`` lists every source)."""
    return sorted(p.stem for p in SPEC_DIR.glob("*.json"))
