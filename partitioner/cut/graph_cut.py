"""Graph surgery: split an FX graph into a host module and a dense module.

The cutter takes a labelling (node -> HOST | DENSE) from a policy and never
changes its input. Values that cross the cut become outputs of the host module
and inputs of the dense module, named ``host_<node>``. Edges must run host ->
dense only; anything else is reported, not silently reordered. A size (SymInt) the
host computes and the dense side reads does not cross: the dense side recomputes it
from its own inputs' shapes (``sizes``).
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass

import torch
from torch import fx

from sixfold.partitioner.cut.sizes import SizeRebuilder, UnrecoverableSize, is_size, size_expr
from sixfold.partitioner.cut.sparse_dense import DENSE, HOST

__all__ = ["SplitGraph", "cut_graph"]


@dataclass
class SplitGraph:
    """The two halves of a cut model, each a runnable ``fx.GraphModule``."""

    host: fx.GraphModule
    dense: fx.GraphModule
    host_inputs: list[str]
    """Model inputs the host module takes, in order."""
    boundary: list[str]
    """Host outputs = the dense inputs that come from the host, in order."""
    dense_inputs: list[str]
    """All dense inputs in order: model inputs it reads directly, then the boundary."""
    output_names: list[str]
    host_nodes: list[str]
    dense_nodes: list[str]


def _is_skippable(node: fx.Node) -> bool:
    # torch.export's input guard takes every input but computes nothing we need.
    return node.op == "call_module" and str(node.target).startswith("_guards_fn")


def _copy_attrs(src: fx.GraphModule, dst_root: torch.nn.Module, graph: fx.Graph) -> None:
    for node in graph.nodes:
        if node.op != "get_attr":
            continue
        value = src
        for part in str(node.target).split("."):
            value = getattr(value, part)
        owner = dst_root
        *parents, leaf = str(node.target).split(".")
        for part in parents:
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        if isinstance(value, torch.nn.Parameter):
            owner.register_parameter(leaf, value)
        elif isinstance(value, torch.Tensor):
            owner.register_buffer(leaf, value)
        else:
            setattr(owner, leaf, copy.deepcopy(value))


def _boundary_name(node: fx.Node) -> str:
    # ``getitem(embedding_bag, 0)`` reads better as ``host_embedding_bag`` than ``host_getitem``.
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        index = node.args[1]
        return f"host_{node.args[0].name}" + ("" if index == 0 else f"_{index}")
    return f"host_{node.name}"


def _reads_dense(node: fx.Node, labels: dict[fx.Node, str]) -> bool:
    return node.op == "placeholder" and (labels[node] == DENSE or any(
        labels.get(u) == DENSE and not _is_skippable(u) for u in node.users))


def _inputs_for_sizes(nodes: list[fx.Node], labels: dict[fx.Node, str], boundary: list[fx.Node]) -> list[fx.Node]:
    """Model inputs the dense side must also take, only for a host size none of its own inputs determine.

    The size is then passed as an explicit input: the dense side reads it off that input's shape
    (the id count off ``sparse_indices``, say). None when every size rebuilds from what it has.
    """
    have = [n for n in nodes if _reads_dense(n, labels)] + boundary
    extra: list[fx.Node] = []
    for node in nodes:
        if labels[node] != HOST or not is_size(node) or not any(labels.get(u) == DENSE for u in node.users):
            continue
        expr = size_expr(node.meta.get("val"))
        for more in [[], *([p] for p in nodes if p.op == "placeholder" and p not in have and p not in extra)]:
            try:
                SizeRebuilder(fx.Graph(), [*have, *extra, *more]).build(expr, node.name)
            except UnrecoverableSize:
                continue
            extra.extend(more)
            break
    return extra


def cut_graph(gm: fx.GraphModule, labels: dict[fx.Node, str],
              output_names: list[str] | None = None) -> SplitGraph:
    """Split ``gm`` by ``labels`` into host and dense GraphModules (``gm`` is left intact)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output" and not _is_skippable(n)]
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    missing = [n.name for n in nodes if n not in labels]
    if missing:
        raise ValueError(f"nodes without a partition label: {missing}")
    # Host -> dense only: a host node must not read a dense value.
    for node in nodes:
        if labels[node] == HOST:
            bad = [i.name for i in node.all_input_nodes if labels.get(i) == DENSE]
            if bad:
                raise ValueError(f"host node {node.name} reads dense values {bad}: the cut has a cycle")

    results = output_node.args[0]
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    if any(labels.get(r) == HOST for r in results):
        raise ValueError("a model output is computed on the host; the dense side must produce it")
    output_names = output_names or [f"output_{i}" for i in range(len(results))]

    # Host graph: its placeholders, its nodes, and every host value a dense node reads.
    host_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    host_inputs: list[str] = []
    boundary_nodes: list[fx.Node] = []
    for node in nodes:
        if labels[node] != HOST:
            continue
        if node.op == "placeholder":
            host_inputs.append(node.name)
        env[node] = host_graph.node_copy(node, lambda n: env[n])
        if node.op != "placeholder" and not is_size(node) and any(labels.get(u) == DENSE for u in node.users):
            boundary_nodes.append(node)
    boundary = [_boundary_name(n) for n in boundary_nodes]
    host_graph.output(tuple(env[n] for n in boundary_nodes))

    # Dense graph: model inputs it reads directly, then the boundary values.
    dense_graph = fx.Graph()
    denv: dict[fx.Node, fx.Node] = {}
    dense_inputs: list[str] = []
    size_sources = _inputs_for_sizes(nodes, labels, boundary_nodes)
    for node in nodes:
        # A model input may feed both sides (the host often reads only its size).
        if node.op == "placeholder" and (labels[node] == DENSE or node in size_sources or any(
                labels.get(u) == DENSE and not _is_skippable(u) for u in node.users)):
            denv[node] = dense_graph.node_copy(node, lambda n: denv[n])
            dense_inputs.append(node.name)
    for node, name in zip(boundary_nodes, boundary):
        placeholder = dense_graph.placeholder(name)
        placeholder.meta = dict(node.meta)
        denv[node] = placeholder
        dense_inputs.append(name)
    sizes = SizeRebuilder(dense_graph, list(denv.values()))

    def dense_value(n: fx.Node) -> object:
        if n not in denv:  # a host size: rebuilt from the dense inputs' shapes (sizes.SizeRebuilder)
            denv[n] = sizes.build(size_expr(n.meta.get("val")), f"host value {n.name!r}")
        return denv[n]

    for node in nodes:
        if labels[node] == DENSE and node.op != "placeholder":
            denv[node] = dense_graph.node_copy(node, dense_value)
    dense_graph.output(tuple(denv[r] for r in results))

    host_root, dense_root = torch.nn.Module(), torch.nn.Module()
    _copy_attrs(gm, host_root, host_graph)
    _copy_attrs(gm, dense_root, dense_graph)
    host_gm = fx.GraphModule(host_root, host_graph, class_name="HostPartition")
    dense_gm = fx.GraphModule(dense_root, dense_graph, class_name="DensePartition")
    host_gm.graph.eliminate_dead_code()
    dense_gm.graph.eliminate_dead_code()
    host_gm.recompile()
    dense_gm.recompile()
    return SplitGraph(
        host=host_gm, dense=dense_gm, host_inputs=host_inputs, boundary=boundary,
        dense_inputs=dense_inputs, output_names=output_names,
        host_nodes=[n.name for n in nodes if labels[n] == HOST],
        dense_nodes=[n.name for n in nodes if labels[n] == DENSE],
    )
