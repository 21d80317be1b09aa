"""Range checks for every embedding lookup of a host graph, run on a request before it is queued.

The server checks ``sparse_indices`` against per-table row counts when the
partitioner could tell which lookup serves which table (``table_probe``). A
model that transforms its ids first (offsets into one shared table, a
reshape the probe cannot follow, its own index arithmetic) has no such
mapping, and a bad id used to reach the batch and fail there with a raw
torch IndexError (INTERNAL, and every request merged with it failed too).

``IdCheck`` keeps the host graph's index arithmetic and nothing else: for
each lookup, the nodes that compute its ids from the request (no tables,
only the small buffers the arithmetic reads, such as an offsets vector).
Run on one request it gives the rows each lookup would read; a row outside
``[0, rows)`` of that lookup's table refuses the request with a message
naming ``sparse_indices``. On a refusal only, it runs the arithmetic twice
more (ids = positions, ids = 0) to find which request position the bad row
came from when the arithmetic is a shift or a selection, and names it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import fx

from sixfold.models.signature import INDICES, LENGTHS

from sixfold.partitioner.cut.graph_cut import _copy_attrs, _is_skippable
from sixfold.partitioner.cut.sparse_dense import is_embedding_lookup

__all__ = ["IdCheck", "LookupRange", "row_gather"]

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


_ROW_GATHERS = (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)


def row_gather(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(weight, ids) of a plain row gather on a module attribute: ``weight[ids]`` or ``index_select(weight, 0, ids)``.

    Not an embedding lookup to the cut (it is no pooled bag), but a read of a table's rows all the same:
    per-sample weights of an EmbeddingBag are usually ``psw_table[ids]``.
    """
    if node.op != "call_function" or node.target not in _ROW_GATHERS:
        return None
    weight = node.args[0]
    if not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    if node.target is torch.ops.aten.index.Tensor:
        indices = node.args[1]
        if len(indices) != 1 or not isinstance(indices[0], fx.Node):
            return None
        return weight, indices[0]
    if node.args[1] != 0 or not isinstance(node.args[2], fx.Node):
        return None
    return weight, node.args[2]


@dataclass(frozen=True)
class LookupRange:
    """One lookup: its graph node and how many rows its table has."""

    node: str
    rows: int


def _attr(module: torch.nn.Module, target: str):
    value = module
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _rows_of(module: fx.GraphModule, weight: object, any_rank: bool = False) -> int | None:
    if not isinstance(weight, fx.Node):
        return None
    value = weight.meta.get("val")
    if value is None and weight.op == "get_attr":
        value = _attr(module, str(weight.target))
    if isinstance(value, torch.Tensor) and (value.dim() == 2 or (any_rank and value.dim() >= 1)):
        return int(value.shape[0])
    return None


def _reads_input(ids: fx.Node) -> bool:
    """Whether ``ids`` is computed from a graph input (the request), not only from constants."""
    seen, stack = set(), [ids]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op == "placeholder":
            return True
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return False


class IdCheck:
    """The index arithmetic of a host graph, checked against each lookup's table (module docstring)."""

    def __init__(self, run: Callable[[Mapping[str, np.ndarray]], list[np.ndarray]],
                 ranges: Sequence[LookupRange]) -> None:
        """``run(inputs)``: the rows each lookup of ``ranges`` reads for a request, in order."""
        self.run, self.ranges = run, list(ranges)

    @classmethod
    def from_module(cls, host: fx.GraphModule, input_names: Sequence[str]) -> "IdCheck | None":
        """The check for ``host`` (taking ``input_names`` positionally); None when it has no checkable lookup."""
        graph = host.graph
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        lookups = []  # (node, its ids node, its table's rows)
        for node in graph.nodes:
            if is_embedding_lookup(node) and len(node.args) >= 2 and isinstance(node.args[1], fx.Node):
                weight, ids = node.args[0], node.args[1]
            elif (gathered := row_gather(node)) is not None:
                weight, ids = gathered
            else:
                continue
            rows = _rows_of(host, weight, any_rank=not is_embedding_lookup(node))
            if rows is not None and _reads_input(ids):
                lookups.append((node, ids, rows))
        # What computes each lookup's ids: ancestors, but never through a lookup (no table is kept).
        keep: set[fx.Node] = set()
        usable = []
        for node, ids, rows in lookups:
            seen, stack, ok = set(), [ids], True
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                if is_embedding_lookup(n):
                    ok = False  # ids read from another lookup's rows: not arithmetic on the request
                    break
                seen.add(n)
                stack.extend(n.all_input_nodes)
            if ok:
                keep |= seen
                usable.append((node, ids, rows))
        if not usable:
            return None
        checker = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in graph.nodes:
            if node.op == "placeholder":
                env[node] = checker.node_copy(node, lambda n: env[n])
            elif node in keep and not _is_skippable(node):
                env[node] = checker.node_copy(node, lambda n: env[n])
        checker.output(tuple(env[ids] for _, ids, _ in usable))
        root = torch.nn.Module()
        _copy_attrs(host, root, checker)
        if len(placeholders) != len(input_names):
            raise ValueError(f"host graph takes {len(placeholders)} inputs; given names {list(input_names)}")
        module = fx.GraphModule(root, checker, class_name="IdCheck")
        names = list(input_names)

        def run(inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
            with torch.inference_mode():
                out = module(*(torch.from_numpy(np.asarray(inputs[n])) for n in names))
            return [o.reshape(-1).numpy() for o in out]

        return cls(run, [LookupRange(n.name, r) for n, _, r in usable])

    def _rows(self, inputs: Mapping[str, np.ndarray], ids: np.ndarray | None = None) -> list[np.ndarray]:
        return self.run(inputs if ids is None else {**inputs, INDICES: ids})

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> str | None:
        """None when every lookup's rows are in range, else why not (a message naming ``sparse_indices``)."""
        try:
            rows = self._rows(inputs)
        except Exception as exc:  # noqa: BLE001 - the model's own arithmetic refused the request
            return f"input '{INDICES}': the model's index arithmetic fails on it: {type(exc).__name__}: {exc}"
        for k, (looked_up, lookup) in enumerate(zip(rows, self.ranges)):
            if not looked_up.size:
                continue
            bad = (looked_up < 0) | (looked_up >= lookup.rows)
            if not bad.any():
                continue
            e = int(np.argmax(bad))
            row = int(looked_up[e])
            where = self._position(inputs, k, e, row)
            return (f"input '{INDICES}': {where} reads row {row} of lookup {lookup.node}, whose table has rows "
                    f"0..{lookup.rows - 1}")
        return None

    def _position(self, inputs: Mapping[str, np.ndarray], k: int, e: int, row: int) -> str:
        """Which request id became ``row``, when the arithmetic is a shift or a selection (see the docstring)."""
        ids = np.asarray(inputs[INDICES])
        try:
            at = self._rows(inputs, np.arange(ids.shape[0], dtype=ids.dtype))[k][e]
            base = self._rows(inputs, np.zeros_like(ids))[k][e]
        except Exception:  # noqa: BLE001 - arithmetic that cannot take positions: no position to name
            return "an id"
        p = int(at - base)
        if not 0 <= p < ids.shape[0] or int(ids[p]) + int(base) != row:
            return "an id"
        where = f"id {int(ids[p])} at position {p}"
        lengths = inputs.get(LENGTHS)
        if lengths is not None and lengths.ndim == 2 and int(lengths.sum()) == ids.shape[0]:
            owner = np.repeat(np.tile(np.arange(lengths.shape[1]), lengths.shape[0]), lengths.reshape(-1))
            where += f" (table {int(owner[p])})"
        return where
