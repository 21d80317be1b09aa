"""Graph surgery for pipelines: split the dense FX graph into stage sub-graphs at given cut points.

The *units* of a pipeline are the dense graph's computing nodes in topological
order (``compute_nodes``); a cut point ``c`` starts a new stage at unit ``c``, so
stages are contiguous runs of units and every edge runs forwards: no cycle by
construction. Weights (``get_attr``) and constant sub-graphs that read no input
(an index buffer reshaped, say) are not units: each stage that uses them gets
its own copy, so only batch-shaped activations cross a stage boundary.

A stage's inputs are the *live* values at its start: produced earlier (or model
inputs) and read by this stage or a later one. Its module returns the values it
produces that a later stage reads (the last stage: the model outputs); inputs a
later stage also reads pass through unchanged (``Stage.passthrough``), carried
by the executor, so an ONNX stage never has an output named like an input.

Policy lives elsewhere (``strategy.pipeline`` picks the cuts from ``GraphCosts``,
plain data measured here by ``node_costs``). Like ``graph_cut``, nothing here
changes its input graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from sixfold.partitioner.cut.graph_cut import _copy_attrs, _is_skippable
from sixfold.partitioner.cut.sizes import SizeRebuilder, is_size, size_expr

__all__ = ["Stage", "NodeCost", "GraphCosts", "compute_nodes", "split_stages", "node_costs", "run_stages"]

_COMPUTE_OPS = ("call_function", "call_method", "call_module")


@dataclass
class Stage:
    """One pipeline stage: a runnable GraphModule and the names it exchanges with its neighbours."""

    index: int
    module: fx.GraphModule
    """Takes ``inputs`` positionally, returns a tuple in ``outputs`` order."""
    inputs: list[str]
    """Live values at the stage's start: model inputs and earlier stages' values read here or later."""
    outputs: list[str]
    """Values computed here that a later stage reads; the last stage: the model outputs."""
    passthrough: list[str]
    """Inputs a later stage also reads: they cross this stage unchanged, carried by the executor."""
    nodes: list[str]
    """Names of the dense graph's units in this stage (weights and constants not included)."""


def _is_const(node: fx.Node, const: set[fx.Node]) -> bool:
    # A computing node that reads no model input (only weights / other constants) has a
    # fixed value: it is copied into each stage that needs it, never passed between stages.
    return (node.op in _COMPUTE_OPS and
            all(i.op == "get_attr" or i in const for i in node.all_input_nodes) and
            not any(u.op == "output" for u in node.users))


def _classify(graph: fx.Graph) -> tuple[list[fx.Node], set[fx.Node], list[fx.Node], fx.Node]:
    """(units, constant nodes, placeholders, output node) of ``graph``."""
    const: set[fx.Node] = set()
    units: list[fx.Node] = []
    placeholders: list[fx.Node] = []
    output: fx.Node | None = None
    for node in graph.nodes:
        if node.op == "placeholder":
            placeholders.append(node)
        elif node.op == "output":
            output = node
        elif node.op == "get_attr" or _is_skippable(node):  # weights; torch.export's input guard
            continue
        elif _is_const(node, const) and node.users:
            const.add(node)
        else:
            units.append(node)
    if output is None:
        raise ValueError("graph has no output node")
    return units, const, placeholders, output


def compute_nodes(gm: fx.GraphModule) -> list[str]:
    """Names of the units cut points index, in topological order."""
    return [n.name for n in _classify(gm.graph)[0]]


def _results(output: fx.Node) -> list[fx.Node]:
    results = output.args[0]
    results = list(results) if isinstance(results, (tuple, list)) else [results]
    bad = [r for r in results if not isinstance(r, fx.Node)]
    if bad:
        raise ValueError(f"model outputs must be graph values, got constants {bad}")
    return results


def _value_name(node: fx.Node) -> str:
    return str(node.target) if node.op == "placeholder" else node.name


