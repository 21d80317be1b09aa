"""ONNX models written here (onnx.helper, not the zoo) are cut, checked and served like the original.

Every model has a numpy twin, so the original ONNX model, the cut and the
written artifacts are all compared against an answer computed without ONNX.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from sixfold.backends.api import PartitionArtifact
from sixfold.backends.registry import get_backend
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_file
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.frontends.onnx_frontend import cut_onnx, find_lookups, partition_onnx
from sixfold.partitioner.plan import PartitionPlan

DENSE, LENGTHS, INDICES, SCORES = "dense_features", "sparse_lengths", "sparse_indices", "scores"


# --- models written with onnx.helper, and their numpy twins ------------------------------------


@dataclass
class Dlrm:
    """An ONNX DLRM-like model and what it computes, in numpy."""

    model: onnx.ModelProto
    tables: list[np.ndarray]
    """Table t's weights (by table index, whatever the node order)."""
    weights: dict[str, np.ndarray]
    pooling: int
    dense_dim: int
    mean: bool = False
    top_reads_features: bool = False
    lookup_nodes: list[str] = field(default_factory=list)
    pool_nodes: list[str] = field(default_factory=list)

    def reference(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        rows, tables = feed[LENGTHS].shape
        ids = feed[INDICES].reshape(rows, tables, self.pooling)
        pooled = [t[ids[:, i]].astype(np.float64) for i, t in enumerate(self.tables)]
        pooled = [p.mean(1) if self.mean else p.sum(1) for p in pooled]
        w = self.weights
        x = feed[DENSE].astype(np.float64)
        bottom = np.maximum(x @ w["w0"] + w["b0"], 0.0)
        parts = [bottom, *pooled] + ([x] if self.top_reads_features else [])
        h = np.maximum(np.concatenate(parts, 1) @ w["w1"] + w["b1"], 0.0)
        return (1.0 / (1.0 + np.exp(-(h @ w["w2"] + w["b2"])))).astype(np.float32)

    def request(self, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        tables = len(self.tables)
        ids = np.stack([rng.integers(0, t.shape[0], (rows, self.pooling)) for t in self.tables], 1)
        return {DENSE: rng.standard_normal((rows, self.dense_dim), dtype=np.float32),
                LENGTHS: np.full((rows, tables), self.pooling, dtype=np.int32),
                INDICES: ids.reshape(-1).astype(np.int64)}


def _const(name: str, values, dtype=np.int64) -> TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name=name)


def _canonical_inputs(dense_dim: int, tables: int) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info(DENSE, TensorProto.FLOAT, ["N", dense_dim]),
            helper.make_tensor_value_info(LENGTHS, TensorProto.INT32, ["N", tables]),
            helper.make_tensor_value_info(INDICES, TensorProto.INT64, ["L"])]


