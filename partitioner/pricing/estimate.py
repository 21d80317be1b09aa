"""The plan's estimates: per-device batch time, memory and utilisation, the bottleneck and its bounds."""

from __future__ import annotations

from sixfold.partitioner.plan import DeviceEstimate, DeviceInfo, Estimates
from sixfold.partitioner.pricing.cost import PartitionCost, stage_seconds
from sixfold.partitioner.pricing.served_latency import price_lone_query

__all__ = ["estimate_plan"]


def estimate_plan(plan_devices: list[DeviceInfo], placements, costs: dict[str, PartitionCost],
                  io_bytes: dict[str, tuple[float, float]], batch_rows: int) -> Estimates:
    """Latency and throughput bounds of ``placements``: per device, then the slowest partition limits."""
    per_device: list[DeviceEstimate] = []
    rates: dict[str, float] = {}
    for device in plan_devices:
        names = [p.partition for p in placements if p.device == device.id]
        if not names:
            continue
        seconds = transfer = 0.0
        for name in names:
            in_per, out_per = io_bytes[name]
            seconds += stage_seconds(device.spec, costs[name], batch_rows, in_per * batch_rows, out_per * batch_rows)
            transfer += (device.spec.transfer_seconds(in_per * batch_rows)
                         + device.spec.transfer_seconds(out_per * batch_rows))
        memory = sum(costs[n].param_bytes for n in names)
        per_device.append(DeviceEstimate(device=device.id, partitions=names, memory_bytes=memory,
                                         memory_capacity=device.spec.memory_bytes,
                                         batch_seconds=seconds, utilisation=0.0, transfer_seconds=transfer))
    # Throughput bound: each partition's replicas share its load; the slowest stage limits.
    for name in costs:
        replicas = [d for d in per_device if name in d.partitions]
        rates[name] = sum(batch_rows / d.batch_seconds for d in replicas if d.batch_seconds > 0) or float("inf")
    bottleneck = min(rates, key=rates.get)
    bound = rates[bottleneck]
    for d in per_device:
        replicas = sum(1 for x in per_device if set(x.partitions) == set(d.partitions))
        d.utilisation = min(1.0, bound / replicas * d.batch_seconds / batch_rows) if batch_rows else 0.0
    latency = sum(max(d.batch_seconds for d in per_device if name in d.partitions) for name in costs)
    devices = {d.id: d for d in plan_devices}

    def lone(rows: int, host: bool) -> float:
        """A ``rows``-item batch through the host's partitions (``host``) or the cards' (slowest replica each)."""
        total = 0.0
        for name in costs:
            on = [devices[p.device] for p in placements if p.partition == name]
            if on and (on[0].id == "host") == host:
                in_per, out_per = io_bytes[name]
                total += max(stage_seconds(d.spec, costs[name], rows, in_per * rows, out_per * rows) for d in on)
        return total

    served = price_lone_query(lambda r: lone(r, True), lambda r: lone(r, False))
    return Estimates(batch_rows=batch_rows, per_device=per_device, bottleneck=bottleneck,
                     throughput_items_per_s=bound, latency_ms=latency * 1e3, served=served.to_dict())