def _check_cuts(cuts: Sequence[int], units: int) -> list[int]:
    bounds = [0, *cuts, units]
    if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])) or (cuts and (cuts[0] <= 0 or cuts[-1] >= units)):
        raise ValueError(f"cut points must rise strictly within 1..{units - 1} (graph has {units} units); "
                         f"got {list(cuts)}")
    return bounds


def split_stages(gm: fx.GraphModule, cuts: Sequence[int], output_names: Sequence[str] | None = None) -> list[Stage]:
    """Split ``gm`` into ``len(cuts) + 1`` stages; stage k runs units ``[cuts[k-1], cuts[k])``.

    ``output_names`` names the model outputs (default ``output_0``...), which the
    last stage returns. ``gm`` is left intact. A symbolic size an earlier stage
    computed is recomputed from the stage's own inputs' shapes (``sizes``); a cut
    that would pass any other non-tensor (a tuple before its ``getitem``) is refused.
    """
    units, const, placeholders, output = _classify(gm.graph)
    bounds = _check_cuts(cuts, len(units))
    results = _results(output)
    names = list(output_names) if output_names is not None else [f"output_{i}" for i in range(len(results))]
    if len(names) != len(results):
        raise ValueError(f"{len(names)} output names for {len(results)} model outputs")
    stage_of = {n: k for k in range(len(bounds) - 1) for n in units[bounds[k]:bounds[k + 1]]}
    last = len(bounds) - 2
    for p in placeholders:
        stage_of[p] = -1
    # The last stage that reads each value (model outputs: read "after" the last stage).
    last_use: dict[fx.Node, int] = {}
    for node in units:
        for i in node.all_input_nodes:
            if i in stage_of:
                last_use[i] = max(last_use.get(i, -1), stage_of[node])
    for r in results:
        last_use[r] = last + 1

    values = [*placeholders, *units]
    stages: list[Stage] = []
    for k in range(last + 1):
        live_in = [v for v in values if stage_of[v] < k <= last_use.get(v, -1)
                   and not (stage_of[v] >= 0 and is_size(v))]
        for v in live_in:
            if stage_of[v] >= 0 and "val" in v.meta and not isinstance(v.meta["val"], torch.Tensor):
                raise ValueError(f"cannot start stage {k} at unit {units[bounds[k]].name}: value {v.name} "
                                 f"crosses the cut and is not a tensor ({type(v.meta.get('val')).__name__})")
        mine = units[bounds[k]:bounds[k + 1]]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for v in live_in:
            placeholder = graph.placeholder(_value_name(v))
            placeholder.meta = dict(v.meta)
            env[v] = placeholder
        sizes = SizeRebuilder(graph, list(env.values()))

        def lookup(n: fx.Node) -> fx.Node:
            if n not in env and is_size(n) and 0 <= stage_of.get(n, -1) < k:  # an earlier stage's size
                env[n] = sizes.build(size_expr(n.meta["val"]), f"value {n.name} (needed by stage {k})")  # type: ignore[assignment]
            if n not in env:
                if n.op != "get_attr" and n not in const:
                    raise AssertionError(f"{n.name} read before it is available")  # contiguous cuts rule it out
                env[n] = graph.node_copy(n, lookup)
            return env[n]

        for node in mine:
            env[node] = graph.node_copy(node, lookup)
        if k == last:
            returned = results
            outputs = names
            passthrough = []
        else:
            returned = [v for v in mine if last_use.get(v, -1) > k]
            outputs = [_value_name(v) for v in returned]
            passthrough = [_value_name(v) for v in live_in if last_use.get(v, -1) > k]
        graph.output(tuple(lookup(r) if r.op == "get_attr" or r in const else env[r] for r in returned))
        root = torch.nn.Module()
        _copy_attrs(gm, root, graph)
        module = fx.GraphModule(root, graph, class_name=f"PipelineStage{k}")
        stages.append(Stage(index=k, module=module, inputs=[_value_name(v) for v in live_in], outputs=outputs,
                            passthrough=passthrough, nodes=[n.name for n in mine]))
    return stages


