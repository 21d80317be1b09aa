"""Pooling that follows a lookup goes to the host, so the host stage ends with per-item tensors.

``nn.Embedding`` then a segment sum (``index_add``, ``scatter_add``, a sum over a
reshape) looks up one row per id; the lookup policy (``sparse_dense``) puts only the
lookup and its ancestors on the host, so the pooling would run on the cards with one
row per id as input: ragged, so a batch could not be split across cards. This pass
moves every dense node that reads a ragged host value (and what it reads) to the host,
until every value crossing the cut has a fixed number of rows per item.

A shape-only read of a dense value (``zeros_like(x)``, ``x.shape[0]``) is rebuilt from
the model's inputs instead of pulling ``x`` (a bottom MLP, say) onto the host.
Where the pooling cannot move (it would take the model's output with it), the cut
stays and ``move_pooling_to_host`` says why: the plan then never splits that model's
batches.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from sixfold.partitioner.cut.layout import BatchSymbols, batch_symbols, symbolic_layout
from sixfold.partitioner.cut.sizes import SizeRebuilder, UnrecoverableSize, is_size, size_expr
from sixfold.partitioner.cut.sparse_dense import DENSE, HOST, _only_checks

__all__ = ["move_pooling_to_host"]

_aten = torch.ops.aten
_LIKE = {_aten.zeros_like.default: 0.0, _aten.ones_like.default: 1.0, _aten.empty_like.default: 0.0}
_FULL_LIKE = _aten.full_like.default


def _ragged_crossings(graph: fx.Graph, labels: dict[fx.Node, str], symbols: BatchSymbols) -> list[fx.Node]:
    """Dense nodes that read a host tensor without a fixed number of rows per item, in graph order."""
    found = []
    for node in graph.nodes:
        if labels.get(node) != DENSE or node.op == "output":
            continue
        for source in node.all_input_nodes:
            if labels.get(source) != HOST or source.op == "placeholder" or is_size(source):
                continue
            layout = symbolic_layout(source.meta.get("val"), symbols)
            if layout is not None and not layout.per_item:
                found.append(node)
                break
    return found


def _rebuild_shape_read(graph: fx.Graph, node: fx.Node, inputs: list[fx.Node]) -> fx.Node | None:
    """A node computing ``node`` (a size of, or a tensor shaped like, a dense value) from the model's inputs."""
    value = node.meta.get("val")
    try:
        if node.op == "call_function" and node.target is _aten.sym_size.int and is_size(node):
            with graph.inserting_before(node):
                made = SizeRebuilder(graph, inputs).build(size_expr(value), node.name, value)
            return made if isinstance(made, fx.Node) else None
        if node.op == "call_function" and (node.target in _LIKE or node.target is _FULL_LIKE) \
                and isinstance(value, torch.Tensor):
            fill = node.args[1] if node.target is _FULL_LIKE else _LIKE[node.target]
            if isinstance(fill, fx.Node):
                return None
            with graph.inserting_before(node):
                rebuild = SizeRebuilder(graph, inputs)
                shape = [rebuild.build(size_expr(d), node.name, d) for d in value.shape]
                made = graph.call_function(_aten.full.default, (shape, fill),
                                           {"dtype": value.dtype, "device": torch.device("cpu")})
            made.meta = dict(node.meta)
            return made
    except UnrecoverableSize:
        return None
    return None


def move_pooling_to_host(gm: fx.GraphModule, labels: dict[fx.Node, str]) -> str:
    """Relabel (in place) the dense nodes that pool ragged host values, and their inputs, HOST.

    Returns "" when every value crossing the cut now has a fixed number of rows per item,
    else why not (the labels are then as they were). ``gm``'s graph may gain nodes that
    rebuild shape-only reads from the model's inputs (equivalent to the ones they replace).
    """
    graph = gm.graph
    symbols = batch_symbols(graph)
    if symbols.batch is None:
        return ""  # no symbolic shapes to tell a ragged value by (layouts come from examples then)
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    before = dict(labels)
    added: list[fx.Node] = []
    for _ in range(len(graph.nodes)):
        pending = _ragged_crossings(graph, labels, symbols)
        if not pending:
            return ""
        consumer = pending[0]
        stack, moved = [consumer], []
        while stack:
            node = stack.pop()
            if labels.get(node) != DENSE:
                continue
            if node is not consumer and node.op != "placeholder":
                rebuilt = _rebuild_shape_read(graph, node, inputs)
                if rebuilt is not None:
                    node.replace_all_uses_with(rebuilt)
                    graph.erase_node(node)
                    labels.pop(node, None)
                    for made in _new_nodes(rebuilt, labels):
                        labels[made] = HOST
                        added.append(made)
                        for read in made.all_input_nodes:
                            if read.op == "placeholder":  # the model input a size is read off: the host reads it
                                labels[read] = HOST
                    continue
            if any(u.op == "output" for u in node.users):
                labels.clear()
                labels.update(before)
                labels.update({n: DENSE for n in added})  # shape reads rebuilt from inputs: same values
                return (f"the pooling of the host's per-id values at {consumer.name} cannot move to the host "
                        f"without the model's output ({node.name})")
            labels[node] = HOST
            moved.append(node)
            stack.extend(node.all_input_nodes)
        for node in moved:  # a moved tuple's getitems go with it
            for user in node.users:
                if user.op == "call_function" and user.target is operator.getitem:
                    labels[user] = HOST
        _checks_follow_inputs(graph, labels)
    return "the host's values crossing the cut did not settle to rows per item"


def _checks_follow_inputs(graph: fx.Graph, labels: dict[fx.Node, str]) -> None:
    """Runtime asserts (and the sizes only they read) whose inputs are all on the host now go there too."""
    memo: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        if (labels.get(node) == DENSE and node.op != "placeholder" and node.all_input_nodes
                and all(labels.get(i) == HOST for i in node.all_input_nodes)
                and (not node.users or _only_checks(node, memo))):
            labels[node] = HOST


def _new_nodes(root: fx.Node, labels: dict[fx.Node, str]) -> list[fx.Node]:
    """``root`` and the nodes it was built from that have no label yet (a rebuilt shape read)."""
    found, stack = [], [root]
    while stack:
        node = stack.pop()
        if node in labels or node in found:
            continue
        found.append(node)
        stack.extend(node.all_input_nodes)
    return found