def _finish(nodes, inits, name: str, dense_dim: int, tables: int) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, _canonical_inputs(dense_dim, tables),
                              [helper.make_tensor_value_info(SCORES, TensorProto.FLOAT, ["N", 1])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="sixfold-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def dlrm(*, rows: tuple[int, ...] = (11, 7, 5), order: tuple[int, ...] = (2, 0, 1), dim: int = 4,
         dense_dim: int = 5, bottom: int = 6, hidden: int = 8, pooling: int = 3, mean: bool = False,
         top_reads_features: bool = False, shared_batch: bool = False, seed: int = 0) -> Dlrm:
    """Tables with different row counts, Gather nodes emitted in ``order`` (not table order), pooled.

    Ids: Reshape(sparse_indices, [-1, T, P]) -> Slice per table -> Squeeze -> Gather
    -> ReduceSum/ReduceMean over the pooling axis; table 1's pooling goes through
    Cast, Unsqueeze and Reshape. ``shared_batch``: the ids' reshape takes N from
    Shape(dense_features), and the dense side reuses that N (index arithmetic on both sides).
    """
    rng = np.random.default_rng(seed)
    T = len(rows)
    tables = [rng.standard_normal((r, dim), dtype=np.float32) for r in rows]
    top_in = bottom + T * dim + (dense_dim if top_reads_features else 0)
    weights = {
        "w0": rng.standard_normal((dense_dim, bottom), dtype=np.float32) / np.float32(np.sqrt(dense_dim)),
        "b0": rng.standard_normal(bottom, dtype=np.float32) * np.float32(0.1),
        "w1": rng.standard_normal((top_in, hidden), dtype=np.float32) / np.float32(np.sqrt(top_in)),
        "b1": rng.standard_normal(hidden, dtype=np.float32) * np.float32(0.1),
        "w2": rng.standard_normal((hidden, 1), dtype=np.float32) / np.float32(np.sqrt(hidden)),
        "b2": np.array([0.05], dtype=np.float32),
    }
    # Initializer names do not sort in table order either.
    names = [f"emb_{chr(ord('z') - 3 * t)}" for t in range(T)]
    inits = [numpy_helper.from_array(tables[t], name=names[t]) for t in range(T)]
    inits += [numpy_helper.from_array(a, name=k) for k, a in weights.items()]
    inits += [_const("axes1", [1]), _const("axes2", [2]), _const("tail_shape", [T, pooling])]
    nodes = []
    if shared_batch:
        nodes += [helper.make_node("Shape", [DENSE], ["dense_shape"], name="batch_shape"),
                  helper.make_node("Slice", ["dense_shape", "zero1", "one1"], ["batch"], name="batch_size"),
                  helper.make_node("Concat", ["batch", "tail_shape"], ["ids_shape"], axis=0, name="ids_shape")]
        inits += [_const("zero1", [0]), _const("one1", [1])]
    else:
        inits.append(_const("ids_shape", [-1, T, pooling]))
    nodes.append(helper.make_node("Reshape", [INDICES, "ids_shape"], ["ids_3d"], name="ids3"))
    lookup_nodes, pool_nodes = [], []
    reduce = "ReduceMean" if mean else "ReduceSum"

    def pool(src: str, out: str, axis_name: str, axis: int, name: str) -> onnx.NodeProto:
        if mean:  # opset 17: ReduceMean takes axes as an attribute, ReduceSum as an input
            return helper.make_node(reduce, [src], [out], axes=[axis], keepdims=0, name=name)
        return helper.make_node(reduce, [src, axis_name], [out], keepdims=0, name=name)

    for t in order:
        inits += [_const(f"start{t}", [t]), _const(f"end{t}", [t + 1])]
        nodes += [helper.make_node("Slice", ["ids_3d", f"start{t}", f"end{t}", "axes1"], [f"slice{t}"],
                                   name=f"slice{t}"),
                  helper.make_node("Squeeze", [f"slice{t}", "axes1"], [f"ids{t}"], name=f"squeeze{t}"),
                  helper.make_node("Gather", [names[t], f"ids{t}"], [f"rows{t}"], name=f"lookup{t}")]
        lookup_nodes.append(f"lookup{t}")
        if t == 1:  # [N, P, D] -> Cast -> Unsqueeze -> [N, 1, P, D] -> pool axis 2 -> [N, 1, D] -> Reshape
            inits.append(_const("pooled_shape", [-1, dim]))
            nodes += [helper.make_node("Cast", [f"rows{t}"], [f"cast{t}"], to=TensorProto.FLOAT, name=f"cast{t}"),
                      helper.make_node("Unsqueeze", [f"cast{t}", "axes1"], [f"wide{t}"], name=f"unsqueeze{t}"),
                      pool(f"wide{t}", f"pooled3_{t}", "axes2", 2, f"pool{t}"),
                      helper.make_node("Reshape", [f"pooled3_{t}", "pooled_shape"], [f"pooled{t}"],
                                       name=f"flatten{t}")]
        else:
            nodes.append(pool(f"rows{t}", f"pooled{t}", "axes1", 1, f"pool{t}"))
        pool_nodes.append(f"pool{t}")
    nodes += [helper.make_node("MatMul", [DENSE, "w0"], ["xw0"], name="bottom_mm"),
              helper.make_node("Add", ["xw0", "b0"], ["bottom_pre"], name="bottom_add"),
              helper.make_node("Relu", ["bottom_pre"], ["bottom"], name="bottom_relu")]
    concat_in = ["bottom", *(f"pooled{t}" for t in range(T))] + ([DENSE] if top_reads_features else [])
    nodes.append(helper.make_node("Concat", concat_in, ["cat"], axis=1, name="interact"))
    if shared_batch:  # the dense side reshapes with the host's batch size: it must recompute it
        inits.append(_const("minus1", [-1]))
        nodes += [helper.make_node("Concat", ["batch", "minus1"], ["cat_shape"], axis=0, name="cat_shape"),
                  helper.make_node("Reshape", ["cat", "cat_shape"], ["cat2"], name="cat_reshape")]
    top = "cat2" if shared_batch else "cat"
    nodes += [helper.make_node("Gemm", [top, "w1", "b1"], ["top_pre"], name="top_gemm"),
              helper.make_node("Relu", ["top_pre"], ["top"], name="top_relu"),
              helper.make_node("MatMul", ["top", "w2"], ["top_mm"], name="out_mm"),
              helper.make_node("Add", ["top_mm", "b2"], ["logit"], name="out_add"),
              helper.make_node("Sigmoid", ["logit"], [SCORES], name="out_sigmoid")]
    model = _finish(nodes, inits, "dlrm", dense_dim, T)
    return Dlrm(model=model, tables=tables, weights=weights, pooling=pooling, dense_dim=dense_dim, mean=mean,
                top_reads_features=top_reads_features, lookup_nodes=lookup_nodes, pool_nodes=pool_nodes)


