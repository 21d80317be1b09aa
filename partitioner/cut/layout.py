"""Layouts of tensors that cross the cut: how many rows each batch item owns.

A batch is split across cards, and its parts' outputs rejoined, on these facts only
(never on a length being divisible by the item count). They are read off the export's
symbolic shapes: with the batch a symbol ``s`` (``dense_features``' first dimension), a
tensor of ``k * s`` rows has k rows per item; one of as many rows as ``sparse_indices``
(one per id, when the id count is its own symbol) is ragged, counted by ``sparse_lengths``;
anything else (a data-dependent count, a fixed size) is unknown. Examples at two batch
sizes confirm a per-item count, and stand in for it where the graph carries no shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from sixfold.models.signature import DENSE, INDICES, LENGTHS
from sixfold.partitioner.cut.sizes import size_expr

__all__ = ["Layout", "BatchSymbols", "batch_symbols", "symbolic_layout", "observed_layout", "tensor_layout"]


@dataclass(frozen=True)
class Layout:
    rows_per_item: int | None
    """k rows per item; None: ragged or unknown."""
    ragged_by: str | None = None
    """Ragged: the model input whose per-item sums count each item's rows."""

    @property
    def per_item(self) -> bool:
        return self.rows_per_item is not None

    def describe(self) -> str:
        if self.rows_per_item is not None:
            return f"{self.rows_per_item} row(s) per item"
        return f"ragged (one row per id, counted by {self.ragged_by})" if self.ragged_by else "not per item"


@dataclass(frozen=True)
class BatchSymbols:
    batch: sympy.Expr | None
    """The batch size's expression (``dense_features``' first dimension); None: not symbolic."""
    ids: sympy.Expr | None
    """The id count's expression (``sparse_indices``' length); None: not symbolic."""


def batch_symbols(graph: fx.Graph) -> BatchSymbols:
    """The batch and id count of a graph taking the canonical request, as its placeholders' shapes say."""
    found: dict[str, sympy.Expr | None] = {DENSE: None, INDICES: None}
    for node in graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and node.name in found and isinstance(value, torch.Tensor) and value.dim():
            expr = size_expr(value.shape[0])
            found[node.name] = None if expr is None or expr.is_number else expr
    return BatchSymbols(found[DENSE], found[INDICES])


def symbolic_layout(value: object, symbols: BatchSymbols) -> Layout | None:
    """The layout a traced value's first dimension says; None when the graph carries no symbolic batch."""
    if symbols.batch is None or not isinstance(value, torch.Tensor):
        return None
    if value.dim() == 0:
        return Layout(None)
    rows = size_expr(value.shape[0])
    if rows is None:
        return Layout(None)
    ratio = sympy.simplify(rows / symbols.batch)
    if ratio.is_Integer and int(ratio) > 0:
        return Layout(int(ratio))
    if symbols.ids is not None and sympy.simplify(rows - symbols.ids) == 0:
        return Layout(None, LENGTHS)
    return Layout(None)


def observed_layout(small: Any, small_items: int, large: Any, large_items: int) -> Layout:
    """The layout two real runs (tensors or arrays) agree on: k rows per item at both batch sizes, else unknown."""
    if small is None or large is None or not len(small.shape) or not len(large.shape):
        return Layout(None)
    k, rest = divmod(large.shape[0], large_items)
    if k > 0 and not rest and small.shape[0] == k * small_items:
        return Layout(k)
    return Layout(None)


def tensor_layout(value: object, symbols: BatchSymbols, observed: Layout) -> Layout:
    """The symbolic layout checked against what runs observed (they must agree on k), else the observed one."""
    traced = symbolic_layout(value, symbols)
    if traced is None:
        return observed
    if traced.per_item and traced.rows_per_item != observed.rows_per_item:
        return Layout(None)  # the trace and the runs disagree: never split on it
    return traced
