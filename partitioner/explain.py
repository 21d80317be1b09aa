"""Say what the plan decided: a table per device, the bottleneck and its throughput bound."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from .plan import PartitionPlan

__all__ = ["plan_table", "print_plan", "human_bytes"]


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def plan_table(plan: PartitionPlan) -> Table:
    est = plan.estimates
    table = Table(title=f"{plan.model}: {plan.strategy} on {len(plan.devices) - 1} cards + host "
                        f"(estimates per batch of {est.batch_rows} items)")
    for column in ("device", "spec", "partitions", "memory", "est. ms/batch", "utilisation"):
        table.add_column(column, justify="right" if column not in ("device", "spec", "partitions") else "left")
    for d in est.per_device:
        spec = plan.device(d.device).spec.name
        table.add_row(d.device, spec, ", ".join(d.partitions),
                      f"{human_bytes(d.memory_bytes)} / {human_bytes(d.memory_capacity)}",
                      f"{d.batch_seconds * 1e3:.3f}", f"{d.utilisation:.0%}")
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
    console.print(f"  bottleneck: [bold]{est.bottleneck}[/]; throughput bound "
                  f"{est.throughput_items_per_s:,.0f} items/s; unloaded latency {est.latency_ms:.2f} ms")