def run_stages(stages: Sequence[Stage], inputs: Mapping[str, torch.Tensor]) -> tuple[list[dict[str, torch.Tensor]],
                                                                                       dict[str, torch.Tensor]]:
    """Run ``stages`` in order on named model inputs: (each stage's inputs, the final outputs).

    Each stage reads its inputs from everything seen so far, the way a pipeline
    executor carries pass-through values.
    """
    env = dict(inputs)
    seen: list[dict[str, torch.Tensor]] = []
    with torch.inference_mode():
        for stage in stages:
            args = {n: env[n] for n in stage.inputs}
            seen.append(args)
            env.update(zip(stage.outputs, stage.module(*args.values())))
    return seen, {n: env[n] for n in stages[-1].outputs}


@dataclass(frozen=True)
class NodeCost:
    """What one unit costs and touches, measured on real batches."""

    name: str
    flops_per_item: float
    out_bytes_per_item: float
    """Bytes of the unit's output per batch row (what it costs to pass it to another card)."""
    params: tuple[str, ...]
    """Weights it reads, directly or through a constant sub-graph (names of ``GraphCosts.param_bytes``)."""
    reads: tuple[str, ...]
    """Values it reads: model inputs or other units (weights and constants excluded)."""
    batch_major: bool
    """Its output is a tensor with the batch in dim 0 (and only there), so it may cross a cut."""


