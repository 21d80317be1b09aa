"""Persist a torch host (sparse) partition that is not plain tables: as a ``torch.export`` archive.

The zoo's host stage is one table-batched embedding, written as row-wise table
files the host-embedding backend maps from disk. Any other host graph (a user's
model with its own lookups, id hashing, per-table modules) is saved whole as
``host.pt2`` and runs on the torch backend, so a repository version folder is
self-contained whatever the model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sixfold.models.signature import DENSE, INDICES, LENGTHS

from sixfold.partitioner.plan import PartitionPlan

__all__ = ["export_host_program", "example_host_inputs", "unguarded_module"]


def example_host_inputs(plan: PartitionPlan, input_names: list[str], rows: int = 4) -> tuple[torch.Tensor, ...]:
    """A valid canonical request for the host inputs: the traced pooling, id 0 everywhere."""
    shapes = {t.name: t.shape for t in plan.inputs}
    tables = shapes[LENGTHS][1] if LENGTHS in shapes else 1
    pooling = plan.tables.get("pooling") or [1] * tables  # as traced: fixed-pooling models reshape by it
    lengths = torch.tensor([pooling] * rows, dtype=torch.int32)
    made = {DENSE: torch.zeros(rows, shapes.get(DENSE, [-1, 1])[1]),
            LENGTHS: lengths,
            INDICES: torch.zeros(int(lengths.sum()), dtype=torch.int64)}
    missing = [n for n in input_names if n not in made]
    if missing:
        raise ValueError(f"host partition takes {missing}; only the canonical inputs can be saved as host.pt2")
    return tuple(made[n] for n in input_names)


def export_host_program(module: torch.nn.Module, plan: PartitionPlan, input_names: list[str],
                        path: str | Path) -> Path:
    """Export the host module with dynamic batch and id count and save it to ``path``."""
    example = example_host_inputs(plan, input_names)
    # The batch may be a single item at serve time: say so, or export would assume >= 2. The id count
    # is its own dimension for jagged models; a fixed-pooling model ties it to the batch (ids = k x batch).
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    per_item = example[input_names.index(INDICES)].shape[0] // example[0].shape[0] if INDICES in input_names else 0
    auto = torch.export.Dim.AUTO
    attempts = [tuple({0: torch.export.Dim("ids", min=0, max=1 << 30) if n == INDICES else batch}
                      for n in input_names)]
    if per_item:
        attempts.append(tuple({0: per_item * batch if n == INDICES else batch} for n in input_names))
    attempts.append(tuple({0: auto} for _ in input_names))  # whatever the archive itself allows
    for i, dynamic in enumerate(attempts):
        try:
            with torch.no_grad():
                program = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
            break
        except torch._dynamo.exc.UserError:
            if i == len(attempts) - 1:
                raise
    path = Path(path)
    torch.export.save(program, str(path))
    return path


def unguarded_module(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """``program.module()`` without its input-guard call: torch.export pins assumptions of its own there (an id
    count of ``3 x batch`` with ``batch != 1``: "Guard failed: sparse_indices.size()[0] // 3 != 1") that the
    partitioner's piece check has already shown the host stage does not need (it runs at 1, 2, 3, 7 and 64 items),
    and the server validates every request's shapes itself."""
    module = program.module()
    guards = [n for n in module.graph.nodes if n.op == "call_module" and str(n.target).startswith("_guards_fn")]
    for node in guards:
        module.graph.erase_node(node)
    if guards:
        module.recompile()
    return module
