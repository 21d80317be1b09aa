"""torch's ONNX ``EmbeddingBag`` (a ``Loop`` over the bags) rewritten as one vectorised lookup + pooling.

torch.onnx writes ``nn.EmbeddingBag`` (sum or mean, one-hot or jagged, with or without
per-sample weights) as a ``Loop`` that slices each bag's rows and reduces them, one bag per
iteration: thousands of iterations per batch, with sequence ops the cards do not run.
Both exporters are recognised:

* legacy (``dynamo=False``): the Loop's body gathers ``table[ids[start:end]]`` and reduces it;
  the bags leave as the Loop's scan output.
* dynamo: the rows are gathered (and weighted) before the Loop; its body reduces
  ``rows[start:end]`` (an ``If`` gives zeros for an empty bag) into a sequence that a
  ``ConcatFromSequence`` stacks.

Either way bag ``i`` covers rows ``S[i]:E[i]``, where ``S`` and ``E`` are outer 1-D tensors
read at the iteration number. The rewrite computes every bag at once from prefix sums
(in float64, so long bags lose nothing): ``P = [0; cumsum(rows)]``, ``bag = P[E] - P[S]``,
divided by ``max(E - S, 1)`` for mean (an empty bag is 0, as in torch). The gather becomes
a plain ``Gather`` on the table (a lookup ``find_lookups`` knows) whose pooling is the
rewrite's last node. ``cut_onnx`` checks the rewritten model against the original and keeps
the original when they differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

__all__ = ["BagRewrite", "rewrite_loop_bags", "CONTROL_FLOW_OPS"]

CONTROL_FLOW_OPS = frozenset({"Loop", "If", "Scan", "SequenceEmpty", "SequenceInsert", "SequenceAt",
                              "SequenceConstruct", "SequenceLength", "SequenceErase", "ConcatFromSequence",
                              "SplitToSequence"})
_REDUCE = {"ReduceSum": "sum", "ReduceMean": "mean"}
_PASS = ("Reshape", "Unsqueeze", "Squeeze", "Cast", "CastLike", "Identity")


@dataclass(frozen=True)
class BagRewrite:
    """One Loop bag replaced: the lookup's Gather and the node that ends its pooling."""

    loop: str
    gather: str
    pooling: str
    mode: str


def _subgraph(node: onnx.NodeProto, name: str) -> onnx.GraphProto | None:
    return next((a.g for a in node.attribute if a.name == name and a.type == AttributeProto.GRAPH), None)


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


class _Scope:
    """Producers and constants of a Loop body, its nested If branches, and the outer graph."""

    def __init__(self, outer: onnx.GraphProto, body: onnx.GraphProto) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consts: dict[str, np.ndarray] = {}
        self.local: set[str] = {i.name for i in body.input}
        self.reduces: list[onnx.NodeProto] = []
        for t in outer.initializer:
            self.consts[t.name] = numpy_helper.to_array(t)
        for n in outer.node:
            if n.op_type == "Constant":
                self._constant(n)
        self._walk(body)

    def _constant(self, node: onnx.NodeProto) -> None:
        value = next((a for a in node.attribute if a.name in ("value", "value_int", "value_ints")), None)
        if value is None:
            return
        if value.name == "value":
            self.consts[node.output[0]] = numpy_helper.to_array(value.t)
        else:
            self.consts[node.output[0]] = np.array(value.i if value.name == "value_int" else list(value.ints))

    def _walk(self, graph: onnx.GraphProto) -> None:
        for t in graph.initializer:
            self.consts[t.name] = numpy_helper.to_array(t)
            self.local.add(t.name)
        for node in graph.node:
            for out in node.output:
                self.producer[out] = node
                self.local.add(out)
            if node.op_type == "Constant":
                self._constant(node)
            if node.op_type in _REDUCE:
                self.reduces.append(node)
            for attr in node.attribute:
                if attr.type == AttributeProto.GRAPH:
                    self._walk(attr.g)

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name)

    def outer(self, name: str) -> bool:
        return name not in self.local


def _counters(loop: onnx.NodeProto, body: onnx.GraphProto, scope: _Scope) -> set[str]:
    """Body names that equal the iteration number: the iteration input, and carried values that start at 0 and add 1."""
    found = {body.input[0].name}
    for j, carried in enumerate(body.input[2:]):
        initial = scope.const(loop.input[2 + j]) if len(loop.input) > 2 + j else None
        if initial is None or initial.size != 1 or int(initial.reshape(-1)[0]) != 0:
            continue
        update = _shift(body.output[1 + j].name, scope, {carried.name})
        if update == (carried.name, 1):
            found.add(carried.name)
    return found