def one_hot_offsets(*, rows: tuple[int, ...] = (6, 9, 4), dim: int = 3, dense_dim: int = 2, seed: int = 1,
                    scale: tuple[int, ...] | None = None):
    """One-hot ids shifted into one concatenated table (no pooling), then an MLP; numpy twin returned.

    ``scale``: multiply each table's ids by this before shifting (a transform the probe cannot invert).
    """
    rng = np.random.default_rng(seed)
    T = len(rows)
    table = rng.standard_normal((sum(rows), dim), dtype=np.float32)
    offsets = np.cumsum([0, *rows[:-1]]).astype(np.int64)
    w = rng.standard_normal((dense_dim + T * dim, 1), dtype=np.float32)
    inits = [numpy_helper.from_array(table, "table"), _const("offsets", offsets), _const("shape", [-1, T]),
             _const("flat", [-1, T * dim]), numpy_helper.from_array(w, "w")]
    nodes = [helper.make_node("Reshape", [INDICES, "shape"], ["ids2"])]
    if scale is not None:
        inits.append(_const("scale", scale))
        nodes.append(helper.make_node("Mul", ["ids2", "scale"], ["ids2s"]))
    nodes += [helper.make_node("Add", ["ids2s" if scale else "ids2", "offsets"], ["shifted"]),
             helper.make_node("Gather", ["table", "shifted"], ["emb"]),
             helper.make_node("Reshape", ["emb", "flat"], ["emb2"]),
             helper.make_node("Concat", [DENSE, "emb2"], ["x"], axis=1),
             helper.make_node("MatMul", ["x", "w"], ["logit"]),
             helper.make_node("Sigmoid", ["logit"], [SCORES])]
    model = _finish(nodes, inits, "onehot", dense_dim, T)

    def reference(feed):
        ids = feed[INDICES].reshape(-1, T) * np.asarray(scale or 1) + offsets
        x = np.concatenate([feed[DENSE], table[ids].reshape(len(ids), -1)], 1).astype(np.float64)
        return (1 / (1 + np.exp(-(x @ w)))).astype(np.float32)
    return model, reference


def _run(model: onnx.ModelProto | bytes, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    data = model if isinstance(model, bytes) else model.SerializeToString()
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feed[i.name] for i in session.get_inputs()})))


def _composed(split, feed: dict[str, np.ndarray]) -> np.ndarray:
    """host.onnx then dense.onnx, as the server runs them."""
    boundary = _run(split.host, feed)
    assert list(boundary) == split.boundary
    return _run(split.dense, {**feed, **boundary})[SCORES]


# --- the cut -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", [
    dict(), dict(mean=True), dict(top_reads_features=True), dict(shared_batch=True),
    dict(rows=(3, 50, 8, 21), order=(3, 1, 0, 2), pooling=1),
], ids=["sum", "mean", "top-reads-features", "shared-batch", "four-tables-pooling-1"])
def test_host_then_dense_answers_like_the_original(variant) -> None:
    m = dlrm(**variant)
    split = cut_onnx(m.model)
    for rows in (1, 7, 40):
        feed = m.request(rows, seed=rows)
        want = m.reference(feed)
        np.testing.assert_allclose(_run(m.model, feed)[SCORES], want, atol=1e-5)  # the twin is right
        np.testing.assert_allclose(_composed(split, feed), want, atol=1e-5)


@st.composite
def _models(draw):
    tables = draw(st.integers(1, 4))
    rows = tuple(draw(st.lists(st.integers(2, 40), min_size=tables, max_size=tables)))
    order = tuple(draw(st.permutations(range(tables))))
    return dict(rows=rows, order=order, pooling=draw(st.integers(1, 4)), mean=draw(st.booleans()),
                shared_batch=draw(st.booleans()), top_reads_features=draw(st.booleans()), seed=draw(st.integers(0, 9)))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_models())