@dataclass(frozen=True)
class GraphCosts:
    """Plain data a pipeline policy needs: units in order, their costs, and what crosses each cut."""

    nodes: tuple[NodeCost, ...]
    inputs: tuple[tuple[str, float], ...]
    """Model inputs with their bytes per batch row."""
    outputs: tuple[str, ...]
    """Values the model returns (unit or input names), in order."""
    param_bytes: tuple[tuple[str, int], ...]
    """Bytes of each weight."""
    learned: tuple[str, ...] = ()
    """The weights that are floating-point tensors (a Linear's), not integer constants (an index buffer)."""

    @cached_property
    def _index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}

    @cached_property
    def _last_use(self) -> dict[str, int]:
        # Position of the last unit reading each value; model outputs count as read at the end.
        last: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for r in node.reads:
                last[r] = i
        for o in self.outputs:
            last[o] = len(self.nodes)
        return last

    def _bytes(self, name: str) -> float:
        if name in self._index:
            return self.nodes[self._index[name]].out_bytes_per_item
        return dict(self.inputs)[name]

    def live(self, position: int) -> list[str]:
        """Values crossing a cut before unit ``position``: produced earlier, read at or after it."""
        last = self._last_use
        inputs = [n for n, _ in self.inputs if last.get(n, -1) >= position]
        return inputs + [n.name for n in self.nodes[:position] if last.get(n.name, -1) >= position]

    def live_bytes_per_item(self, position: int) -> float:
        return sum(self._bytes(n) for n in self.live(position))

    def produced_bytes_per_item(self, start: int, end: int) -> float:
        """Bytes per row a stage of units ``[start, end)`` sends on (the model outputs for the last)."""
        if end == len(self.nodes):
            return sum(self._bytes(n) for n in self.outputs)
        last = self._last_use
        return sum(n.out_bytes_per_item for n in self.nodes[start:end] if last.get(n.name, -1) >= end)

    def can_cut(self, position: int) -> bool:
        """Whether a stage may start at unit ``position``: every live value is a batch-major tensor."""
        if position in (0, len(self.nodes)):
            return True
        return all(self.nodes[self._index[n]].batch_major for n in self.live(position) if n in self._index)

    def stage_param_bytes(self, start: int, end: int) -> int:
        """Weight bytes of a stage of units ``[start, end)`` (a weight used twice counts once)."""
        sizes = dict(self.param_bytes)
        return sum(sizes[p] for p in {p for n in self.nodes[start:end] for p in n.params})

    def stage_has_weights(self, start: int, end: int) -> bool:
        """Whether a stage of units ``[start, end)`` reads a learned weight (not only reshapes, concats, indexing)."""
        learned = set(self.learned)
        return any(p in learned for n in self.nodes[start:end] for p in n.params)

    def stage_flops_per_item(self, start: int, end: int) -> float:
        return sum(n.flops_per_item for n in self.nodes[start:end])


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class _Meter(fx.Interpreter):
    """Runs a graph node by node, recording each node's FLOPs and output bytes."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.flops: dict[str, int] = {}
        self.out_bytes: dict[str, int] = {}
        self.shapes: dict[str, tuple[int, ...] | None] = {}

    def run_node(self, n: fx.Node) -> object:
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        self.flops[n.name] = self.counter.get_total_flops() - before
        self.out_bytes[n.name] = _nbytes(out)
        self.shapes[n.name] = tuple(out.shape) if isinstance(out, torch.Tensor) else None
        return out


def _measure(gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> _Meter:
    counter = FlopCounterMode(display=False)
    meter = _Meter(gm, counter)
    with counter, torch.inference_mode():
        meter.run(*args)
    return meter


def _batch_major(small: tuple[int, ...] | None, large: tuple[int, ...] | None) -> bool:
    # Measured, not read off symbolic shapes (a graph may carry none): between the two runs
    # only dim 0 changes with the batch, so the stage can be exported with a dynamic dim 0.
    if small is None or large is None or not small or len(small) != len(large):
        return False
    return small[0] != large[0] and small[1:] == large[1:]


def node_costs(gm: fx.GraphModule, small: Sequence[torch.Tensor], small_rows: int,
               large: Sequence[torch.Tensor], large_rows: int) -> GraphCosts:
    """Per-unit FLOPs and output bytes per batch row (marginal, from two real runs) and weights.

    ``small``/``large`` are ``gm``'s positional inputs for batches of
    ``small_rows``/``large_rows`` rows; fixed costs cancel in the difference.
    """
    if large_rows <= small_rows:
        raise ValueError(f"large_rows ({large_rows}) must exceed small_rows ({small_rows})")
    units, const, placeholders, output = _classify(gm.graph)
    a, b = _measure(gm, small), _measure(gm, large)
    rows = large_rows - small_rows

    def per_item(table_a: dict[str, int], table_b: dict[str, int], name: str) -> float:
        return max(0.0, (table_b[name] - table_a[name]) / rows)

    weights: dict[str, int] = {}
    learned: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            weights[str(node.target)] = _nbytes(value)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                learned.add(str(node.target))

    def params_of(node: fx.Node, seen: set[fx.Node]) -> set[str]:
        found: set[str] = set()
        for i in node.all_input_nodes:
            if i.op == "get_attr":
                found.add(str(i.target))
            elif i in const and i not in seen:
                seen.add(i)
                found |= params_of(i, seen)
        return found

    # NOTE: a tuple-valued unit (before its getitems) is not batch-major, so no cut separates them.
    unit_set = set(units)
    nodes = tuple(NodeCost(
        name=n.name, flops_per_item=per_item(a.flops, b.flops, n.name),
        out_bytes_per_item=per_item(a.out_bytes, b.out_bytes, n.name),
        params=tuple(sorted(params_of(n, set()))),
        reads=tuple(_value_name(i) for i in n.all_input_nodes if i.op == "placeholder" or i in unit_set),
        batch_major=_batch_major(a.shapes[n.name], b.shapes[n.name])) for n in units)
    inputs = tuple((_value_name(p), float(_nbytes(lg) - _nbytes(sm)) / rows)
                   for p, sm, lg in zip(placeholders, small, large))
    return GraphCosts(nodes=nodes, inputs=inputs, outputs=tuple(_value_name(r) for r in _results(output)),
                      param_bytes=tuple(sorted(weights.items())), learned=tuple(sorted(learned)))

