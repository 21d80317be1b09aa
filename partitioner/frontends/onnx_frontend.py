"""ONNX frontend: cut an ONNX recommendation model into a host ONNX model (lookups) and a dense one.

The policy is the torch path's (``sparse_dense.py``, Glow's SparseNN scheme):
every embedding lookup, its pooling and all their ancestors run on the host;
everything else is dense. In ONNX a *lookup* is a ``Gather`` (axis 0) on a
rank-2 initializer (the table) whose ids derive from ``sparse_indices``, or a
``GatherND`` on one with indices ``[..., 1]``; its *pooling* is the
``ReduceSum``/``ReduceMean`` it reaches through shape-only ops (Reshape,
Unsqueeze, Squeeze, Cast, Identity, Flatten, Transpose) and per-sample weights
(a ``Mul`` of the rows by a weight, EmbeddingBag-style). A lookup
with no pooling (one-hot) is still a lookup; its gathered rows cross the cut.

    model.onnx --find lookups--> host nodes --cut--> host graph + dense graph
        --observe (onnxruntime, example requests)--> pooling factor, which
          table index each lookup serves, boundary types, MatMul/Gemm shapes
        --> host.onnx + dense.onnx (checked, and host∘dense == model to 1e-5)

Every output of the model (a click and a conversion head, say) is served under its own
name; the dense model returns them all. Values that cross the cut keep their names in the original model. Index
arithmetic that does not read ``sparse_indices`` (a batch size taken from
``Shape(dense_features)``, a shared shape constant) is recomputed on the dense
side rather than shipped, so every boundary tensor is batch-shaped.

Facts the server needs come from the model itself: each table's rows and dim
from its initializer, and which table index t each lookup serves from a
differential probe (all ids 0, then ids of table t set to 1: a lookup whose ids
change serves t). This works for per-table slices, offsets into one
concatenated table, and hashing by modulo alike.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from sixfold.backends.api import PartitionArtifact
from sixfold.backends.spec import DeviceSpec
from sixfold.models.signature import DENSE, INDICES, LENGTHS, SCORES

# NOTE: compile imports this module lazily (in partition_file), so importing compile here is no cycle.
from sixfold.partitioner.pricing.estimate import estimate_plan
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION, PartitionedModel
from sixfold.partitioner.pricing.cost import OpCost, PartitionCost
from sixfold.partitioner.pricing.onnx_ops import onnx_op_profile
from sixfold.partitioner.plan import DeviceInfo, PartitionInfo, PartitionPlan, TensorInfo
from sixfold.partitioner.cut.layout import Layout, observed_layout
from sixfold.partitioner.frontends.onnx_bags import CONTROL_FLOW_OPS, BagRewrite, rewrite_loop_bags
from sixfold.partitioner.cut.sparse_dense import DENSE as DENSE_LABEL, HOST
from sixfold.partitioner.placement.strategy import replicate
from sixfold.partitioner.piece_check import PieceCheckError, check_onnx_pieces

__all__ = ["Lookup", "OnnxSplit", "load_onnx", "find_lookups", "cut_onnx", "partition_onnx", "onnx_id_check",
           "LOOKUP_OPS", "POOLING_OPS", "WEIGHTING_OPS", "SHAPE_ONLY_OPS", "MAX_POOLING"]

log = logging.getLogger(__name__)

LOOKUP_OPS = frozenset({"Gather", "GatherND"})
"""A lookup: Gather (axis 0) or GatherND (batch_dims 0, indices [..., 1]) on a rank-2 initializer."""
POOLING_OPS = frozenset({"ReduceSum", "ReduceMean"})
WEIGHTING_OPS = frozenset({"Mul"})
"""Per-sample weights: rows x weights between the lookup and its pooling (EmbeddingBag's per_sample_weights)."""
SHAPE_ONLY_OPS = frozenset({"Reshape", "Unsqueeze", "Squeeze", "Cast", "Identity", "Flatten", "Transpose"})
MAX_POOLING = 256
"""Pooling factors tried, 1..MAX_POOLING, when the caller does not give one."""

_CANONICAL = {DENSE: TensorProto.FLOAT, LENGTHS: TensorProto.INT32, INDICES: TensorProto.INT64}
_KSERVE = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.INT32: "INT32",
           TensorProto.INT64: "INT64", TensorProto.BOOL: "BOOL", TensorProto.DOUBLE: "FP64"}
_PROTOBUF_LIMIT = 2**31 - 1
_OBSERVE_ROWS = (4, 64)
"""Batch sizes observed: their difference gives per-item FLOPs (fixed costs cancel)."""
_VERIFY_ROWS = (1, 4, 64)
_TOLERANCE = 1e-5


@dataclass(frozen=True)
class Lookup:
    """One embedding lookup: a Gather on a table initializer, and the pooling it feeds."""

    gather: str
    """Name of the Gather node."""
    pooling: str | None
    """Name of its ReduceSum/ReduceMean node; None for an unpooled (one-hot) lookup."""
    table: str
    """Name of the table initializer."""
    rows: int
    dim: int
    ids: str
    """The Gather's index tensor."""
    table_indices: tuple[int, ...] = ()
    """Which table indices t of the request this lookup reads (from the probe; empty if unknown)."""
    offsets: tuple[int | None, ...] = ()
    """Per table index read: the row that id 0 lands on (ids shifted into a shared table);
    None when the ids are transformed some other way (hashing, say)."""


@dataclass
class OnnxSplit:
    """The two halves of a cut ONNX model, checked, plus what observing them taught."""

    model: onnx.ModelProto
    """The original model with every node named (the names the plan and drawing use)."""
    host: onnx.ModelProto
    dense: onnx.ModelProto
    lookups: list[Lookup]
    host_inputs: list[str]
    boundary: list[str]
    dense_inputs: list[str]
    """Model inputs the dense side reads, then the boundary."""
    host_nodes: list[str]
    dense_nodes: list[str]
    pooling: int
    tables: dict[str, Any]
    """{"rows": [...] (absent when the mapping is unknown), "dim": D, "pooling": [P] * T}."""
    flops_per_item: float
    """Dense MatMul/Gemm FLOPs per item."""
    lookup_bytes_per_item: float
    dense_input_bytes_per_item: float
    shapes: dict[str, list[int]] = field(default_factory=dict)
    """Observed shape of each model input and boundary tensor (-1 where it varies)."""
    dtypes: dict[str, int] = field(default_factory=dict)
    """ONNX element type of each model input, boundary tensor and output head."""
    layouts: dict[str, Layout] = field(default_factory=dict)
    """Rows per item of each model input, boundary tensor and output head (``_observed_layouts``)."""
    heads: list[str] = field(default_factory=lambda: [SCORES])
    """Every output of the model, named and ordered as the model has them (all served)."""

    @property
    def labels(self) -> dict[str, str]:
        """Node name -> "host" | "dense" (index arithmetic needed by both is labelled host)."""
        host, dense = set(self.host_nodes), set(self.dense_nodes)
        return {n.name: HOST if n.name in host else DENSE_LABEL for n in self.model.graph.node
                if n.name in host | dense}


