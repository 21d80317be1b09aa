"""Cost model inputs measured from a partition: FLOPs, weight bytes, bytes per item.

FLOPs come from torch's FlopCounterMode on two real batch sizes, so the
per-item figure is exact for linear and bmm layers whatever the model; lookup
traffic comes from the embedding weights' row width and the ids per item.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from backends.spec import DeviceSpec

from .sparse_dense import is_embedding_lookup

__all__ = ["PartitionCost", "module_param_bytes", "flops_per_item", "lookup_bytes_per_id",
           "stage_seconds"]


@dataclass(frozen=True)
class PartitionCost:
    param_bytes: int
    flops_per_item: float
    bytes_per_item: float
    """Bytes read or written per item beyond the weights (lookups, activations)."""
    weight_bytes_per_batch: int
    """Weight bytes a batch reads in full: all of a dense partition's, none of a table's."""
    dtype: str = "fp32"
    """Compute dtype: picks the device's peak FLOP/s (``DeviceSpec.peak_flops[dtype]``)."""


def module_param_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _count_flops(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        module(*args)
    return counter.get_total_flops()


def flops_per_item(module: torch.nn.Module, small: tuple[torch.Tensor, ...], small_rows: int,
                   large: tuple[torch.Tensor, ...], large_rows: int) -> float:
    """Marginal FLOPs per batch row, from two real runs (fixed costs cancel)."""
    if large_rows <= small_rows:
        raise ValueError("large_rows must exceed small_rows")
    return (_count_flops(module, large) - _count_flops(module, small)) / (large_rows - small_rows)


def _attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def lookup_bytes_per_id(gm: fx.GraphModule) -> float:
    """Bytes one id reads: the widest lookup's row (dim x element size) plus the id itself."""
    widths = []
    for node in gm.graph.nodes:
        weight = node.args[0] if is_embedding_lookup(node) else None
        if not isinstance(weight, fx.Node):
            continue
        val = weight.meta.get("val")
        if val is None and weight.op == "get_attr":
            val = _attr(gm, str(weight.target))
        if isinstance(val, torch.Tensor) and val.dim() == 2:
            widths.append(int(val.shape[1]) * val.element_size())
    return float(max(widths, default=0)) + 8.0


def stage_seconds(device: DeviceSpec, cost: PartitionCost, rows: int, in_bytes: float,
                  out_bytes: float, dtype: str | None = None) -> float:
    """Modelled time of one batch on ``device``: transfers in and out plus roofline compute.

    Dense weights are read once per batch, table rows only as looked up
    (``bytes_per_item``); per-item traffic scales with rows. This is
    the same formula the simulated card uses, so plan and simulation agree.
    """
    compute = device.compute_seconds(cost.flops_per_item * rows, cost.weight_bytes_per_batch + cost.bytes_per_item * rows,
                                     dtype or cost.dtype)
    return device.transfer_seconds(in_bytes) + compute + device.transfer_seconds(out_bytes)