def _shift(name: str, scope: _Scope, counters: set[str]) -> tuple[str, int] | None:
    """``name`` as counter + k: (counter, k), through reshapes, casts and Adds of constants."""
    if name in counters:
        return name, 0
    node = scope.producer.get(name)
    if node is None:
        return None
    if node.op_type in _PASS and node.input:
        return _shift(node.input[0], scope, counters)
    if node.op_type == "Add" and len(node.input) == 2:
        for a, b in (node.input, reversed(node.input)):
            const = _scalar(b, scope)
            inner = _shift(a, scope, counters)
            if inner is not None and const is not None:
                return inner[0], inner[1] + const
    return None


def _scalar(name: str, scope: _Scope) -> int | None:
    value = scope.const(name)
    if value is None:
        node = scope.producer.get(name)
        if node is not None and node.op_type in _PASS and node.input:
            return _scalar(node.input[0], scope)
        return None
    return int(value.reshape(-1)[0]) if value.size == 1 else None


def _element(name: str, scope: _Scope, counters: set[str]) -> tuple[str, int] | None:
    """``name`` as ``C[i + k]`` for an outer 1-D tensor C: (C, k)."""
    node = scope.producer.get(name)
    if node is None:
        return None
    if node.op_type in _PASS and node.input:
        return _element(node.input[0], scope, counters)
    if node.op_type == "Gather" and _attr(node, "axis", 0) == 0 and scope.outer(node.input[0]):
        at = _shift(node.input[1], scope, counters)
        return (node.input[0], at[1]) if at else None
    if node.op_type == "Slice" and scope.outer(node.input[0]) and len(node.input) >= 3:
        start, end = _shift(node.input[1], scope, counters), _shift(node.input[2], scope, counters)
        if start and end and end[1] == start[1] + 1 and (len(node.input) < 4 or _is_zero(node.input[3], scope)):
            return node.input[0], start[1]
    return None


def _is_zero(name: str, scope: _Scope) -> bool:
    value = scope.const(name) if name else np.array([0])
    return value is not None and value.size == 1 and int(value.reshape(-1)[0]) == 0


@dataclass
class _Match:
    rows: str | None
    """Outer tensor of gathered rows (dynamo), or None when the body gathers (legacy)."""
    table: str | None
    ids: str | None
    starts: tuple[str, int]
    ends: tuple[str, int]
    mode: str
    keepdims: int
    weights: tuple[str, list[onnx.NodeProto]] | None = None
    """Legacy per-sample weights: the outer weights tensor and the ops the body applies to its slice."""
    consts: dict | None = None


def _match_rows(name: str, scope: _Scope, counters: set[str]) -> tuple[str | None, str | None, str | None, tuple,
                                                                        tuple] | None:
    """The reduced tensor as ``rows[S[i]:E[i]]`` or ``table[ids[S[i]:E[i]]]``."""
    node = scope.producer.get(name)
    if node is None:
        return None
    if node.op_type == "Identity":
        return _match_rows(node.input[0], scope, counters)
    if node.op_type == "Slice" and len(node.input) >= 3 and (len(node.input) < 4 or _is_zero(node.input[3], scope)):
        if len(node.input) > 4 and node.input[4] and _scalar(node.input[4], scope) != 1:
            return None
        start, end = _element(node.input[1], scope, counters), _element(node.input[2], scope, counters)
        if start is None or end is None:
            return None
        if scope.outer(node.input[0]):
            return node.input[0], None, None, start, end
        return None
    if node.op_type == "Gather" and _attr(node, "axis", 0) == 0 and scope.outer(node.input[0]):
        table = scope.const(node.input[0])
        inner = _match_rows(node.input[1], scope, counters)
        if table is not None and table.ndim == 2 and inner is not None and inner[0] is not None:
            return None, node.input[0], inner[0], inner[3], inner[4]
    return None