# --- loading and graph facts -------------------------------------------------------------------


def load_onnx(path: str | Path) -> onnx.ModelProto:
    """Read an ONNX file (external data next to it included); ValueError when it is not ONNX."""
    try:
        return onnx.load(str(path))
    except FileNotFoundError:
        raise
    except Exception as exc:  # protobuf's DecodeError and friends
        raise ValueError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {exc})") from exc


def _named(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose nodes all have unique names (exporters leave many empty)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    seen: set[str] = set()
    for i, node in enumerate(copy.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
            while node.name in seen:
                node.name += "_"
        seen.add(node.name)
    return copy


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    graphs: list[onnx.GraphProto] = []
    for attr in node.attribute:
        if attr.type == AttributeProto.GRAPH:
            graphs.append(attr.g)
        elif attr.type == AttributeProto.GRAPHS:
            graphs.extend(attr.graphs)
    return graphs


def _node_inputs(node: onnx.NodeProto) -> list[str]:
    """Tensors a node reads, including outer-scope names its subgraphs (If/Loop/Scan) read."""
    names = [t for t in node.input if t]
    for graph in _subgraphs(node):
        local = ({i.name for i in graph.input} | {i.name for i in graph.initializer}
                 | {o for n in graph.node for o in n.output})
        names += [t for n in graph.node for t in _node_inputs(n) if t not in local]
        names += [o.name for o in graph.output if o.name not in local]
    return list(dict.fromkeys(names))


class _Graph:
    """Producer/consumer maps and the model inputs each node depends on."""

    def __init__(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        self.nodes = list(graph.node)
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.initializers = {t.name: t for t in graph.initializer}
        self.inputs = {i.name: i for i in graph.input if i.name not in self.initializers}
        self.producer = {t: n.name for n in self.nodes for t in n.output if t}
        self.reads = {n.name: _node_inputs(n) for n in self.nodes}
        self.consumers: dict[str, list[str]] = {}
        for node in self.nodes:
            for t in self.reads[node.name]:
                self.consumers.setdefault(t, []).append(node.name)
        # Model inputs each tensor depends on, in topological order (ONNX requires it).
        depends: dict[str, frozenset[str]] = {t: frozenset({t}) for t in self.inputs}
        self.depends_on: dict[str, frozenset[str]] = {}
        for node in self.nodes:
            deps = frozenset().union(*(depends.get(t, frozenset()) for t in self.reads[node.name]))
            self.depends_on[node.name] = deps
            for t in node.output:
                depends[t] = deps

    def node(self, name: str) -> onnx.NodeProto:
        return self.nodes[self.index[name]]

    def ancestors(self, names: Iterable[str]) -> set[str]:
        """The nodes ``names`` and every node they transitively read from."""
        seen: set[str] = set()
        stack = list(names)
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            stack.extend(self.producer[t] for t in self.reads[name] if t in self.producer)
        return seen

    def ordered(self, names: Iterable[str]) -> list[str]:
        return sorted(set(names), key=self.index.__getitem__)


def _check_signature(graph: _Graph, where: str) -> None:
    have = {name: vi.type.tensor_type.elem_type for name, vi in graph.inputs.items()}
    missing = [n for n in _CANONICAL if n not in have]
    if missing:
        hint = ""
        if set(have) & set(_CANONICAL):
            hint = ("; a model that never reads an input loses it in some exporters (torch.onnx.export with "
                    "dynamo=False does): export with dynamo=True, which keeps every input")
        raise ValueError(f"{where}: the model's inputs are {sorted(have)}; a recommendation model must take "
                         f"{list(_CANONICAL)} (missing {missing}){hint}")
    for name, want in _CANONICAL.items():
        if have[name] != want:
            raise ValueError(f"{where}: input {name} is {TensorProto.DataType.Name(have[name])}; the canonical "
                             f"request has {TensorProto.DataType.Name(want)}")
    extra = sorted(set(have) - set(_CANONICAL))
    if extra:
        raise ValueError(f"{where}: the model takes inputs {extra} beyond the canonical request {list(_CANONICAL)}")


def _static_dim(vi: onnx.ValueInfoProto, axis: int) -> int:
    dims = vi.type.tensor_type.shape.dim
    return dims[axis].dim_value if len(dims) > axis and dims[axis].HasField("dim_value") else -1


# --- the policy: lookups and their ancestors go to the host -----------------------------------


def find_lookups(model: onnx.ModelProto) -> list[Lookup]:
    """Every Gather/GatherND on a rank-2 initializer whose ids derive from ``sparse_indices``, with its pooling.

    ``model`` must have named nodes (``cut_onnx`` names them); the pooling node
    is the first ReduceSum/ReduceMean reached through shape-only ops and
    per-sample weighting (a Mul: EmbeddingBag with per_sample_weights).
    """
    graph = _Graph(model)
    lookups = []
    for node in graph.nodes:
        if node.op_type not in LOOKUP_OPS or node.domain not in ("", "ai.onnx") or len(node.input) < 2:
            continue
        table = graph.initializers.get(node.input[0])
        if table is None or len(table.dims) != 2 or INDICES not in graph.depends_on[node.name]:
            continue
        if node.op_type == "Gather" and next((a.i for a in node.attribute if a.name == "axis"), 0) != 0:
            continue
        if node.op_type == "GatherND" and next((a.i for a in node.attribute if a.name == "batch_dims"), 0) != 0:
            continue  # NOTE: GatherND indices end in a dim of 1 (a row each): [..., 1] -> rows [..., dim]
        lookups.append(Lookup(gather=node.name, pooling=_pooling_of(graph, node), table=table.name,
                              rows=int(table.dims[0]), dim=int(table.dims[1]), ids=node.input[1]))
    return lookups


def _pooling_of(graph: _Graph, gather: onnx.NodeProto) -> str | None:
    stack, seen = [gather.output[0]], set()
    while stack:
        tensor = stack.pop(0)
        for name in graph.consumers.get(tensor, []):
            node = graph.node(name)
            # Shape-only ops carry the rows as their first input; a weighting Mul may take them either side.
            if name in seen or not node.input or (node.input[0] != tensor and node.op_type not in WEIGHTING_OPS):
                continue
            seen.add(name)
            if node.op_type in POOLING_OPS:
                return name
            if node.op_type in SHAPE_ONLY_OPS or node.op_type in WEIGHTING_OPS:
                stack.extend(t for t in node.output if t)
    return None


@dataclass
class _Cut:
    host_nodes: list[str]
    dense_nodes: list[str]
    host_inputs: list[str]
    boundary: list[str]
    dense_inputs: list[str]


def _cut(graph: _Graph, lookups: list[Lookup], heads: Sequence[str], where: str) -> _Cut:
    """Host = lookups, poolings and their ancestors; dense = what the heads need beyond the boundary."""
    seeds = [lk.gather for lk in lookups] + [lk.pooling for lk in lookups if lk.pooling]
    host = graph.ancestors(seeds)
    dense: set[str] = set()
    boundary: set[str] = set()
    dense_inputs: set[str] = set()
    stack, seen = list(heads), set()
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        if tensor in graph.inputs:
            dense_inputs.add(tensor)
            continue
        if tensor in graph.initializers:
            continue
        producer = graph.producer.get(tensor)
        if producer is None:
            raise ValueError(f"{where}: tensor {tensor!r} is read but nothing produces it")
        # NOTE: host index arithmetic that never reads the ids (a batch size, a shape constant)
        # is recomputed on the dense side, so only batch-shaped values cross the cut.
        if producer in host and INDICES in graph.depends_on[producer]:
            boundary.add(tensor)
            continue
        dense.add(producer)
        stack.extend(graph.reads[producer])
    on_host = [h for h in heads if h in boundary or h in graph.inputs]
    if on_host:
        raise ValueError(f"{where}: output {on_host[0]!r} is computed on the host side of the cut (it depends on "
                         "the lookups with nothing dense after them, or is an input); nothing to place on the cards")
    if not boundary:
        raise ValueError(f"{where}: no lookup output reaches the outputs {list(heads)}; found lookups "
                         f"{[lk.gather for lk in lookups]} but the outputs do not depend on them")
    order = {t: (graph.index[graph.producer[t]], list(graph.node(graph.producer[t]).output).index(t))
             for t in boundary}
    boundary_list = sorted(boundary, key=order.__getitem__)
    host_nodes = graph.ordered(graph.ancestors(graph.producer[t] for t in boundary_list))
    host_reads = {t for n in host_nodes for t in graph.reads[n]}
    canonical = list(_CANONICAL)
    return _Cut(host_nodes=host_nodes, dense_nodes=graph.ordered(dense),
                host_inputs=[n for n in canonical if n in host_reads],
                boundary=boundary_list,
                dense_inputs=[n for n in canonical if n in dense_inputs] + boundary_list)


# --- observing the model on example requests ----------------------------------------------------


class _ModelFails(PieceCheckError):
    """The original model fails on an observed request: refused naming its size (the piece check's words)."""

    def __init__(self, items: int, reason: str) -> None:
        super().__init__(f"the model itself fails on a {items}-item request: {reason}. The server is asked for any "
                         "batch size from 1 up; make the model run at every size")
        self.reason = reason


class _Runner:
    """The original model with extra tensors exposed as outputs, in one onnxruntime session."""

    def __init__(self, model: onnx.ModelProto, graph: _Graph, extra: Iterable[str]) -> None:
        import onnxruntime as ort
        outputs = model.graph.output
        kept = len(outputs)
        have = {o.name for o in outputs}
        # NOTE: outputs are added to ``model`` for the serialization only (no copy of the tables).
        try:
            for tensor in dict.fromkeys(extra):
                if tensor not in have and tensor in graph.producer:
                    outputs.append(onnx.ValueInfoProto(name=tensor))  # its type is left to onnxruntime
            data = model.SerializeToString()
        finally:
            del outputs[kept:]
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.log_severity_level = 4  # the pooling search expects failures; they are reported, not logged
        self.session = ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])
        self.model = model

    def run(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every exposed tensor, plus the feed itself (a lookup may read ``sparse_indices`` directly).

        PieceCheckError naming the request size when the model fails on it (callers that
        search, such as the pooling search, catch it and try another request).
        """
        names = [o.name for o in self.session.get_outputs()]
        try:
            return {**feed, **dict(zip(names, self.session.run(names, feed)))}
        except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own types
            raise _ModelFails(len(feed[DENSE]), f"{type(exc).__name__}: {_short(exc)}") from None


def _session(model: onnx.ModelProto, quiet: bool = False) -> Any:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4 if quiet else 3
    return ort.InferenceSession(model.SerializeToString(), sess_options=options,
                                providers=["CPUExecutionProvider"])


def _request(rows: int, dense_dim: int, tables: int, pooling: int, ids: np.ndarray | None = None,
             seed: int = 0) -> dict[str, np.ndarray]:
    """A canonical request: ``ids`` laid out [rows, tables, pooling] (zeros when None), sample-major."""
    rng = np.random.default_rng(seed)
    if ids is None:
        ids = np.zeros((rows, tables, pooling), dtype=np.int64)
    return {DENSE: rng.standard_normal((rows, dense_dim), dtype=np.float32),
            LENGTHS: np.full((rows, tables), pooling, dtype=np.int32),
            INDICES: np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)}


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


def _find_pooling(runner: _Runner, heads: Sequence[str], dense_dim: int, tables: int, pooling: int | None,
                  where: str) -> int:
    """The ids per (item, table) the model runs with: ``pooling`` if given, else the first of 1..MAX_POOLING."""
    rows = 5
    last = ""
    for p in ([pooling] if pooling else range(1, MAX_POOLING + 1)):
        try:
            out = runner.run(_request(rows, dense_dim, tables, p))
        except _ModelFails as exc:
            last = f"with pooling {p}: {exc.reason}"
            continue
        bad = next((h for h in heads if out[h].ndim < 2 or out[h].shape[0] != rows), None)
        if bad is None:
            return p
        last = (f"with pooling {p}: output {bad!r} came out {list(out[bad].shape)} for a {rows}-item request, "
                f"not [{rows}, k] (every output must be item-major, one row of k values per item)")
    tried = f"pooling {pooling}" if pooling else f"every pooling factor 1..{MAX_POOLING}"
    raise ValueError(f"{where}: the model does not run on a canonical request with {tried} ids per "
                     f"(item, table); last error {last}" + ("" if pooling else "; pass --pooling"))


def _probe_tables(runner: _Runner, lookups: list[Lookup], dense_dim: int, tables: int,
                  pooling: int) -> list[Lookup]:
    """Which table indices each lookup reads: set table t's ids to 1 (others 0) and see whose ids change.

    Where they change, id 0 reading row o and id 1 reading row o + 1 means the
    ids are shifted by o into a shared table (offsets); anything else is "transformed".
    """
    if min(lk.rows for lk in lookups) < 2:
        return lookups
    rows = 3
    base = runner.run(_request(rows, dense_dim, tables, pooling))
    reads: dict[str, list[tuple[int, int | None]]] = {lk.gather: [] for lk in lookups}
    for t in range(tables):
        ids = np.zeros((rows, tables, pooling), dtype=np.int64)
        ids[:, t, :] = 1
        probe = runner.run(_request(rows, dense_dim, tables, pooling, ids))
        for lk in lookups:
            before, after = np.asarray(base[lk.ids]), np.asarray(probe[lk.ids])
            if before.shape == after.shape and np.array_equal(before, after):
                continue
            offset = None
            if before.shape == after.shape:
                changed = before != after
                was, now = np.unique(before[changed]), np.unique(after[changed])
                if len(was) == 1 and len(now) == 1 and int(now[0]) == int(was[0]) + 1:
                    offset = int(was[0])
            reads[lk.gather].append((t, offset))
    reads = _probe_large_ids(runner, lookups, reads, dense_dim, tables, pooling, base)
    return [replace(lk, table_indices=tuple(t for t, _ in reads[lk.gather]),
                    offsets=tuple(o for _, o in reads[lk.gather])) for lk in lookups]


_LARGE_ID = (1 << 33) + 7
"""A probe id past any table: a shifted id moves its row by exactly this much, a hashed one does not."""


def _probe_large_ids(runner: _Runner, lookups: list[Lookup], reads: dict[str, list[tuple[int, int | None]]],
                     dense_dim: int, tables: int, pooling: int,
                     base: dict[str, np.ndarray]) -> dict[str, list[tuple[int, int | None]]]:
    """Ids 0 and 1 cannot tell ``id % rows`` from ``id``: run the index arithmetic alone on a large id too.

    Only the ancestors of the lookups' ids run (no table, so no Gather out of range); where the ids
    of a shifted-looking table index do not move by exactly the large id, they are transformed.
    """
    session, outputs = _ids_only(runner.model, lookups)
    if session is None:
        return reads
    rows = 3
    feeds = [i.name for i in session.get_inputs()]
    before = {lk.ids: base[lk.ids] for lk in lookups}
    out: dict[str, list[tuple[int, int | None]]] = {g: list(r) for g, r in reads.items()}
    for t in range(tables):
        if not any(o is not None and tt == t for r in reads.values() for tt, o in r):
            continue
        ids = np.zeros((rows, tables, pooling), dtype=np.int64)
        ids[:, t, :] = _LARGE_ID
        request = _request(rows, dense_dim, tables, pooling, ids)
        try:
            got = dict(zip(outputs, session.run(outputs, {n: request[n] for n in feeds})))
        except Exception:  # noqa: BLE001 - the index arithmetic refuses such an id: leave the first probe's answer
            continue
        for lk in lookups:
            entry = next(((i, o) for i, (tt, o) in enumerate(out[lk.gather]) if tt == t and o is not None), None)
            if entry is None:
                continue
            after, was = np.asarray(got[f"{lk.ids}__probe"]), np.asarray(before[lk.ids])
            moved = (after.astype(np.int64) - was.astype(np.int64))[after != was] if after.shape == was.shape else None
            if moved is None or moved.size == 0 or not np.all(moved == _LARGE_ID):
                out[lk.gather][entry[0]] = (t, None)
    return out


def _ids_model(model: onnx.ModelProto, lookups: list[Lookup], suffix: str
               ) -> tuple[onnx.ModelProto, list[str], list[str]]:
    """A model computing only the lookups' ids (their ancestors, no table): (model, ids, its outputs ``ID__suffix``)."""
    graph = _Graph(model)
    ids = list(dict.fromkeys(lk.ids for lk in lookups))
    nodes = graph.ordered(graph.ancestors(graph.producer[t] for t in ids if t in graph.producer))
    needed = {t for n in nodes for t in graph.reads[n]} | set(ids)
    outputs = [f"{t}__{suffix}" for t in ids]
    body = helper.make_graph(
        [graph.node(n) for n in nodes] + [helper.make_node("Identity", [t], [o]) for t, o in zip(ids, outputs)],
        f"ids_{suffix}", [vi for name, vi in graph.inputs.items() if name in needed],
        [onnx.ValueInfoProto(name=o) for o in outputs],
        initializer=[t for t in model.graph.initializer if t.name in needed])
    return helper.make_model(body, opset_imports=list(model.opset_import), ir_version=model.ir_version), ids, outputs


def _ids_only(model: onnx.ModelProto, lookups: list[Lookup]) -> tuple[Any, list[str]]:
    """An onnxruntime session computing only the lookups' ids (their ancestors, no table), or (None, [])."""
    ids_model, _, outputs = _ids_model(model, lookups, "probe")
    try:
        return _session(ids_model, quiet=True), outputs
    except Exception:  # noqa: BLE001 - a graph that cannot stand alone: keep the first probe's answer
        return None, []


def _table_facts(lookups: list[Lookup], tables: int, pooling: int, where: str) -> dict[str, Any]:
    """{"rows", "dim", "pooling"} in table-index order; "rows" is left out (range checks off) if unknown."""
    problems: list[str] = []
    rows: list[int] = []
    dims: list[int] = []
    if min(lk.rows for lk in lookups) < 2:
        problems.append("a table has fewer than 2 rows, so the probe cannot tell lookups apart")
    for t in range(tables):
        reads = [(lk, lk.offsets[lk.table_indices.index(t)]) for lk in lookups if t in lk.table_indices]
        if not reads:
            problems.append(f"table index {t} is read by no lookup")
        elif any(offset is None for _, offset in reads):
            problems.append(f"the ids of table index {t} are transformed (not shifted) before the lookup")
        else:
            # The largest id every lookup reading t can take without leaving its table: safe,
            # though loose when the ids are shifted into a table shared with other indices.
            limit = min(lk.rows - offset for lk, offset in reads)  # type: ignore[operator]
            if limit < 1:
                problems.append(f"table index {t}'s ids are shifted past the end of their table")
            rows.append(limit)
            dims.append(max(lk.dim for lk, _ in reads))  # the rows' width, not a per-sample weight's 1
    facts: dict[str, Any] = {"pooling": [pooling] * tables}
    distinct = sorted(set(dims) if dims and not problems else {lk.dim for lk in lookups})
    # One dim for all tables (the usual case), else per table index when known.
    facts["dim"] = distinct[0] if len(distinct) == 1 else (distinct if problems else dims)
    if problems:
        log.warning("%s: cannot tell which table serves each table index (%s); ids are range-checked per lookup "
                    "instead, after the model's index arithmetic", where, "; ".join(problems[:3]))
    else:
        facts["rows"] = rows
    return facts


def _random_ids(rows: int, tables: int, pooling: int, limits: Sequence[int], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    high = np.asarray(limits, dtype=np.int64).reshape(1, tables, 1)
    return (rng.random((rows, tables, pooling)) * high).astype(np.int64)


# --- building the two models --------------------------------------------------------------------


def _value_info(name: str, samples: dict[int, np.ndarray]) -> tuple[onnx.ValueInfoProto, list[int]]:
    """A typed ValueInfo from observations at several batch sizes: dim 0 as "N" (or N x k), others fixed."""
    arrays = list(samples.items())
    rank = arrays[0][1].ndim
    dims: list[int | str] = []
    info_shape: list[int] = []
    for axis in range(rank):
        sizes = {rows: a.shape[axis] for rows, a in arrays}
        if len(set(sizes.values())) == 1:
            dims.append(next(iter(sizes.values())))
            info_shape.append(dims[-1])  # type: ignore[arg-type]
            continue
        ratios = {s / r for r, s in sizes.items()}
        ratio = next(iter(ratios))
        dims.append(("N" if ratio == 1 else f"N_x{int(ratio)}") if axis == 0 and len(ratios) == 1
                    and ratio == int(ratio) else f"{name}_d{axis}")
        info_shape.append(-1)
    elem = helper.np_dtype_to_tensor_dtype(arrays[0][1].dtype)
    return helper.make_tensor_value_info(name, elem, dims), info_shape


def _submodel(model: onnx.ModelProto, graph: _Graph, nodes: list[str], inputs: list[onnx.ValueInfoProto],
              outputs: list[onnx.ValueInfoProto], name: str) -> onnx.ModelProto:
    """A standalone model of ``nodes`` (in order) with the initializers and value infos they need."""
    protos = [graph.node(n) for n in nodes]
    read = {t for n in nodes for t in graph.reads[n]}
    produced = {t for p in protos for t in p.output}
    boundary = {vi.name for vi in inputs} | {vi.name for vi in outputs}
    initializers = [t for t in model.graph.initializer if t.name in read]
    value_info = [vi for vi in model.graph.value_info if vi.name in produced and vi.name not in boundary]
    body = helper.make_graph(protos, name, inputs, outputs, initializer=initializers, value_info=value_info)
    sub = helper.make_model(body, opset_imports=list(model.opset_import), producer_name="sixfold-partition",
                            ir_version=model.ir_version)
    sub.functions.extend(model.functions)
    if sub.ByteSize() > _PROTOBUF_LIMIT:
        raise ValueError(f"the {name} partition is {sub.ByteSize() / 2**30:.2f} GiB, over ONNX's 2 GiB protobuf "
                         "limit; tables that large need external data, which the ONNX frontend does not write yet")
    onnx.checker.check_model(sub)
    return sub


def _shape(tensor: str, observed: dict[str, np.ndarray], graph: _Graph) -> tuple[int, ...]:
    if tensor in observed:
        return tuple(observed[tensor].shape)
    return tuple(int(d) for d in graph.initializers[tensor].dims)


def _matmul_flops(graph: _Graph, nodes: list[str], observed: dict[str, np.ndarray]) -> int:
    """2 x M x N x K for every MatMul and Gemm (elementwise ops are not counted, as in the torch path)."""
    total = 0
    for name in nodes:
        node = graph.node(name)
        if node.op_type not in ("MatMul", "Gemm"):
            continue
        a, out = _shape(node.input[0], observed, graph), _shape(node.output[0], observed, graph)
        if node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute):
            k = a[0]
        else:
            k = a[-1]
        total += 2 * math.prod(out) * k
    return total


def _itemsize(elem_type: int) -> int:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize


def _lookup_bytes(graph: _Graph, lookups: list[Lookup], tables: int, pooling: int) -> float:
    """Bytes one item's lookups read: per table index, ``pooling`` rows of its table plus the ids (int64)."""
    def row_bytes(lk: Lookup) -> int:
        return lk.dim * _itemsize(graph.initializers[lk.table].data_type)
    total = 0.0
    for t in range(tables):
        serving = [lk for lk in lookups if t in lk.table_indices] or lookups  # unknown: the widest table
        total += pooling * (max(row_bytes(lk) for lk in serving) + 8)
    return total


def _initializer_bytes(model: onnx.ModelProto) -> int:
    return sum(math.prod(t.dims) * _itemsize(t.data_type) for t in model.graph.initializer)


def cut_onnx(model: onnx.ModelProto, *, pooling: int | None = None, where: str = "model",
             vectorise_bags: bool = True) -> OnnxSplit:
    """Cut ``model`` into checked host and dense ONNX models (``model`` itself is left intact).

    ``pooling``: ids per (item, table) to observe the model with; None tries
    1..MAX_POOLING and keeps the first the model runs with. ``where`` names the
    model in error messages. ``vectorise_bags``: rewrite torch's ``Loop`` EmbeddingBags
    (``onnx_bags.py``); a rewrite that answers differently from the model is dropped (warned).
    Raises ValueError when the model is not a recommendation model this frontend
    understands (the message says why).
    """
    named = _named(model)
    bags: list[BagRewrite] = []
    if vectorise_bags:
        named, bags = rewrite_loop_bags(named)
    graph = _Graph(named)
    _check_signature(graph, where)
    heads = [o.name for o in named.graph.output]  # every output is served, named as the model names it
    if not heads:
        raise ValueError(f"{where}: the model has no outputs")
    dense_dim, tables = _static_dim(graph.inputs[DENSE], 1), _static_dim(graph.inputs[LENGTHS], 1)
    if dense_dim < 1 or tables < 1:
        raise ValueError(f"{where}: only the batch and id-count dimensions may be dynamic; {DENSE} has "
                         f"{dense_dim if dense_dim > 0 else '?'} features and {LENGTHS} "
                         f"{tables if tables > 0 else '?'} tables (need fixed sizes)")
    lookups = find_lookups(named)
    if not lookups:
        gathers = [n.name for n in graph.nodes if n.op_type in LOOKUP_OPS]
        tables = {t for t, init in graph.initializers.items() if len(init.dims) == 2}
        loops = [n.name for n in graph.nodes if n.op_type in CONTROL_FLOW_OPS and tables & set(graph.reads[n.name])]
        hint = (f"; control-flow nodes {loops[:5]} read tables inside their bodies: an EmbeddingBag form sixfold "
                "does not recognise (sum and mean are; max is not)" if loops else "")
        raise ValueError(f"{where}: no embedding lookup found (a Gather or GatherND on a rank-2 initializer whose "
                         f"ids come from {INDICES}); Gather nodes present: {gathers or 'none'}; nothing to place on "
                         f"the host{hint}")
    if bags:
        pooled = {b.gather: b.pooling for b in bags}
        lookups = [replace(lk, pooling=pooled.get(lk.gather, lk.pooling)) for lk in lookups]
    cut = _cut(graph, lookups, heads, where)

    dense_ops = {n for n in cut.dense_nodes if graph.node(n).op_type in ("MatMul", "Gemm")}
    extra = [*cut.boundary, *(lk.ids for lk in lookups),
             *(t for n in sorted(dense_ops) for t in (graph.node(n).input[0], graph.node(n).output[0]))]
    try:
        runner = _Runner(named, graph, extra)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{where}: onnxruntime cannot load the model: {_short(exc)}") from exc
    pooling = _find_pooling(runner, heads, dense_dim, tables, pooling, where)
    lookups = _probe_tables(runner, lookups, dense_dim, tables, pooling)
    facts = _table_facts(lookups, tables, pooling, where)
    # NOTE: without a mapping only ids 0 and 1 are known to be safe (the probe ran them).
    limits = facts.get("rows") or [2] * tables

    feeds = {rows: _request(rows, dense_dim, tables, pooling, _random_ids(rows, tables, pooling, limits, rows),
                            seed=rows) for rows in sorted({*_OBSERVE_ROWS, *_VERIFY_ROWS})}
    observed = {rows: runner.run(feed) for rows, feed in feeds.items()}
    layouts = _observed_layouts(runner, observed, [*graph.inputs, *cut.boundary, *heads], dense_dim, tables,
                                pooling, limits)
    infos: dict[str, onnx.ValueInfoProto] = {}
    shapes: dict[str, list[int]] = {}
    for tensor in cut.boundary:
        infos[tensor], shapes[tensor] = _value_info(tensor, {r: observed[r][tensor] for r in _OBSERVE_ROWS})
        if shapes[tensor][:1] != [-1] or any(observed[r][tensor].shape[0] % r for r in _OBSERVE_ROWS):
            log.warning("%s: boundary tensor %s has shape %s, not rows-first; the server cannot split it "
                        "across cards", where, tensor, shapes[tensor])
    model_inputs = {vi.name: vi for vi in graph.inputs.values()}
    for head in heads:
        shapes[head] = _value_info(head, {r: observed[r][head] for r in _OBSERVE_ROWS})[1]
    for name, vi in model_inputs.items():
        rank = len(vi.type.tensor_type.shape.dim)
        shapes[name] = [-1] + [_static_dim(vi, axis) for axis in range(1, rank)]
    head_infos = {o.name: o for o in named.graph.output}

    host = _submodel(named, graph, cut.host_nodes, [model_inputs[n] for n in cut.host_inputs],
                     [infos[t] for t in cut.boundary], "host")
    dense = _submodel(named, graph, cut.dense_nodes,
                      [model_inputs[n] if n in model_inputs else infos[n] for n in cut.dense_inputs],
                      [head_infos[h] for h in heads], "dense")
    _verify(host, dense, cut, heads, feeds, observed, where)
    if bags and not _same_as_original(model, named, heads, feeds, observed, dense_dim, tables, pooling, limits):
        log.warning("%s: the vectorised EmbeddingBag Loops (%s) answer differently from the model; keeping "
                    "the Loops", where, ", ".join(b.loop for b in bags))
        return cut_onnx(model, pooling=pooling, where=where, vectorise_bags=False)
    if bags:
        log.info("%s: %d EmbeddingBag Loop(s) vectorised into host lookups (%s)", where, len(bags),
                 ", ".join(sorted({b.mode for b in bags})))
    _warn_off_card(dense, where)
    _warn_slow_index_arithmetic(host, {r: {n: feeds[r][n] for n in cut.host_inputs} for r in _OBSERVE_ROWS}, where)

    small, large = _OBSERVE_ROWS
    flops = (_matmul_flops(graph, cut.dense_nodes, observed[large])
             - _matmul_flops(graph, cut.dense_nodes, observed[small])) / (large - small)
    dense_in = sum(observed[large][n].nbytes for n in cut.dense_inputs) / large
    lookup_bytes = _lookup_bytes(graph, lookups, tables, pooling)
    dtypes = {n: vi.type.tensor_type.elem_type for n, vi in {**model_inputs, **infos}.items()}
    dtypes.update({h: head_infos[h].type.tensor_type.elem_type for h in heads})
    return OnnxSplit(model=named, host=host, dense=dense, lookups=lookups, host_inputs=cut.host_inputs,
                     boundary=cut.boundary, dense_inputs=cut.dense_inputs, host_nodes=cut.host_nodes,
                     dense_nodes=cut.dense_nodes, pooling=pooling, tables=facts, flops_per_item=flops,
                     lookup_bytes_per_item=lookup_bytes, dense_input_bytes_per_item=dense_in,
                     shapes=shapes, dtypes=dtypes, layouts=layouts, heads=heads)


def _same(got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> bool:
    return all(g.shape == w.shape and bool(np.allclose(g, w, rtol=0, atol=_TOLERANCE)) for g, w in zip(got, want))


def _same_as_original(model: onnx.ModelProto, rewritten: onnx.ModelProto, heads: Sequence[str],
                      feeds: dict[int, dict[str, np.ndarray]], observed: dict[int, dict[str, np.ndarray]],
                      dense_dim: int, tables: int, pooling: int, limits: Sequence[int]) -> bool:
    """The rewritten model's outputs equal the original's on every example request, and on one with empty bags."""
    session = _session(model, quiet=True)
    for rows in _VERIFY_ROWS:
        if not _same([observed[rows][h] for h in heads], session.run(list(heads), feeds[rows])):
            return False
    rng = np.random.default_rng(7)
    lengths = rng.integers(0, pooling + 2, size=(9, tables)).astype(np.int32)
    lengths[0] = 0
    high = np.repeat(np.asarray(limits, dtype=np.int64)[None, :], 9, axis=0)
    ids = np.concatenate([(rng.random(n) * h).astype(np.int64) for n, h in zip(lengths.reshape(-1), high.reshape(-1))])
    feed = {DENSE: rng.standard_normal((9, dense_dim), dtype=np.float32), LENGTHS: lengths, INDICES: ids}
    try:
        want = session.run(list(heads), feed)
    except Exception:  # noqa: BLE001 - a fixed-pooling model takes no ragged request
        return True
    try:
        got = _session(rewritten, quiet=True).run(list(heads), feed)
    except Exception:  # noqa: BLE001 - the rewrite fails where the model answers: they differ
        return False
    return _same(got, want)


def _card_ops() -> frozenset[str]:
    from sixfold.backends.conformance.ops import dense_ops
    return frozenset(use["op"] for use in dense_ops()["ops"])


def _all_nodes(graph: onnx.GraphProto) -> Iterable[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _all_nodes(sub)


def _warn_off_card(dense: onnx.ModelProto, where: str) -> list[str]:
    """Warn, naming them, about dense-partition ops outside the card op set (control flow above all)."""
    card = _card_ops()
    off = sorted({n.op_type for n in _all_nodes(dense.graph) if n.op_type not in card and n.op_type != "Constant"})
    flow = [op for op in off if op in CONTROL_FLOW_OPS]
    if flow:
        loops = [n.name for n in dense.graph.node if n.op_type in CONTROL_FLOW_OPS][:5]
        log.warning("%s: the dense partition keeps control-flow ops %s (%s) on the cards: a lookup pattern was not "
                    "recognised, so they run per bag, outside the card op set; ops outside it: %s", where, flow,
                    ", ".join(loops), off)
    elif off:
        log.warning("%s: the dense partition uses ops outside the card op set (backends/conformance/dense_ops.json): "
                    "%s", where, off)
    return off


_REPEAT_ADVICE = ("repeat_interleave in the index arithmetic exports to this (dynamo: a [bags x ids] comparison; "
                  "legacy: a Loop) and runs 10-27x slower at hundreds of items; find each id's bag with a cumulative "
                  "sum of ones at each bag's start instead: starts = cumsum(lengths) - lengths; marks = zeros(ids + 1)"
                  ".scatter_add(0, starts, ones_like(starts)); bag_of_id = cumsum(marks[:ids]) - 1 "
                  "(docs/bring-your-own-model.md, step 8)")


def _warn_slow_index_arithmetic(host: onnx.ModelProto, feeds: dict[int, dict[str, np.ndarray]],
                                where: str) -> list[str]:
    """Warn, naming them, about host nodes that grow with the square of the request (a [bags x ids] comparison)
    or loop over it (a Loop or Scan left after the EmbeddingBag rewrite): the shapes ``repeat_interleave`` exports to.

    ``feeds``: the host inputs at the two observed sizes. Returns the names of the nodes warned about.
    """
    loops = [n.name for n in host.graph.node if n.op_type in CONTROL_FLOW_OPS]
    probe = onnx.ModelProto()
    probe.CopyFrom(host)
    have = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in node.output if t and t not in have)
        have.update(t for t in node.output if t)
    small, large = sorted(feeds)
    try:
        session = _session(probe, quiet=True)
        names = [o.name for o in session.get_outputs()]
        sizes = {rows: dict(zip(names, (np.asarray(a).size for a in session.run(names, feeds[rows]))))
                 for rows in (small, large)}
    except Exception:  # noqa: BLE001 - a graph whose intermediates cannot be outputs: the Loops alone are named
        sizes = {small: {}, large: {}}
    linear = large / small
    square = [n.name for n in host.graph.node if any(
        sizes[small].get(t, 0) > 0 and sizes[large].get(t, 0) > 2 * linear * sizes[small][t] for t in n.output)]
    slow = list(dict.fromkeys(loops + square))
    if slow:
        kinds = sorted({n.op_type for n in host.graph.node if n.name in slow})
        log.warning("%s: the host stage has %s node(s) %s that %s: %s", where, "/".join(kinds), ", ".join(slow[:6]),
                    "loop over the request or grow with its square" if loops and square else
                    ("loop over the request" if loops else "grow with the square of the request"), _REPEAT_ADVICE)
    return slow


def _observed_layouts(runner: _Runner, observed: dict[int, dict[str, np.ndarray]], names: Sequence[str],
                      dense_dim: int, tables: int, pooling: int, limits: Sequence[int]) -> dict[str, Layout]:
    """Each tensor's rows per item at two batch sizes; ragged (by ``sparse_lengths``) where they change with the pooling.

    An ONNX graph carries no symbolic batch, so the layouts are observed: k rows per item at
    both sizes, unless a request with one more id per (item, table) changes the count (one
    row per id, not per item). A model that runs at one pooling only keeps its per-item k.
    """
    small, large = _OBSERVE_ROWS
    found = {n: observed_layout(observed[small].get(n), small, observed[large].get(n), large) for n in names}
    try:
        other = runner.run(_request(small, dense_dim, tables, pooling + 1,
                                    _random_ids(small, tables, pooling + 1, limits, small), seed=small))
    except Exception:  # noqa: BLE001 - the model takes only its one pooling: its ids per item are fixed
        return found
    for n, layout in found.items():
        if layout.per_item and n in other and other[n].ndim and other[n].shape[0] != layout.rows_per_item * small:
            found[n] = Layout(None, LENGTHS)
    return found


def _verify(host: onnx.ModelProto, dense: onnx.ModelProto, cut: _Cut, heads: Sequence[str],
            feeds: dict[int, dict[str, np.ndarray]], observed: dict[int, dict[str, np.ndarray]], where: str) -> None:
    """host∘dense must answer like the model to 1e-5 on every example request; RuntimeError if not."""
    host_session, dense_session = _session(host), _session(dense)
    for rows in _VERIFY_ROWS:
        feed = feeds[rows]
        boundary = dict(zip(cut.boundary, host_session.run(cut.boundary, {n: feed[n] for n in cut.host_inputs})))
        env = {**feed, **boundary}
        got = dense_session.run(list(heads), {n: env[n] for n in cut.dense_inputs})
        for head, scores in zip(heads, got):
            want = observed[rows][head]
            if scores.shape != want.shape or not np.allclose(scores, want, rtol=0, atol=_TOLERANCE):
                gap = float(np.max(np.abs(scores - want))) if scores.shape == want.shape else float("nan")
                raise RuntimeError(f"{where}: the cut model's {head!r} differs from the original on a {rows}-item "
                                   f"request (shapes {list(scores.shape)} vs {list(want.shape)}, largest gap "
                                   f"{gap:.3g} > {_TOLERANCE}); this is a partitioner bug, please report it")


# --- the partitioned model --------------------------------------------------------------------


def _tensor_info(split: OnnxSplit, name: str) -> TensorInfo:
    shape = list(split.shapes.get(name, [-1, 1]))
    if shape:
        shape[0] = -1
    layout = split.layouts.get(name, Layout(None))
    return TensorInfo(name=name, datatype=_KSERVE.get(split.dtypes[name], TensorProto.DataType.Name(
        split.dtypes[name])), shape=shape, rows_per_item=layout.rows_per_item, ragged_by=layout.ragged_by)


def _example(split: OnnxSplit) -> Any:
    """n -> a canonical n-item request with valid ids, as the cut observed the model with."""
    tables = len(split.tables["pooling"])
    limits = split.tables.get("rows") or [2] * tables  # unknown mapping: ids 0 and 1 are the probed ones
    dense_dim = split.shapes[DENSE][1]

    def example(rows: int) -> dict[str, np.ndarray]:
        ids = _random_ids(rows, tables, split.pooling, limits, seed=1000 + rows)
        return _request(rows, dense_dim, tables, split.pooling, ids, seed=1000 + rows)
    return example


def _op_profiles(split: OnnxSplit) -> tuple[tuple[OpCost, ...], tuple[OpCost, ...]]:
    """Host and dense op profiles at the observed sizes (priced op by op on a calibrated spec)."""
    example, (small, large) = _example(split), _OBSERVE_ROWS
    requests = {rows: example(rows) for rows in (small, large)}
    host = _session(split.host)
    crossing = {rows: dict(zip(split.boundary, host.run(split.boundary, {n: requests[rows][n] for n in
                                                                          split.host_inputs})))
                for rows in (small, large)}
    return (onnx_op_profile(split.host, requests[small], small, requests[large], large),
            onnx_op_profile(split.dense, {**requests[small], **crossing[small]}, small,
                            {**requests[large], **crossing[large]}, large))


def _check_pieces(model: onnx.ModelProto, split: OnnxSplit, where: str) -> None:
    """Refuse the plan unless host.onnx then dense.onnx answer like the original file at 1, 2, 3, 7 and 64
    items and on a jagged request with empty bags (``piece_check.check_onnx_pieces``)."""
    example = _example(split)
    try:
        checked = check_onnx_pieces(model, split.host, split.dense, host_inputs=split.host_inputs,
                                    boundary=split.boundary, dense_inputs=split.dense_inputs, heads=split.heads,
                                    example=example)
    except PieceCheckError as exc:
        raise PieceCheckError(f"{where}: {exc}") from None
    log.info("%s: pieces checked against the model on a %s", where, ", a ".join(checked))


def partition_onnx(source: str | Path | onnx.ModelProto, *, cards: list[DeviceSpec], host: DeviceSpec,
                   name: str | None = None, pooling: int | None = None, strategy: str = "auto",
                   batch_rows: int = 256) -> PartitionedModel:
    """Cut an ONNX recommendation model, place it like ``partition_model`` does, and return a PartitionedModel.

    Both partitions are ONNX: the host one (tables and lookups) for the
    onnxruntime backend on the host, the dense one for the cards. The dense
    partition is replicated ("auto" and "replicate"); a pipeline needs a torch model.
    """
    if strategy not in ("auto", "replicate"):
        raise ValueError(f"strategy {strategy!r} is not available for ONNX models (their dense partition is "
                         "one ONNX graph); use replicate, or export the model with torch.export (.pt2)")
    where = str(source) if not isinstance(source, onnx.ModelProto) else (name or "model")
    model = source if isinstance(source, onnx.ModelProto) else load_onnx(source)
    try:
        split = cut_onnx(model, pooling=pooling, where=where)
    except PieceCheckError as exc:
        raise PieceCheckError(f"{where}: {exc}") from None
    name = name or (Path(source).stem if not isinstance(source, onnx.ModelProto) else model.graph.name or "model")
    _check_pieces(model, split, where)

    host_bytes, dense_bytes = _initializer_bytes(split.host), _initializer_bytes(split.dense)
    host_ops, dense_ops = _op_profiles(split)  # priced op by op on a calibrated spec
    host_cost = PartitionCost(param_bytes=host_bytes, flops_per_item=0.0,
                              bytes_per_item=split.lookup_bytes_per_item, weight_bytes_per_batch=0, ops=host_ops)
    dense_cost = PartitionCost(param_bytes=dense_bytes, flops_per_item=split.flops_per_item,
                               bytes_per_item=2.0 * split.dense_input_bytes_per_item,
                               weight_bytes_per_batch=dense_bytes, ops=dense_ops)
    host_info = DeviceInfo(id="host", spec=host)
    card_infos = [DeviceInfo(id=f"card{i}", spec=spec) for i, spec in enumerate(cards)]
    placements = replicate(HOST_PARTITION, DENSE_PARTITION, dense_cost, host_info, card_infos)
    costs = {HOST_PARTITION: host_cost, DENSE_PARTITION: dense_cost}
    out_bytes = sum(_itemsize(split.dtypes[h]) * math.prod(max(d, 1) for d in split.shapes[h][1:])
                    for h in split.heads)
    io_bytes = {HOST_PARTITION: (0.0, 0.0),
                DENSE_PARTITION: (split.dense_input_bytes_per_item, float(out_bytes))}
    estimates = estimate_plan([host_info, *card_infos], placements, costs, io_bytes, batch_rows)

    info = lambda names: [_tensor_info(split, n) for n in names]  # noqa: E731
    inputs = info([DENSE, LENGTHS, INDICES])
    host_part = PartitionInfo(
        name=HOST_PARTITION, kind="sparse", format="onnx", inputs=info(split.host_inputs),
        outputs=info(split.boundary), nodes=split.host_nodes, param_bytes=host_bytes, flops_per_item=0.0,
        bytes_per_item=host_cost.bytes_per_item)
    ragged = [f"{n!r} is {split.layouts.get(n, Layout(None)).describe()}" for n in [*split.dense_inputs, *split.heads]
              if not split.layouts.get(n, Layout(None)).per_item]
    dense_part = PartitionInfo(
        name=DENSE_PARTITION, kind="dense", format="onnx", inputs=info(split.dense_inputs),
        outputs=info(split.heads), nodes=split.dense_nodes, param_bytes=dense_bytes,
        flops_per_item=dense_cost.flops_per_item, bytes_per_item=dense_cost.bytes_per_item,
        unsplittable=f"card input {'; '.join(ragged)}: only a whole batch is right for it" if ragged else "")
    if ragged:
        log.warning("%s: batches are never split across cards: %s", name, dense_part.unsplittable)
    plan = PartitionPlan(model=name, strategy="replicate", inputs=inputs, outputs=info(split.heads),
                         partitions=[host_part, dense_part], devices=[host_info, *card_infos],
                         placements=placements, estimates=estimates, tables=dict(split.tables))
    artifacts = {
        HOST_PARTITION: PartitionArtifact(
            name=HOST_PARTITION, format="onnx", payload=split.host.SerializeToString(),
            input_names=tuple(split.host_inputs), output_names=tuple(split.boundary), param_bytes=host_bytes,
            flops_per_item=0.0, bytes_per_item=host_cost.bytes_per_item, layouts=host_part.layouts()),
        DENSE_PARTITION: PartitionArtifact(
            name=DENSE_PARTITION, format="onnx", payload=split.dense.SerializeToString(),
            input_names=tuple(split.dense_inputs), output_names=tuple(split.heads), param_bytes=dense_bytes,
            flops_per_item=dense_cost.flops_per_item, bytes_per_item=dense_cost.bytes_per_item,
            layouts=dense_part.layouts()),
    }
    return PartitionedModel(plan=plan, artifacts=artifacts, split=None, graph=split.model, labels=split.labels)


def onnx_id_check(host: bytes | onnx.ModelProto, input_names: Sequence[str]) -> Any:
    """A per-lookup range check of an ONNX host partition (``sixfold.partitioner.tables.id_check.IdCheck``), or None.

    Keeps the host model's index arithmetic only (the ancestors of each lookup's
    ids, no table) and runs it on a request in onnxruntime.
    """
    from sixfold.partitioner.tables.id_check import IdCheck, LookupRange

    model = _named(host if isinstance(host, onnx.ModelProto) else onnx.load_from_string(host))
    lookups = find_lookups(model)
    if not lookups:
        return None
    ids_model, ids, outputs = _ids_model(model, lookups, "rows")
    session = _session(ids_model)
    feeds = [i.name for i in session.get_inputs()]
    order = [outputs[ids.index(lk.ids)] for lk in lookups]

    def run(inputs):
        out = dict(zip(outputs, session.run(outputs, {n: np.asarray(inputs[n]) for n in feeds})))
        return [out[o].reshape(-1) for o in order]

    return IdCheck(run, [LookupRange(lk.gather, lk.rows) for lk in lookups])