def test_cut_invariants_hold_for_any_table_layout(variant) -> None:
    m = dlrm(**variant)
    split = cut_onnx(m.model)
    host, dense = set(split.host_nodes), set(split.dense_nodes)
    # Every node is placed; only index arithmetic that never reads the ids is on both sides.
    assert host | dense == {n.name for n in split.model.graph.node}
    both = {n.name for n in split.model.graph.node if n.name in host & dense}
    assert all(INDICES not in n.input for n in split.model.graph.node if n.name in both)
    assert set(m.lookup_nodes) | set(m.pool_nodes) <= host - dense
    # Host -> dense only: no host node reads a value the dense side computes.
    dense_out = {t for n in split.model.graph.node if n.name in dense - host for t in n.output}
    assert not {t for n in split.model.graph.node if n.name in host for t in n.input} & dense_out
    assert split.tables["rows"] == list(variant["rows"]) and split.pooling == variant["pooling"]
    for rows in (1, 6):
        feed = m.request(rows, seed=rows)
        np.testing.assert_allclose(_composed(split, feed), m.reference(feed), atol=1e-5)


def test_lookups_poolings_and_their_ancestors_go_to_the_host() -> None:
    m = dlrm()
    split = cut_onnx(m.model)
    host, dense = set(split.host_nodes), set(split.dense_nodes)
    assert set(m.lookup_nodes) | set(m.pool_nodes) <= host
    assert {"ids3", "slice0", "squeeze2", "cast1", "unsqueeze1"} <= host
    assert {"bottom_mm", "interact", "top_gemm", "out_sigmoid", "flatten1"} <= dense
    assert not host & dense
    assert set(split.labels) == host | dense
    # The pooled tensors cross the cut; the dense side reads the features, not the ids.
    assert split.boundary == ["pooled2", "pooled0", "pooled3_1"]
    assert split.host_inputs == [INDICES] and split.dense_inputs == [DENSE, *split.boundary]
    onnx.checker.check_model(split.host)
    onnx.checker.check_model(split.dense)
    assert {t.name for t in split.host.graph.initializer} >= {"emb_z", "emb_w", "emb_t"}
    assert not {t.name for t in split.dense.graph.initializer} & {"emb_z", "emb_w", "emb_t"}


def test_index_arithmetic_both_sides_need_is_recomputed_not_shipped() -> None:
    split = cut_onnx(dlrm(shared_batch=True).model)
    # Shape(dense_features) feeds the ids' reshape (host) and the top reshape (dense).
    assert {"batch_shape", "batch_size"} <= set(split.host_nodes) & set(split.dense_nodes)
    assert "batch" not in split.boundary and "ids_shape" not in split.boundary
    assert split.host_inputs == [DENSE, INDICES]
    # Every boundary tensor is rows-first, so the server can split a batch across cards.
    for vi in split.dense.graph.input:
        assert vi.type.tensor_type.shape.dim[0].dim_param == "N"


@pytest.mark.parametrize("rows,order", [((11, 7, 5), (2, 0, 1)), ((4, 30, 9), (1, 2, 0)),
                                         ((100, 2, 17, 5), (3, 2, 1, 0))])
def test_rows_per_table_index_come_from_the_model_whatever_the_node_order(rows, order) -> None:
    split = cut_onnx(dlrm(rows=rows, order=order, pooling=2).model)
    assert split.tables == {"rows": list(rows), "dim": 4, "pooling": [2] * len(rows)}
    by_node = {lk.gather: lk for lk in split.lookups}
    for t, r in enumerate(rows):
        assert by_node[f"lookup{t}"].table_indices == (t,) and by_node[f"lookup{t}"].rows == r


def test_the_pooling_factor_is_found_or_checked() -> None:
    m = dlrm(pooling=5)
    assert cut_onnx(m.model).pooling == 5
    assert cut_onnx(m.model, pooling=5).tables["pooling"] == [5, 5, 5]
    with pytest.raises(ValueError, match=r"does not run on a canonical request with pooling 2 ids per"):
        cut_onnx(m.model, pooling=2)