def _match_weighted(name: str, scope: _Scope, counters: set[str]) -> tuple[tuple, tuple[str, list] | None] | None:
    """``_match_rows``, or (legacy per-sample weights) its rows times ``pass-ops(W[S[i]:E[i]])``."""
    rows = _match_rows(name, scope, counters)
    if rows is not None:
        return rows, None
    node = scope.producer.get(name)
    if node is None or node.op_type != "Mul":
        return None
    for a, b in (node.input, reversed(node.input)):
        rows = _match_rows(a, scope, counters)
        chain: list[onnx.NodeProto] = []
        tensor = b
        while (inner := scope.producer.get(tensor)) is not None and inner.op_type in ("Unsqueeze", "Cast", "Identity"):
            if any(scope.const(t) is None for t in inner.input[1:] if t):
                return None
            chain.insert(0, inner)
            tensor = inner.input[0]
        weights = _match_rows(tensor, scope, counters)
        if rows is not None and rows[1] is not None and weights is not None and weights[0] is not None \
                and (weights[3], weights[4]) == (rows[3], rows[4]):
            return rows, (weights[0], chain)
    return None


def _match(loop: onnx.NodeProto, outer: onnx.GraphProto) -> tuple[_Match, onnx.NodeProto, str] | None:
    body = _subgraph(loop, "body")
    if body is None:
        return None
    scope = _Scope(outer, body)
    # NOTE: the dynamo exporter's mean reduces the last bag as a ReduceSum over a count (the same rows).
    if not scope.reduces or len({r.input[0] for r in scope.reduces}) != 1 or len(scope.reduces) > 2:
        return None
    reduce = next((r for r in scope.reduces if r.op_type == "ReduceMean"), scope.reduces[0])
    axes = list(next((a.ints for a in reduce.attribute if a.name == "axes"), []))
    if len(reduce.input) > 1 and reduce.input[1]:
        value = scope.const(reduce.input[1])
        axes = [] if value is None else [int(v) for v in value.reshape(-1)]
    if axes != [0]:
        return None
    counters = _counters(loop, body, scope)
    found = _match_weighted(reduce.input[0], scope, counters)
    if found is None:
        return None
    rows, weights = found
    match = _Match(rows=rows[0] if rows[1] is None else None, table=rows[1], ids=rows[2] if rows[1] else None,
                   starts=rows[3], ends=rows[4], mode=_REDUCE[reduce.op_type], keepdims=_attr(reduce, "keepdims", 1),
                   weights=weights, consts={t: scope.const(t) for n in (weights or ("", []))[1] for t in n.input[1:]
                                            if t})
    if match.rows is None and match.table is None:
        return None
    trips = loop.input[0] if loop.input and loop.input[0] else None
    if trips is None:  # the dynamo form: ``while counter + 1 < N``
        cond = scope.producer.get(body.output[0].name)
        if cond is None or cond.op_type != "Less" or not scope.outer(cond.input[1]):
            return None
        at = _shift(cond.input[0], scope, counters)
        if at is None or at[1] != 1:
            return None
        trips = cond.input[1]
    return match, reduce, trips


def _bag_output(loop: onnx.NodeProto, body: onnx.GraphProto, consumers: dict[str, list[onnx.NodeProto]],
                keepdims: int) -> tuple[str, list[onnx.NodeProto], bool] | None:
    """The tensor holding all bags, the nodes the rewrite replaces, and whether it is [B, 1, D] (a scan of [1, D])."""
    carried = len(loop.input) - 2
    used = [i for i, out in enumerate(loop.output) if out and consumers.get(out)]
    if len(used) != 1:
        return None
    index = used[0]
    if index >= carried:  # a scan output: the bags stacked on a new axis 0
        return loop.output[index], [loop], bool(keepdims)
    # A sequence: SequenceInsert in the body, ConcatFromSequence after the Loop.
    producer = {o: n for n in body.node for o in n.output}
    insert = producer.get(body.output[1 + index].name)
    if insert is None or insert.op_type != "SequenceInsert" or insert.input[0] != body.input[2 + index].name:
        return None
    readers = consumers[loop.output[index]]
    if len(readers) != 1 or readers[0].op_type != "ConcatFromSequence" or _attr(readers[0], "axis", 0) != 0:
        return None
    if _attr(readers[0], "new_axis", 0) != (0 if keepdims else 1):
        return None
    return readers[0].output[0], [loop, readers[0]], False


