"""Read each table's row count off the host graph itself, so the server can range-check ids per table.

A model file says nothing about which lookup serves which table. We ask the
graph: run the host partition on a request whose ids are their own positions
(``sparse_indices = arange``, ``pooling`` ids per (item, table)), and watch
what each lookup op reads. In the sample-major layout position ``p`` belongs to
table ``(p // pooling) % T``, so a lookup that reads only table ``t``'s
positions serves table ``t``, and its weight's first dimension is that table's
row count. Lookups run on clamped ids while probing, so no id is out of range.

When ids are shifted first (per-table offsets into one shared weight, the
table-batched layout), positions are lost; a second probe asks by difference,
as the ONNX frontend does: all ids 0, then table t's ids set to 1 and to a large
value. A lookup whose rows move by exactly that much serves t from offset o (the
row id 0 lands on), and table t's rows run from o to the next table's offset in
the same weight (or its end). Hashing (``id % rows``) does not move a large id
by its value, so a hashed model stays unmapped (and gets per-lookup checks,
``sixfold.partitioner.tables.id_check``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
from torch import fx

from sixfold.models.signature import DENSE, INDICES, LENGTHS

from sixfold.partitioner.tables.id_check import row_gather
from sixfold.partitioner.cut.sparse_dense import is_embedding_lookup

__all__ = ["probe_table_rows", "table_batched"]

log = logging.getLogger(__name__)


class _Probe(fx.Interpreter):
    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.reads: list[tuple[int, torch.Tensor]] = []
        self.nodes: list[str] = []

    def run_node(self, node: fx.Node):
        if row_gather(node) is not None:  # weight[ids] (per-sample weights, table offsets): clamped into range
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            last = args[0].shape[0] - 1
            if node.target is torch.ops.aten.index.Tensor:
                return node.target(args[0], [args[1][0].clamp(0, last)], **kwargs)
            return node.target(args[0], args[1], args[2].clamp(0, last), **kwargs)
        if node.op == "call_function" and is_embedding_lookup(node):
            args, kwargs = self.fetch_args_kwargs_from_env(node)
            weight, ids = args[0], args[1]
            if isinstance(weight, torch.Tensor) and isinstance(ids, torch.Tensor) and weight.dim() == 2:
                self.reads.append((int(weight.shape[0]), ids.detach().clone()))
                self.nodes.append(node.name)
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
    rows = _positional(probe.reads, tables, pooling, total)
    if rows is not None and not _moves_with_ids(host, input_names, made, probe.reads):
        rows = None  # small positions passed through, large ones do not: hashed (id % rows), not used as they come
    if rows is None:  # ids shifted into a shared table, or one op for several tables: ask by difference
        rows = _shifted(host, input_names, made, tables, pooling)
    return rows


def _positional(reads: list[tuple[int, torch.Tensor]], tables: int, pooling: int, total: int) -> list[int] | None:
    rows: list[int | None] = [None] * tables
    for weight_rows, ids in reads:
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


def _moves_with_ids(host: fx.GraphModule, input_names: list[str], made: dict[str, torch.Tensor],
                    reads: list[tuple[int, torch.Tensor]]) -> bool:
    """Each lookup reads the positions shifted by ``_BIG_ID`` when the ids are (no ``id % rows`` in between)."""
    probe = _Probe(host)
    try:
        with torch.no_grad():
            probe.run(*({**made, INDICES: made[INDICES] + _BIG_ID}[n] for n in input_names))
    except Exception:  # noqa: BLE001 - a graph that refuses large ids keeps the positional answer
        return True
    return len(probe.reads) == len(reads) and all(
        big.shape == ids.shape and torch.equal(big, ids + _BIG_ID) for (_, big), (_, ids) in zip(probe.reads, reads))


_BIG_ID = 1_000_003
"""A second probe value: a shift moves it as it moves 1; hashing (id % rows) does not."""


def _shifted(host: fx.GraphModule, input_names: list[str], made: dict[str, torch.Tensor], tables: int,
             pooling: int) -> list[int] | None:
    """Rows per table when each table's ids are shifted by a constant into a (shared) table, else None.

    Like the ONNX frontend's probe: all ids 0, then table t's ids set to 1 and to a large value; a
    lookup whose ids move by exactly that much serves t at offset o (the row id 0 lands on). A table's
    rows run from its offset to the next table's offset in the same weight (or the weight's end).
    """
    def run(ids: torch.Tensor) -> dict[str, tuple[int, torch.Tensor]] | None:
        probe = _Probe(host)
        try:
            with torch.no_grad():
                probe.run(*({**made, INDICES: ids}[n] for n in input_names))
        except Exception:  # noqa: BLE001 - no answer is no per-table check
            return None
        return {name: (r, i.flatten()) for name, (r, i) in zip(probe.nodes, probe.reads)}

    total = made[INDICES].numel()
    owner = (torch.arange(total) // pooling) % tables
    base = run(torch.zeros(total, dtype=torch.int64))
    if not base:
        return None
    offsets: dict[str, dict[int, int]] = {name: {} for name in base}
    for t in range(tables):
        moved = {}
        for value in (1, _BIG_ID):
            probe = run(torch.where(owner == t, value, 0).to(torch.int64))
            if probe is None or probe.keys() != base.keys():
                return None
            moved[value] = probe
        for name, (_, before) in base.items():
            shapes = {before.shape, moved[1][name][1].shape, moved[_BIG_ID][name][1].shape}
            if len(shapes) != 1:
                return None
            changed = moved[1][name][1] != before
            if not changed.any():
                continue
            starts = torch.unique(before[changed])
            if (len(starts) != 1 or not torch.equal(moved[1][name][1][changed], before[changed] + 1)
                    or not torch.equal(moved[_BIG_ID][name][1][changed], before[changed] + _BIG_ID)):
                return None  # transformed (hashed, scaled), not shifted
            offsets[name][t] = int(starts[0])
    rows: list[int | None] = [None] * tables
    for name, served in offsets.items():
        weight_rows = base[name][0]
        starts = sorted(set(served.values()))
        for t, o in served.items():
            end = next((s for s in starts if s > o), weight_rows)
            limit = end - o
            rows[t] = limit if rows[t] is None else min(rows[t], limit)
    if any(r is None or r < 1 for r in rows):
        return None
    return [int(r) for r in rows]  # type: ignore[arg-type]


def table_batched(host: fx.GraphModule, input_names: Sequence[str], output_names: Sequence[str],
                  rows: Sequence[int] | None) -> list[np.ndarray] | None:
    """The host stage's tables (fp32 views, one per table) when it *is* a table-batched sum bag, else None.

    A table-batched host stage (the zoo's) reads the lengths and ids and returns one sum-pooled bag
    per (item, table) from one weight of sum(rows) rows: the host-embedding backend can serve it
    from table files, quantize it and shard it. A host graph that merely looks like one (a mean
    bag, a gate, its own arithmetic) must not be replaced by it, so this runs both on a jagged
    request (0..3 ids per bag, including empty bags) and compares.
    """
    from sixfold.backends.host.host_embedding import HostEmbeddingStage

    if list(input_names) != [LENGTHS, INDICES] or len(output_names) != 1 or not rows:
        return None
    weights = {**dict(host.named_parameters()), **dict(host.named_buffers())}
    fused = [t for t in weights.values() if t.dim() == 2 and t.is_floating_point() and t.shape[0] == sum(rows)]
    if len(fused) != 1:
        return None
    array = fused[0].detach().cpu().float().numpy()
    starts = np.cumsum([0, *rows])
    tables = [array[a:b] for a, b in zip(starts[:-1], starts[1:])]
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, size=(5, len(rows))).astype(np.int32)
    ids = np.concatenate([rng.integers(0, rows[t], size=k) for k, t in
                          zip(lengths.reshape(-1), np.tile(np.arange(len(rows)), 5))]).astype(np.int64)
    try:
        with torch.no_grad():
            got = host(torch.from_numpy(lengths), torch.from_numpy(ids))
        got = (got[0] if isinstance(got, (tuple, list)) else got).detach().float().numpy()
        want = HostEmbeddingStage(tables, "fp32", layout="per-table", cache=False, check_ids=False)(
            torch.from_numpy(lengths), torch.from_numpy(ids))
        want = np.asarray(want.detach().numpy() if isinstance(want, torch.Tensor) else want)
    except Exception:  # noqa: BLE001 - a graph that cannot take this request is not table-batched
        return None
    if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
        return None
    return tables
