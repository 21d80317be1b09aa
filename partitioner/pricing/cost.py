"""Cost model inputs measured from a partition: FLOPs, weight bytes, bytes per item.

FLOPs come from torch's FlopCounterMode on two real batch sizes, so the
per-item figure is exact for linear and bmm layers whatever the model; lookup
traffic comes from the embedding weights' row width and the ids per item.

An *op profile* (``op_profile``) prices a partition operator by operator on a
calibrated spec (``DeviceSpec.calibrated``): matrix products by the efficiency
of their size, gathers by ids and row bytes, everything else by the bytes it
moves, each op plus a fixed launch cost. Specs without calibrated figures keep
the one-roofline price, which is also what the simulated card charges.

A host stage (a graph holding a lookup) runs eagerly, op by op through torch's
dispatcher, so its views, shape reads and numpy<->torch edges cost a launch too (kind
"dispatch"), each of its ops costs ``EAGER_LAUNCHES`` calibrated launches, and its small
ops pay per element they write (``per_index_seconds``): index arithmetic of a few hundred
ids is all fixed costs, and an index-heavy host stage priced without them was estimated
at a quarter of its time or less. A table-batched host stage (the zoo's, served by the
native tables backend, which runs no graph ops) is priced as before.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode

from sixfold.backends.spec import DeviceSpec

from sixfold.models.signature import INDICES, LENGTHS
from sixfold.partitioner.cut.sparse_dense import is_embedding_lookup

__all__ = ["PartitionCost", "OpCost", "module_param_bytes", "flops_per_item", "lookup_bytes_per_id",
           "op_profile", "op_seconds", "stage_seconds", "EAGER_LAUNCHES"]


@dataclass(frozen=True)
class OpCost:
    """One operator of a partition as the op-level model prices it.

    Each quantity is linear in the batch rows, measured on two real batches:
    ``(fixed, per_item)``, so a weight read is fixed and an activation per item.
    """

    name: str
    kind: str
    """"matmul" (counted FLOPs), "gather" (random rows by index), "index" (element-wise indices),
    "memory" (bytes moved) or "dispatch" (a view or shape read: its launch only)."""
    flops: tuple[float, float] = (0.0, 0.0)
    products: tuple[float, float] = (1.0, 0.0)
    """Matrix products per call: 1 for a GEMM, the batch for a batched matmul."""
    bytes: tuple[float, float] = (0.0, 0.0)
    """Bytes read and written, not counting gathered rows (a gather's indices and output)."""
    ids: tuple[float, float] = (0.0, 0.0)
    """Indices a gather looks up."""
    row_bytes: float = 0.0
    """Bytes one gathered index reads."""
    launches: float = 1.0
    """Its fixed cost in calibrated launches (``per_op_seconds``): ``EAGER_LAUNCHES`` for an op torch runs
    eagerly in a host stage, 1 otherwise."""

    @staticmethod
    def at(pair: tuple[float, float], rows: int) -> float:
        """A ``(fixed, per_item)`` quantity at ``rows`` rows."""
        return max(0.0, pair[0] + pair[1] * rows)


@dataclass(frozen=True)
class PartitionCost:
    param_bytes: int
    flops_per_item: float
    bytes_per_item: float
    """Bytes read or written per item beyond the weights (lookups, activations)."""
    weight_bytes_per_batch: int
    """Weight bytes a batch reads in full: all of a dense partition's, none of a table's."""
    dtype: str = "fp32"
    """Compute dtype: picks the device's peak FLOP/s (``DeviceSpec.peak_flops[dtype]``)."""
    ops: tuple[OpCost, ...] = ()
    """Op profile (``op_profile``); empty: priced by the roofline on FLOPs and bytes above."""


def module_param_bytes(module: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _count_flops(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> int:
    counter = FlopCounterMode(display=False)
    with counter, torch.inference_mode():
        module(*args)
    return counter.get_total_flops()


def flops_per_item(module: torch.nn.Module, small: tuple[torch.Tensor, ...], small_rows: int,
                   large: tuple[torch.Tensor, ...], large_rows: int) -> float:
    """Marginal FLOPs per batch row, from two real runs (fixed costs cancel)."""
    if large_rows <= small_rows:
        raise ValueError("large_rows must exceed small_rows")
    return (_count_flops(module, large) - _count_flops(module, small)) / (large_rows - small_rows)


def _attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def lookup_bytes_per_id(gm: fx.GraphModule) -> float:
    """Bytes one id reads: the widest lookup's row (dim x element size) plus the id itself."""
    widths = []
    for node in gm.graph.nodes:
        weight = node.args[0] if is_embedding_lookup(node) else None
        if not isinstance(weight, fx.Node):
            continue
        val = weight.meta.get("val")
        if val is None and weight.op == "get_attr":
            val = _attr(gm, str(weight.target))
        if isinstance(val, torch.Tensor) and val.dim() == 2:
            widths.append(int(val.shape[1]) * val.element_size())
    return float(max(widths, default=0)) + 8.0


def op_seconds(device: DeviceSpec, op: OpCost, rows: int, dtype: str = "fp32") -> float:
    """Modelled time of one operator on a batch of ``rows``, launch cost included."""
    moved = OpCost.at(op.bytes, rows) / device.memory_bandwidth
    if op.kind == "matmul":
        flops = OpCost.at(op.flops, rows)
        product = flops / max(1.0, OpCost.at(op.products, rows))
        seconds = max(device.matmul_seconds(flops, product, dtype), moved) if flops > 0 else moved
    elif op.kind == "gather":
        seconds = device.gather_seconds(OpCost.at(op.ids, rows), op.row_bytes) + moved
    elif op.kind in ("index", "memory"):  # a memory op's ids: its output elements, counted in host stages only
        seconds = device.index_seconds(OpCost.at(op.ids, rows)) + moved
    else:
        seconds = moved
    return device.per_op_seconds * op.launches + seconds


def stage_seconds(device: DeviceSpec, cost: PartitionCost, rows: int, in_bytes: float,
                  out_bytes: float, dtype: str | None = None) -> float:
    """Modelled time of one batch on ``device``: transfers in and out plus compute.

    On a calibrated spec a cost with an op profile is the sum of its ops
    (``op_seconds``) plus the spec's per-batch cost. Otherwise it is a roofline:
    dense weights are read once per batch, table rows only as looked up
    (``bytes_per_item``); per-item traffic scales with rows. That is the same
    formula the simulated card uses, so plan and simulation agree.
    """
    dtype = dtype or cost.dtype
    if cost.ops and device.calibrated:
        compute = device.per_batch_seconds + sum(op_seconds(device, op, rows, dtype) for op in cost.ops)
    else:
        compute = device.compute_seconds(cost.flops_per_item * rows,
                                         cost.weight_bytes_per_batch + cost.bytes_per_item * rows, dtype)
    return device.transfer_seconds(in_bytes) + compute + device.transfer_seconds(out_bytes)


# --- op profiles -------------------------------------------------------------------------------

_FREE = frozenset({
    # Views and metadata: no bytes move (a reshape of a contiguous tensor is a view).
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "transpose", "t", "permute",
    "expand", "alias", "detach", "slice", "select", "split", "split_with_sizes", "chunk", "unbind",
    "as_strided", "sym_size", "sym_numel", "sym_stride", "_assert_tensor_metadata", "_assert_scalar",
    "getitem", "lift_fresh_copy", "unflatten", "view_as",
})
_FUSABLE = frozenset({"relu", "relu_", "sigmoid", "sigmoid_", "tanh", "gelu", "silu", "hardtanh", "leaky_relu",
                      "clamp", "clamp_min"})
"""Activations a runtime folds into the matmul that feeds them (ORT's FusedGemm, a card compiler)."""
_BATCHED = frozenset({"bmm", "baddbmm", "matmul"})
_EMBEDDING = frozenset({"embedding_bag", "_embedding_bag", "_embedding_bag_forward_only", "embedding"})
_INDEXING = frozenset({"index_select", "gather", "take"})
_REPEATING = frozenset({"repeat_interleave"})
"""Ops whose every output element is read through a computed index (bag number -> offset)."""


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    return str(getattr(node.target, "__name__", node.target))


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _nbytes(tensors: Sequence[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


EAGER_LAUNCHES = 2.0
"""Launches (calibrated ``per_op_seconds``, one tiny aten add) one op of an eagerly run host stage costs.

A documented constant, not a calibrated figure: the calibration times one op alone and hot, while a
host stage's graph runs a different op each line (a select, a copy, a bag) behind Python's call
of the graph. On the 2-core VM the one-hot DLRM wrapper's host stage ran 15 ops in 64 us at 1 item,
4.2 us an op, against a calibrated add of 1.9 us; 2 launches an op puts the stage's estimate within
1.1-1.5x of its measured time there. It scales with the host, since it multiplies the calibrated add."""


@dataclass
class _Seen:
    kind: str
    flops: float = 0.0
    products: float = 1.0
    bytes: float = 0.0
    ids: float = 0.0
    row_bytes: float = 0.0
    launches: float = 1.0


def _seen(name: str, args: tuple, inputs: list[torch.Tensor], outputs: list[torch.Tensor], flops: float) -> _Seen:
    """Classify one executed op and measure what it computes and moves."""
    if name in _EMBEDDING and len(args) > 1 and isinstance(args[1], torch.Tensor):
        weight, indices = args[0], args[1]
        others = [t for t in inputs if t is not weight]
        return _Seen("gather", ids=float(indices.numel()),
                     row_bytes=float(weight[0].numel() * weight.element_size()),
                     bytes=_nbytes(others) + _nbytes(outputs[:1]))  # the bag sums, not the bookkeeping
    if name in _INDEXING and len(args) > 2 and isinstance(args[0], torch.Tensor):
        source, index = args[0], args[2]
        dim = int(args[1]) % max(1, source.dim())
        if name == "index_select":  # whole slices after ``dim`` move per index
            ids = index.numel() * math.prod(source.shape[:dim])
            row = math.prod(source.shape[dim + 1:]) * source.element_size()
        else:
            ids, row = index.numel(), source.element_size()
        # Source slices sit in cache (an activation, not a table): the output's bytes and a fixed
        # cost per index price it, not a random-row gather.
        return _Seen("index", ids=float(ids), row_bytes=float(row), bytes=_nbytes([index]) + _nbytes(outputs))
    moved = _nbytes(inputs) + _nbytes(outputs)
    if name in _REPEATING and outputs:
        return _Seen("gather", ids=float(outputs[0].numel()), row_bytes=float(outputs[0].element_size()),
                     bytes=moved)
    if flops:
        products = 1.0
        if name in _BATCHED and outputs and outputs[0].dim() > 2:
            products = float(math.prod(outputs[0].shape[:-2]))
        return _Seen("matmul", flops=flops, products=products, bytes=moved)
    return _Seen("memory", bytes=moved)


class _OpMeter(fx.Interpreter):
    """Runs a graph node by node and records what each op computes and moves."""

    def __init__(self, gm: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(gm)
        self.counter = counter
        self.seen: dict[str, _Seen] = {}
        self.views: dict[str, _Seen] = {}
        self.elements: dict[str, float] = {}

    def run_node(self, n: fx.Node) -> object:
        if n.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        before = self.counter.get_total_flops()
        out = super().run_node(n)
        flops = float(self.counter.get_total_flops() - before)
        name, outputs = _op_name(n), _tensors(out)
        if flops or (name not in _FREE and outputs):  # no tensor out: a guard or an assertion
            self.seen[n.name] = _seen(name, args, _tensors((args, kwargs)), outputs, flops)
            self.elements[n.name] = float(sum(t.numel() for t in outputs))
        elif isinstance(n.target, torch._ops.OpOverload) and not name.startswith("_assert"):
            self.views[n.name] = _Seen("dispatch")  # a view or a shape read: free data, not a free call
        return out


def _fused(gm: fx.GraphModule, seen: dict[str, _Seen]) -> set[str]:
    """Activations applied straight to a matmul's only use: folded into it, so free."""
    fused = set()
    for node in gm.graph.nodes:
        src = node.args[0] if node.args else None
        if (node.name in seen and _op_name(node) in _FUSABLE and isinstance(src, fx.Node)
                and src.name in seen and seen[src.name].kind == "matmul" and len(src.users) == 1):
            fused.add(node.name)
    return fused


def _table_batched_shape(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` has the shape of a table-batched host stage (the zoo's): it reads only the lengths and
    the ids, returns one tensor and holds one table. Such a stage is written as table files and served by
    the native tables backend (``partitioner.tables.probe.table_batched`` checks it at write time), which
    runs no graph ops, so its ops are priced as they were before per-op host pricing."""
    inputs = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    weights = {id(t): t for t in [*gm.parameters(), *gm.buffers()] if t.dim() == 2 and t.is_floating_point()}
    returned = len(output) if isinstance(output, (tuple, list)) else 1
    return inputs == [LENGTHS, INDICES] and returned == 1 and len(weights) == 1


def _meter(gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> dict[str, _Seen]:
    """What each op computes and moves; in a host stage (it holds a lookup) its views and shape reads too."""
    counter = FlopCounterMode(display=False)
    meter = _OpMeter(gm, counter)
    with counter, torch.inference_mode():
        meter.run(*args)
    if not any(is_embedding_lookup(node) for node in gm.graph.nodes) or _table_batched_shape(gm):
        return meter.seen
    # Eager, op by op: small element-wise ops cost per element written (``per_index_seconds``), far
    # beyond the bytes they move, and views and shape reads cost their launch.
    seen = {name: dataclasses.replace(op, ids=meter.elements[name]) if op.kind == "memory" else op
            for name, op in {**meter.seen, **meter.views}.items()}
    # Each input and output crosses between numpy and torch at the stage's edge: a launch each.
    edges = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op == "output":
            returned = node.args[0]
            edges += [f"output.{i}" for i in range(len(returned) if isinstance(returned, (tuple, list)) else 1)]
    seen.update({f"edge:{e}": _Seen("dispatch") for e in edges})
    return {name: dataclasses.replace(op, launches=EAGER_LAUNCHES) for name, op in seen.items()}


def op_profile(gm: fx.GraphModule, small: Sequence[torch.Tensor], small_rows: int,
               large: Sequence[torch.Tensor], large_rows: int) -> tuple[OpCost, ...]:
    """The ops of ``gm`` with what each computes and moves, linear in the batch rows.

    ``small``/``large`` are ``gm``'s positional inputs for batches of
    ``small_rows``/``large_rows`` rows. Views are free (in a host stage, which
    torch runs op by op, they cost their launch: kind "dispatch"); an activation fed only
    by a matmul is folded into it.
    """
    if large_rows <= small_rows:
        raise ValueError(f"large_rows ({large_rows}) must exceed small_rows ({small_rows})")
    a, b = _meter(gm, small), _meter(gm, large)
    skip = _fused(gm, b)
    span = large_rows - small_rows

    def line(x: float, y: float) -> tuple[float, float]:
        per = (y - x) / span
        return (x - per * small_rows, per)

    ops = []
    for name, hi in b.items():
        lo = a.get(name)
        if name in skip or lo is None or lo.kind != hi.kind:
            continue
        ops.append(OpCost(name=name, kind=hi.kind, flops=line(lo.flops, hi.flops),
                          products=line(lo.products, hi.products), bytes=line(lo.bytes, hi.bytes),
                          ids=line(lo.ids, hi.ids), row_bytes=hi.row_bytes, launches=hi.launches))
    return tuple(ops)