def _vectorised(prefix: str, match: _Match, trips: str, out: str, scan_of_rows: bool,
                extra: list[onnx.TensorProto]) -> tuple[list[onnx.NodeProto], str]:
    """Nodes computing every bag at once into ``out``; returns them and the Gather's name."""
    def c(name: str, value: list[int]) -> str:
        full = f"{prefix}/{name}"
        extra.append(numpy_helper.from_array(np.asarray(value, dtype=np.int64), full))
        return full

    p = lambda name: f"{prefix}/{name}"  # noqa: E731
    nodes: list[onnx.NodeProto] = []
    gather = ""
    rows = match.rows
    if rows is None:
        gather = p("gather")
        nodes.append(helper.make_node("Gather", [match.table, match.ids], [p("rows")], name=gather, axis=0))
        rows = p("rows")
        if match.weights is not None:
            weights, chain = match.weights
            for k, op in enumerate(chain):
                copy = onnx.NodeProto()
                copy.CopyFrom(op)
                del copy.input[:], copy.output[:]
                copy.name = p(f"weights_{k}")
                copy.input.append(weights)
                for j, t in enumerate(op.input[1:]):
                    extra.append(numpy_helper.from_array(np.asarray(match.consts[t]), p(f"weights_{k}_{j}")))
                    copy.input.append(p(f"weights_{k}_{j}"))
                copy.output.append(p(f"weights_{k}"))
                nodes.append(copy)
                weights = p(f"weights_{k}")
            nodes.append(helper.make_node("Mul", [rows, weights], [p("weighted")], name=p("weighted")))
            rows = p("weighted")
    nodes.append(helper.make_node("Cast", [trips], [p("trips_i64")], name=p("trips_cast"), to=TensorProto.INT64))
    nodes.append(helper.make_node("Reshape", [p("trips_i64"), c("one_dim", [1])], [p("trips")], name=p("trips_1d")))
    for side, (source, shift) in (("start", match.starts), ("end", match.ends)):
        nodes.append(helper.make_node("Add", [p("trips"), c(f"{side}_shift", [shift])], [p(f"{side}_stop")],
                                      name=p(f"{side}_stop")))
        nodes.append(helper.make_node("Slice", [source, c(f"{side}_from", [shift]), p(f"{side}_stop"), c(f"{side}_axis", [0])],
                                      [p(f"{side}_raw")], name=p(f"{side}_slice")))
        nodes.append(helper.make_node("Cast", [p(f"{side}_raw")], [p(f"{side}_raw_i64")], name=p(f"{side}_cast"),
                                      to=TensorProto.INT64))
    # Bounds past the rows are clamped, as the Loop's Slice clamps them: [min(S, K), max(min(E, K), S)).
    nodes += [
        helper.make_node("Shape", [rows], [p("count")], name=p("count"), start=0, end=1),
        helper.make_node("Min", [p("start_raw_i64"), p("count")], [p("start")], name=p("start_clamp")),
        helper.make_node("Min", [p("end_raw_i64"), p("count")], [p("end_in")], name=p("end_clamp")),
        helper.make_node("Max", [p("end_in"), p("start")], [p("end")], name=p("end_floor")),
    ]
    nodes += [
        helper.make_node("Cast", [rows], [p("rows64")], name=p("rows64"), to=TensorProto.DOUBLE),
        helper.make_node("CumSum", [p("rows64"), c("axis0", [0])], [p("cumsum")], name=p("cumsum")),
        helper.make_node("Pad", [p("cumsum"), c("pads", [1, 0, 0, 0])], [p("prefix")], name=p("prefix")),
        helper.make_node("Gather", [p("prefix"), p("end")], [p("upto_end")], name=p("upto_end"), axis=0),
        helper.make_node("Gather", [p("prefix"), p("start")], [p("upto_start")], name=p("upto_start"), axis=0),
        helper.make_node("Sub", [p("upto_end"), p("upto_start")], [p("sums")], name=p("sums")),
    ]
    pooled = p("sums")
    if match.mode == "mean":
        nodes += [
            helper.make_node("Sub", [p("end"), p("start")], [p("counts_i64")], name=p("counts_i64")),
            helper.make_node("Cast", [p("counts_i64")], [p("counts_f")], name=p("counts_f"), to=TensorProto.DOUBLE),
            helper.make_node("Max", [p("counts_f"), p("one_f")], [p("counts")], name=p("counts")),
            helper.make_node("Unsqueeze", [p("counts"), c("axis1", [1])], [p("counts_col")], name=p("counts_col")),
            helper.make_node("Div", [p("sums"), p("counts_col")], [p("means")], name=p("means")),
        ]
        extra.append(numpy_helper.from_array(np.array(1.0, dtype=np.float64), p("one_f")))
        pooled = p("means")
    if scan_of_rows:
        nodes.append(helper.make_node("CastLike", [pooled, rows], [p("pooled")], name=p("cast_back")))
        nodes.append(helper.make_node("Unsqueeze", [p("pooled"), c("axis1_out", [1])], [out], name=p("pool")))
    else:
        nodes.append(helper.make_node("CastLike", [pooled, rows], [out], name=p("pool")))
    return nodes, gather