def test_one_hot_ids_offset_into_one_table_are_a_lookup_without_pooling() -> None:
    model, reference = one_hot_offsets()
    split = cut_onnx(model)
    (lookup,) = split.lookups
    assert lookup.pooling is None and lookup.table_indices == (0, 1, 2) and lookup.rows == 19
    assert lookup.offsets == (0, 6, 15)
    # Loose but safe range checks: an id may run to the end of the shared table, never past it.
    assert split.tables["rows"] == [19, 13, 4]
    rng = np.random.default_rng(3)
    for rows in (1, 9):
        feed = {DENSE: rng.standard_normal((rows, 2), dtype=np.float32), LENGTHS: np.ones((rows, 3), np.int32),
                INDICES: np.stack([rng.integers(0, r, rows) for r in (6, 9, 4)], 1).reshape(-1)}
        np.testing.assert_allclose(_composed(split, feed), reference(feed), atol=1e-5)


def test_ids_transformed_past_recognition_get_per_lookup_range_checks_with_a_warning(caplog) -> None:
    model, reference = one_hot_offsets(scale=(1, 2, 1))
    with caplog.at_level("WARNING", logger="sixfold.partitioner.frontends.onnx_frontend"):
        split = cut_onnx(model, where="scaled.onnx")
    assert "rows" not in split.tables and split.tables["pooling"] == [1, 1, 1]
    assert "scaled.onnx: cannot tell which table serves each table index (the ids of table index 1 are " \
           "transformed (not shifted) before the lookup); ids are range-checked per lookup instead" in caplog.text
    feed = {DENSE: np.ones((2, 2), np.float32), LENGTHS: np.ones((2, 3), np.int32),
            INDICES: np.array([5, 4, 3, 0, 1, 2], np.int64)}
    np.testing.assert_allclose(_composed(split, feed), reference(feed), atol=1e-5)


def test_dense_flops_and_bytes_are_counted_from_shapes() -> None:
    m = dlrm()  # bottom 5x6, top (6 + 3*4)x8 Gemm, out 8x1
    split = cut_onnx(m.model)
    assert split.flops_per_item == 2 * (5 * 6 + 18 * 8 + 8 * 1)
    assert split.lookup_bytes_per_item == 3 * 3 * (4 * 4 + 8)  # T x P x (row + id)
    assert split.dense_input_bytes_per_item == 4 * (5 + 3 * 4)


# --- the partitioned model, the CLI and the backends -------------------------------------------


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> tuple[Dlrm, Path]:
    m = dlrm(rows=(11, 7, 5), order=(2, 0, 1))
    path = tmp_path_factory.mktemp("onnx") / "ranker.onnx"
    onnx.save(m.model, str(path))
    return m, path


def test_partition_file_dispatches_onnx_and_plans_like_a_torch_model(model_file) -> None:
    m, path = model_file
    partitioned = partition_file(str(path), cards=3)
    plan = partitioned.plan
    assert plan.model == "ranker" and plan.devices_of(DENSE_PARTITION) == ["card0", "card1", "card2"]
    assert plan.devices_of(HOST_PARTITION) == ["host"]
    assert [(i.name, i.datatype, i.shape) for i in plan.inputs] == [
        (DENSE, "FP32", [-1, 5]), (LENGTHS, "INT32", [-1, 3]), (INDICES, "INT64", [-1])]
    assert [(o.name, o.shape) for o in plan.outputs] == [(SCORES, [-1, 1])]
    assert plan.tables == {"rows": [11, 7, 5], "dim": 4, "pooling": [3, 3, 3], "fixed_pooling": True}
    host, dense = plan.partition(HOST_PARTITION), plan.partition(DENSE_PARTITION)
    assert host.format == dense.format == "onnx"
    host_weights = onnx.load_from_string(partitioned.artifacts[HOST_PARTITION].payload).graph.initializer
    assert host.param_bytes == sum(numpy_helper.to_array(t).nbytes for t in host_weights)
    assert 4 * 4 * (11 + 7 + 5) <= host.param_bytes < 4 * 4 * (11 + 7 + 5) + 200  # tables + index constants
    assert [o.shape for o in host.outputs] == [[-1, 4], [-1, 4], [-1, 1, 4]]  # table 1 pools keeping an axis
    assert dense.flops_per_item > 0 and plan.estimates.throughput_items_per_s > 0
    assert partitioned.split is None and partitioned.artifacts[HOST_PARTITION].format == "onnx"
    feed = m.request(6)
    boundary = _run(partitioned.artifacts[HOST_PARTITION].payload, feed)
    scores = _run(partitioned.artifacts[DENSE_PARTITION].payload, {**feed, **boundary})[SCORES]
    np.testing.assert_allclose(scores, m.reference(feed), atol=1e-5)


