"""Placement policy for the sparse/dense cut: which graph nodes belong on the host.

Like Glow's SparseNN scheme: every embedding lookup and all of its ancestors
go to the host partition (the index arithmetic that feeds a lookup is cheap,
data-dependent and belongs next to the tables); everything else is dense.
The policy only labels nodes; ``graph_cut`` does the surgery.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

__all__ = ["HOST", "DENSE", "EMBEDDING_OPS", "is_embedding_lookup", "assign_sparse_dense"]

HOST = "host"
DENSE = "dense"


def _overloads(packet_names: list[str]) -> set[object]:
    ops: set[object] = set()
    for dotted in packet_names:
        namespace, name = dotted.split("::")
        packet = getattr(getattr(torch.ops, namespace, None), name, None)
        if packet is None:
            continue
        ops.add(packet)
        for overload in packet.overloads():
            ops.add(getattr(packet, overload))
    return ops


EMBEDDING_OPS: set[object] = _overloads([
    "aten::embedding_bag", "aten::_embedding_bag", "aten::_embedding_bag_forward_only",
    "aten::embedding",
    "quantized::embedding_bag_byte_rowwise_offsets", "quantized::embedding_bag_4bit_rowwise_offsets",
    "quantized::embedding_byte", "quantized::embedding_4bit",
    "fbgemm::EmbeddingBagByteRowwise",
])


def is_embedding_lookup(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in EMBEDDING_OPS


def assign_sparse_dense(graph: fx.Graph) -> dict[fx.Node, str]:
    """Label each computing node HOST or DENSE (placeholders and get_attr included).

    Lookups and their ancestors are HOST; a node that only unpacks a HOST result
    (``getitem``) stays with it; nodes with no users (runtime asserts) follow
    their inputs, and so do the size reads and comparisons that feed only such
    asserts (``sym_size -> ge -> _assert_scalar``: torch.export's checks on
    data-dependent sizes), so a card is never sent a host tensor just to check
    its length. Raises ValueError when the graph has no embedding lookup.
    """
    lookups = [n for n in graph.nodes if is_embedding_lookup(n)]
    if not lookups:
        raise ValueError("no embedding lookup (embedding_bag / embedding) found in the graph; "
                         "nothing to place on the host")
    host: set[fx.Node] = set()
    stack = list(lookups)
    while stack:
        node = stack.pop()
        if node in host:
            continue
        host.add(node)
        stack.extend(node.all_input_nodes)
    labels: dict[fx.Node, str] = {}
    checks: dict[fx.Node, bool] = {}  # _only_checks memo, shared across the pass
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node in host:
            labels[node] = HOST
        elif (node.op == "call_function" and node.target is operator.getitem
              and labels.get(node.args[0]) == HOST):  # type: ignore[arg-type]
            labels[node] = HOST
        elif (node.all_input_nodes and all(labels.get(i) == HOST for i in node.all_input_nodes)
              and (not node.users or _only_checks(node, checks))):
            labels[node] = HOST  # a runtime assert, or what only feeds asserts: with its inputs
        else:
            labels[node] = DENSE
    return labels


def _only_checks(node: fx.Node, memo: dict[fx.Node, bool]) -> bool:
    """Whether every use of ``node`` ends in a node with no users (a runtime assert), through scalars only."""
    if node not in memo:
        memo[node] = False  # NOTE: provisional, so a cycle (there is none in an fx graph) cannot recurse forever
        value = node.meta.get("val")
        scalar = not isinstance(value, torch.Tensor)
        memo[node] = scalar and all(not u.users or _only_checks(u, memo) for u in node.users)
    return memo[node]