def _gather_of(rows: str, producer: dict[str, onnx.NodeProto], tables: set[str]) -> str | None:
    """The Gather on a table that ``rows`` comes from (through weighting and shape-only ops)."""
    stack, seen = [rows], set()
    while stack:
        node = producer.get(stack.pop(0))
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == "Gather" and node.input[0] in tables:
            return node.name
        if node.op_type in ("Mul", *_PASS):
            stack.extend(t for t in node.input if t)
    return None


def rewrite_loop_bags(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[BagRewrite]]:
    """A copy of ``model`` (named nodes) with each recognised Loop bag vectorised, and what was rewritten.

    Loops that do not match either exporter's form are left as they are (``cut_onnx``
    warns about any that reach the cards).
    """
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 15 or not any(n.op_type == "Loop" for n in graph.node):
        return model, []  # NOTE: the rewrite casts back with CastLike (opset 15)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for t in node.input:
            consumers.setdefault(t, []).append(node)
        for sub in (a.g for a in node.attribute if a.type == AttributeProto.GRAPH):
            for inner in sub.node:
                for t in inner.input:
                    consumers.setdefault(t, []).append(node)
    outputs = {o.name for o in graph.output}
    tables = {t.name for t in graph.initializer if len(t.dims) == 2}
    replaced: dict[str, list[onnx.NodeProto]] = {}
    removed: set[str] = set()
    extra: list[onnx.TensorProto] = []
    rewrites: list[BagRewrite] = []
    for loop in graph.node:
        if loop.op_type != "Loop":
            continue
        found = _match(loop, graph)
        if found is None:
            continue
        match, _, trips = found
        body = _subgraph(loop, "body")
        target = _bag_output(loop, body, consumers, match.keepdims)
        if target is None or any(o in outputs for o in loop.output if o and o != target[0]):
            continue
        out, nodes_out, scan_of_rows = target
        added: list[onnx.TensorProto] = []
        nodes, gather = _vectorised(f"{loop.name}/bag", match, trips, out, scan_of_rows, added)
        if not gather:
            producer = {o: n for n in graph.node for o in n.output}
            gather = _gather_of(match.rows or "", producer, tables) or ""
            if not gather:
                continue
        extra.extend(added)
        replaced[nodes_out[-1].name] = nodes
        removed.update(n.name for n in nodes_out[:-1])
        rewrites.append(BagRewrite(loop=loop.name, gather=gather, pooling=nodes[-1].name, mode=match.mode))
    if not rewrites:
        return model, []
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    kept: list[onnx.NodeProto] = []
    pending: dict[str, list[onnx.NodeProto]] = dict(replaced)
    for node in copy.graph.node:
        if node.name in removed:
            continue
        kept.extend(pending.pop(node.name, [node]))
    del copy.graph.node[:]
    copy.graph.node.extend(kept)
    copy.graph.initializer.extend(extra)
    _prune(copy)
    return copy, rewrites


def _node_inputs(node: onnx.NodeProto) -> set[str]:
    """Tensors a node reads, its subgraphs' outer-scope reads included (over-approximated: all their inputs)."""
    names = {t for t in node.input if t}
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            names |= {t for inner in attr.g.node for t in _node_inputs(inner)} | {o.name for o in attr.g.output}
    return names


def _prune(model: onnx.ModelProto) -> None:
    """Drop nodes whose outputs nothing reads any more (the Loops' trip-count arithmetic, SequenceEmpty)."""
    graph = model.graph
    while True:
        read = {t for n in graph.node for t in _node_inputs(n)} | {o.name for o in graph.output}
        keep = [n for n in graph.node if any(o in read for o in n.output if o)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    read = {t for n in graph.node for t in _node_inputs(n)} | {i.name for i in graph.input}
    inits = [t for t in graph.initializer if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(inits)
