"""More ONNX lookup patterns than a Gather: GatherND, and EmbeddingBag-style Gather + ReduceSum/ReduceMean
with per-sample weights (a Mul before the reduce). Models are written with onnx.helper; onnxruntime
running the original model gives the reference answer."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from sixfold.partitioner.compile import partition_file
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.frontends.onnx_frontend import find_lookups

ROWS, DIM, DENSE_DIM, POOLING = (9, 5, 7), 4, 3, 3
T = len(ROWS)


def _init(name: str, array: np.ndarray) -> TensorProto:
    return helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape),
                              array.reshape(-1).tolist())


def _model(lookup: str, reduce: str = "ReduceSum", weighted: bool = False) -> onnx.ModelProto:
    """Per-table lookups of ``lookup`` ("gather" or "gathernd") pooled by ``reduce``, optionally weighted."""
    rng = np.random.default_rng(7)
    inits = [_init("ids_shape", np.array([-1, T, POOLING], dtype=np.int64)),
             _init("one", np.array([1], dtype=np.int64)),
             _init("top", rng.standard_normal((DENSE_DIM + T * DIM, 1)).astype(np.float32))]
    nodes = [helper.make_node("Reshape", ["sparse_indices", "ids_shape"], ["ids3"])]
    pooled = []
    for t, rows in enumerate(ROWS):
        inits.append(_init(f"table{t}", rng.standard_normal((rows, DIM)).astype(np.float32)))
        inits.append(_init(f"t{t}", np.array(t, dtype=np.int64)))
        nodes.append(helper.make_node("Gather", ["ids3", f"t{t}"], [f"ids{t}"], axis=1))  # [N, P]
        if lookup == "gathernd":
            inits.append(_init(f"last{t}", np.array([-1], dtype=np.int64)))
            nodes.append(helper.make_node("Unsqueeze", [f"ids{t}", f"last{t}"], [f"idx{t}"]))  # [N, P, 1]
            nodes.append(helper.make_node("GatherND", [f"table{t}", f"idx{t}"], [f"rows{t}"]))
        else:
            nodes.append(helper.make_node("Gather", [f"table{t}", f"ids{t}"], [f"rows{t}"]))  # [N, P, D]
        bag = f"rows{t}"
        if weighted:  # EmbeddingBag's per_sample_weights: a learned weight per id, times its row
            inits.append(_init(f"w{t}", rng.uniform(0.5, 1.5, (rows, 1)).astype(np.float32)))
            nodes.append(helper.make_node("Gather", [f"w{t}", f"ids{t}"], [f"psw{t}"]))  # [N, P, 1]
            nodes.append(helper.make_node("Mul", [f"psw{t}", f"rows{t}"], [f"weighted{t}"]))
            bag = f"weighted{t}"
        if reduce == "ReduceSum":
            nodes.append(helper.make_node("ReduceSum", [bag, "one"], [f"pooled{t}"], keepdims=0))
        else:
            nodes.append(helper.make_node("ReduceMean", [bag], [f"pooled{t}"], axes=[1], keepdims=0))
        pooled.append(f"pooled{t}")
    nodes += [helper.make_node("Concat", ["dense_features", *pooled], ["x"], axis=1),
              helper.make_node("MatMul", ["x", "top"], ["logit"]),
              helper.make_node("Sigmoid", ["logit"], ["scores"])]
    for i, node in enumerate(nodes):
        node.name = f"{node.op_type}_{i}"
    graph = helper.make_graph(nodes, f"{lookup}_{reduce}", [
        helper.make_tensor_value_info("dense_features", TensorProto.FLOAT, ["N", DENSE_DIM]),
        helper.make_tensor_value_info("sparse_lengths", TensorProto.INT32, ["N", T]),
        helper.make_tensor_value_info("sparse_indices", TensorProto.INT64, ["ids"])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 1])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def _request(items: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.integers(0, r, size=(items, POOLING)) for r in ROWS], axis=1)
    return {"dense_features": rng.standard_normal((items, DENSE_DIM)).astype(np.float32),
            "sparse_lengths": np.full((items, T), POOLING, dtype=np.int32),
            "sparse_indices": ids.reshape(-1).astype(np.int64)}


@pytest.mark.parametrize("lookup,reduce,weighted", [
    ("gathernd", "ReduceSum", False),
    ("gathernd", "ReduceMean", True),
    ("gather", "ReduceSum", True),
    ("gather", "ReduceMean", True),
])
def test_lookup_patterns_are_cut_with_their_pooling_on_the_host(tmp_path, lookup, reduce, weighted) -> None:
    path = tmp_path / "model.onnx"
    onnx.save(_model(lookup, reduce, weighted), str(path))
    tables = [lk for lk in find_lookups(onnx.load(str(path))) if lk.table.startswith("table")]
    assert len(tables) == T and all(lk.pooling for lk in tables)  # each bag found, weighting included

    partitioned = partition_file(str(path), cards=2)
    plan = partitioned.plan
    assert plan.tables["rows"] == list(ROWS) and plan.tables["pooling"] == [POOLING] * T
    assert plan.tables["dim"] == DIM  # the rows' width, not the per-sample weights'
    host = plan.partition(HOST_PARTITION)
    assert all(t.shape == [-1, DIM] for t in host.outputs)  # pooled bags cross the cut, not rows

    original = ort.InferenceSession(str(path))
    host_s = ort.InferenceSession(partitioned.artifacts[HOST_PARTITION].payload)
    dense = partitioned.artifacts[DENSE_PARTITION]
    dense_s = ort.InferenceSession(dense.payload)
    for items, seed in ((1, 1), (6, 2), (40, 3)):
        request = _request(items, seed)
        host_art = partitioned.artifacts[HOST_PARTITION]
        boundary = dict(zip(host_art.output_names, host_s.run(None, {n: request[n] for n in host_art.input_names})))
        env = {**request, **boundary}
        scores = dense_s.run(None, {n: env[n] for n in dense.input_names})[0]
        np.testing.assert_allclose(scores, original.run(None, request)[0], rtol=1e-5, atol=1e-6)