def test_cli_writes_plan_host_and_dense_onnx_and_draws(model_file, tmp_path, capsys) -> None:
    _, path = model_file
    out, png = tmp_path / "repo" / "ranker" / "1", tmp_path / "cut.png"
    assert partition_main([str(path), "--cards", "2", "--out", str(out), "--draw", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "card1" in printed and "host.onnx" in printed
    assert sorted(p.name for p in out.iterdir()) == ["dense.onnx", "host.onnx", "plan.json"]
    plan = json.loads((out / "plan.json").read_text())
    parts = {p["name"]: p for p in plan["partitions"]}
    assert parts[HOST_PARTITION]["artifact"] == "host.onnx" and parts[HOST_PARTITION]["format"] == "onnx"
    assert parts[DENSE_PARTITION]["artifact"] == "dense.onnx"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_written_artifacts_run_on_onnxruntime_host_and_simcard(model_file, tmp_path) -> None:
    m, path = model_file
    assert partition_main([str(path), "--cards", "2", "--out", str(tmp_path)]) == 0
    plan = PartitionPlan.load(tmp_path / "plan.json")

    def artifact(name: str) -> PartitionArtifact:
        info = plan.partition(name)
        return PartitionArtifact(name=name, format=info.format, payload=str(tmp_path / info.artifact),
                                 input_names=tuple(i.name for i in info.inputs),
                                 output_names=tuple(o.name for o in info.outputs),
                                 param_bytes=info.param_bytes, flops_per_item=info.flops_per_item,
                                 bytes_per_item=info.bytes_per_item)

    host = get_backend("onnxruntime").load(artifact(HOST_PARTITION), load_spec("host-cpu"))
    card = get_backend("simcard").load(artifact(DENSE_PARTITION), plan.device("card0").spec)
    try:
        for rows in (1, 13):
            feed = m.request(rows, seed=rows)
            boundary = host.run(feed)
            scores = card.run({**feed, **boundary})[SCORES]
            np.testing.assert_allclose(scores, m.reference(feed), atol=1e-5)
            np.testing.assert_allclose(scores, _run(m.model, feed)[SCORES], atol=1e-5)
    finally:
        host.close()
        card.close()


# --- refusals ----------------------------------------------------------------------------------


def test_a_model_without_lookups_is_refused() -> None:
    w = numpy_helper.from_array(np.ones((5, 1), np.float32), "w")
    nodes = [helper.make_node("MatMul", [DENSE, "w"], ["logit"]), helper.make_node("Sigmoid", ["logit"], [SCORES])]
    with pytest.raises(ValueError, match=r"no embedding lookup found .*Gather nodes present: none"):
        cut_onnx(_finish(nodes, [w], "mlp", 5, 3))


def test_a_model_without_the_canonical_inputs_is_refused_with_its_inputs(tmp_path) -> None:
    graph = helper.make_graph([helper.make_node("Sigmoid", ["x"], [SCORES])], "other",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1])],
                              [helper.make_tensor_value_info(SCORES, TensorProto.FLOAT, ["N", 1])])
    path = tmp_path / "other.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(ValueError, match=r"inputs are \['x'\]; a recommendation model must take"):
        partition_file(str(path))


def test_a_non_canonical_dtype_and_a_non_onnx_file_are_refused(tmp_path) -> None:
    m = dlrm()
    m.model.graph.input[1].type.tensor_type.elem_type = TensorProto.INT64
    with pytest.raises(ValueError, match=r"input sparse_lengths is INT64; the canonical request has INT32"):
        cut_onnx(m.model)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match=r"not a readable ONNX model"):
        partition_file(str(junk))
    with pytest.raises(ValueError, match=r"expected a torch.export archive \(\.pt2\) or an ONNX model"):
        partition_file(str(tmp_path / "model.tflite"))


def test_find_lookups_ignores_gathers_that_do_not_read_the_ids() -> None:
    m = dlrm()
    # A dense-side Gather on a rank-2 initializer with constant ids is not a lookup.
    m.model.graph.initializer.extend([numpy_helper.from_array(np.ones((4, 1), np.float32), "proj"),
                                      _const("pick", [0, 2])])
    m.model.graph.node.append(helper.make_node("Gather", ["proj", "pick"], ["picked"], name="not_a_lookup"))
    assert sorted(lk.gather for lk in find_lookups(cut_onnx(m.model).model)) == ["lookup0", "lookup1", "lookup2"]
    assert partition_onnx(m.model, cards=[load_spec("m2-card")], host=load_spec("host-cpu"),
                          name="ranker").plan.model == "ranker"
