"""Say what the plan decided: a table per device, the bottleneck and its throughput bound."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from sixfold.partitioner.plan import PartitionPlan

__all__ = ["plan_table", "print_plan", "human_bytes", "shard_table"]


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def plan_table(plan: PartitionPlan) -> Table:
    est = plan.estimates
    table = Table(title=f"{plan.model}: {plan.strategy} on {len(plan.devices) - 1} cards + host "
                        f"(estimates per batch of {est.batch_rows} items)")
    for column in ("device", "spec", "partitions", "memory", "est. ms/batch", "transfer ms", "utilisation"):
        table.add_column(column, justify="right" if column not in ("device", "spec", "partitions") else "left")
    for d in est.per_device:
        spec = plan.device(d.device).spec.name
        table.add_row(d.device, spec, ", ".join(d.partitions),
                      f"{human_bytes(d.memory_bytes)} / {human_bytes(d.memory_capacity)}",
                      f"{d.batch_seconds * 1e3:.3f}", f"{d.transfer_seconds * 1e3:.3f}", f"{d.utilisation:.0%}")
    return table


def print_plan(plan: PartitionPlan, console: Console | None = None) -> None:
    console = console or Console()
    console.print(plan_table(plan))
    est = plan.estimates
    for p in plan.partitions:
        console.print(f"  [bold]{p.name}[/] ({p.kind}, {p.format}): {len(p.nodes)} nodes, "
                      f"weights {human_bytes(p.param_bytes)}, {p.flops_per_item / 1e6:.2f} MFLOP/item, "
                      f"{human_bytes(p.bytes_per_item)}/item; inputs "
                      f"{', '.join(i.name for i in p.inputs)} -> {', '.join(o.name for o in p.outputs)}")
    stages = plan.dense_stages()
    if len(stages) > 1:
        replicas = len({p.replica for p in plan.placements if p.partition == stages[0]})
        used = {p.device for p in plan.placements}
        idle = [d.id for d in plan.devices if d.id not in used]
        console.print(f"  pipeline: {len(stages)} stages x {replicas} replicas"
                      + (f"; idle: {', '.join(idle)}" if idle else ""))
        for a, b in zip(stages[:-1], stages[1:]):
            console.print(f"    {a} -> {b}: {', '.join(t.name for t in plan.partition(b).inputs)}")
    if plan.shards:
        _print_shards(plan, console)
    console.print(f"  bottleneck: [bold]{est.bottleneck}[/]; throughput bound "
                  f"{est.throughput_items_per_s:,.0f} items/s; unloaded latency {est.latency_ms:.2f} ms")
    if plan.tiers is not None:
        from sixfold.partitioner.pricing.tiers import print_pricing
        print_pricing(plan.tiers, console, title="table tiers (priced with the plan)")


def _block(s) -> str:
    if s.kind == "row":
        return f"t{s.table}[r{s.row_start}:{s.row_end}]"
    if s.kind == "column":
        return f"t{s.table}[c{s.col_start}:{s.col_end}]"
    return f"t{s.table}"


def shard_table(plan: PartitionPlan) -> Table:
    """Embedding table blocks per device (``--sparse-on-cards``): which, how many bytes, lookup time per batch."""
    from rich.markup import escape

    info = plan.tables.get("sharding", {})
    loads = info.get("loads", {})
    table = Table(title=f"embedding tables: {info.get('mode', '?')}-wise on cards "
                        f"(lookups per batch of {info.get('batch_rows', plan.estimates.batch_rows)} items)")
    for column in ("device", "tables", "bytes", "est. ms/batch"):
        table.add_column(column, justify="left" if column in ("device", "tables") else "right")
    devices = list(dict.fromkeys(s.device for s in plan.shards))
    for device in devices:
        mine = [s for s in plan.shards if s.device == device]
        seconds = loads.get(device, sum(s.est_seconds for s in mine))
        mark = " *" if device == info.get("bottleneck") else ""
        table.add_row(device + mark, escape(", ".join(_block(s) for s in mine)),  # "[r0:10]" is not markup
                      human_bytes(sum(s.bytes for s in mine)), f"{seconds * 1e3:.3f}")
    return table


def _print_shards(plan: PartitionPlan, console: Console) -> None:
    info = plan.tables.get("sharding", {})
    console.print(shard_table(plan))
    if info:
        console.print(f"  table lookups bottleneck (*): [bold]{info['bottleneck']}[/] "
                      f"{info['bottleneck_seconds'] * 1e3:.3f} ms/batch")
    for note in info.get("notes", []):
        console.print(f"  {note}")
