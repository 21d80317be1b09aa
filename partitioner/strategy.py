"""Placement strategies: given partition costs and devices, decide which device runs what.

Policy only: no graph, no tensors. ``replicate`` puts the dense partition on
every card that fits it (data parallel) and the sparse partition on the host.
"""

from __future__ import annotations

from .cost import PartitionCost
from .plan import DeviceInfo, Placement

__all__ = ["PlanError", "ACTIVATION_HEADROOM", "replicate"]

ACTIVATION_HEADROOM = 1.10
"""A card must hold the weights plus this fraction for activations and runtime."""


class PlanError(ValueError):
    """The model cannot be placed; the message quotes the numbers."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def replicate(host_partition: str, dense_partition: str, dense_cost: PartitionCost,
              host: DeviceInfo, cards: list[DeviceInfo]) -> list[Placement]:
    """Host runs the sparse partition; every card that fits the dense partition gets a replica."""
    if not cards:
        raise PlanError("no cards to place the dense partition on (need --cards >= 1)")
    need = int(dense_cost.param_bytes * ACTIVATION_HEADROOM)
    fitting = [c for c in cards if c.spec.memory_bytes >= need]
    if not fitting:
        largest = max(cards, key=lambda c: c.spec.memory_bytes)
        raise PlanError(
            f"dense partition needs {_gib(need)} (weights {_gib(dense_cost.param_bytes)} + "
            f"{ACTIVATION_HEADROOM - 1:.0%} headroom); largest card {largest.id} "
            f"({largest.spec.name}) has {_gib(largest.spec.memory_bytes)}")
    placements = [Placement(partition=host_partition, device=host.id)]
    placements += [Placement(partition=dense_partition, device=c.id, replica=i) for i, c in enumerate(fitting)]
    return placements
