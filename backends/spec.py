"""Device specs: what a card (or the host) can do, as plain data.

The partitioner's cost model and the simulated card read the same numbers, so
an estimate and a simulation agree by construction. Named specs ship as JSON
files in ``backends/specs/``; a path to a JSON file works wherever a name does.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DeviceSpec", "load_spec", "spec_names", "SPEC_DIR"]

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

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"spec {self.name}: memory_bytes must be > 0, got {self.memory_bytes}")
        if not self.peak_flops or min(self.peak_flops.values()) <= 0:
            raise ValueError(f"spec {self.name}: peak_flops needs positive values, got {self.peak_flops}")
        if self.memory_bandwidth <= 0:
            raise ValueError(f"spec {self.name}: memory_bandwidth must be > 0")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"spec {self.name}: efficiency must be in (0, 1], got {self.efficiency}")

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
    return sorted(p.stem for p in SPEC_DIR.glob("*.json"))


def load_spec(name_or_path: str | Path) -> DeviceSpec:
    """A shipped spec by name (``m2-card``) or any JSON file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = SPEC_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise FileNotFoundError(f"no device spec {str(name_or_path)!r}; shipped specs: {', '.join(spec_names())}")
    return DeviceSpec.from_dict(json.loads(path.read_text()))
