"""Read each table's row count off the host graph itself, so the server can range-check ids per table.

A model file says nothing about which lookup serves which table. We ask the
graph: run the host partition on a request whose ids are their own positions
(``sparse_indices = arange``, ``pooling`` ids per (item, table)), and watch
what each lookup op reads. In the sample-major layout position ``p`` belongs to
table ``(p // pooling) % T``, so a lookup that reads only table ``t``'s
positions serves table ``t``, and its weight's first dimension is that table's
row count. Lookups run on clamped ids while probing, so no id is out of range.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from models.signature import DENSE, INDICES, LENGTHS

from .id_check import row_gather
from .sparse_dense import is_embedding_lookup

__all__ = ["probe_table_rows"]

log = logging.getLogger(__name__)


class _Probe(fx.Interpreter):
    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.reads: list[tuple[int, torch.Tensor]] = []

    def run_node(self, node: fx.Node):
        if row_gather(node) is not None:  # weight[ids] (per-sample weights, say): read at id 0 while probing
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            if node.target is torch.ops.aten.index.Tensor:
                return node.target(args[0], [torch.zeros_like(args[1][0])], **kwargs)
            return node.target(args[0], args[1], torch.zeros_like(args[2]), **kwargs)
        if node.op == "call_function" and is_embedding_lookup(node):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            weight, ids = args[0], args[1]
            if isinstance(weight, torch.Tensor) and isinstance(ids, torch.Tensor) and weight.dim() == 2:
                self.reads.append((int(weight.shape[0]), ids.detach().clone()))
                args = (weight, torch.zeros_like(ids), *args[2:])
                return node.target(*args, **kwargs)
        return super().run_node(node)


def probe_table_rows(host: fx.GraphModule, input_names: list[str], tables: int, dense_dim: int,
                     pooling: int = 2, items: int = 3) -> list[int] | None:
    """Rows of table 0..T-1, or None when the lookups cannot be matched to tables one to one."""
    total = items * tables * pooling
    made = {DENSE: torch.zeros(items, max(dense_dim, 1)),
            LENGTHS: torch.full((items, tables), pooling, dtype=torch.int32),
            INDICES: torch.arange(total, dtype=torch.int64)}
    probe = _Probe(host)
    try:
        with torch.no_grad():
            probe.run(*(made[n] for n in input_names))
    except Exception as exc:  # noqa: BLE001 - a graph we cannot probe just gets no per-table checks
        log.warning("could not probe the host graph for table sizes: %s", exc)
        return None
    rows: list[int | None] = [None] * tables
    for weight_rows, ids in probe.reads:
        flat = ids.flatten()
        if flat.numel() == 0 or int(flat.min()) < 0 or int(flat.max()) >= total:
            return None  # ids were transformed (offsets, hashing): positions are not recoverable
        owners = set(((flat // pooling) % tables).tolist())
        if len(owners) != 1:
            return None  # one op serves several tables (a fused table batch)
        t = owners.pop()
        if rows[t] is not None and rows[t] != weight_rows:
            return None
        rows[t] = weight_rows
    if any(r is None for r in rows):
        return None
    return [int(r) for r in rows]  # type: ignore[arg-type]
