"""Sizes that cross the cut: a symbolic size (SymInt) the host computes and the dense side reads.

A model that reads the batch on both sides (``n = dense_features.shape[0]`` for the host's
offsets, ``view(n, -1, d)`` in the card's interaction) makes ``n`` a host value read by a
dense node. A size is not a tensor: it cannot be an ONNX input, split or merged. So the
dense side recomputes it from its own inputs' shapes: every size in a torch.export graph
is a sympy expression of the export's symbols (``s0`` the batch, ``4*s0`` a one-hot id
count), and any dense input with a dimension ``k * s`` gives ``s`` back as ``size // k``.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch import fx
from torch.utils._sympy.functions import FloorDiv

__all__ = ["is_size", "size_expr", "SizeRebuilder", "UnrecoverableSize"]


class UnrecoverableSize(ValueError):
    """A size the dense side reads that none of its inputs' shapes determine."""


def is_size(node: fx.Node) -> bool:
    """Whether ``node`` computes a scalar (a size or a number), not a tensor."""
    value = node.meta.get("val")
    return isinstance(value, (int, torch.SymInt)) and not isinstance(value, bool)


def size_expr(value: object) -> sympy.Expr | None:
    """The sympy expression of a SymInt (an int gives an Integer; anything else None)."""
    if isinstance(value, torch.SymInt):
        return sympy.sympify(value.node.expr)
    if isinstance(value, int) and not isinstance(value, bool):
        return sympy.Integer(value)
    return None


class SizeRebuilder:
    """Builds a size on a graph from the shapes of that graph's placeholders.

    ``sources``: placeholders (with ``meta["val"]``) whose dimensions may be read. Each
    dimension ``k * s`` (``k`` a positive integer, ``s`` a symbol) makes ``s`` readable.
    """

    def __init__(self, graph: fx.Graph, sources: list[fx.Node]) -> None:
        self.graph = graph
        self._dims: dict[sympy.Expr, tuple[fx.Node, int]] = {}
        self._symbols: dict[sympy.Symbol, tuple[fx.Node, int, int]] = {}
        for node in sources:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                continue
            for dim, size in enumerate(value.shape):
                expr = size_expr(size)
                if expr is None or expr.is_number:
                    continue
                self._dims.setdefault(expr, (node, dim))
                coeff, rest = expr.as_coeff_Mul()
                if isinstance(rest, sympy.Symbol) and coeff.is_Integer and coeff > 0:
                    self._symbols.setdefault(rest, (node, dim, int(coeff)))
        self._made: dict[sympy.Expr, object] = {}

    def build(self, expr: sympy.Expr, what: str, value: object = None) -> object:
        """An fx node (or an int) computing ``expr``; UnrecoverableSize naming ``what`` when it cannot.

        ``value`` (the SymInt it stands for) goes in the node's ``meta["val"]``, as torch.export's own have.
        """
        made = self._build(sympy.sympify(expr), what)
        if value is not None and isinstance(made, fx.Node) and "val" not in made.meta:
            made.meta["val"] = value
        return made

    def _build(self, expr: sympy.Expr, what: str) -> object:
        build = self._build
        if expr in self._made:
            return self._made[expr]
        if expr.is_Integer:
            made: object = int(expr)
        elif expr in self._dims:
            node, dim = self._dims[expr]
            made = self.graph.call_function(torch.ops.aten.sym_size.int, (node, dim))
        elif isinstance(expr, sympy.Symbol):
            if expr not in self._symbols:
                raise UnrecoverableSize(
                    f"{what} is the size {expr}, which no input of the dense side has as a dimension "
                    "(it is data-dependent, or only the host's inputs carry it)")
            node, dim, coeff = self._symbols[expr]
            size = build(coeff * expr, what)
            made = size if coeff == 1 else self.graph.call_function(operator.floordiv, (size, coeff))
        elif isinstance(expr, (sympy.Add, sympy.Mul)):
            join = operator.add if isinstance(expr, sympy.Add) else operator.mul
            terms = [build(a, what) for a in expr.args]
            made = terms[0]
            for term in terms[1:]:
                made = self.graph.call_function(join, (made, term))
        elif isinstance(expr, FloorDiv):
            made = self.graph.call_function(operator.floordiv, tuple(build(a, what) for a in expr.args))
        else:
            raise UnrecoverableSize(f"{what} is the size {expr}, an expression the dense side cannot rebuild")
        self._made[expr] = made
        return made
