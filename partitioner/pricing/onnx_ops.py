"""Op profiles of ONNX partitions: what each node computes and moves, observed in ONNX Runtime at two batch sizes.

The ONNX twin of ``cost.op_profile`` (which meters torch graphs), so an ONNX model's host and
dense stages are priced op by op on a calibrated spec, like a torch export's, instead of by the
roofline (which priced an ONNX one-hot model's host stage of 168 nodes at a thirtieth of its
time). Each node is one ``OpCost``: a Gather on a table is a "gather" of its ids' rows, another
Gather an "index" op of the slices it picks (``per_index_seconds`` is calibrated on ONNX
Runtime's Gather), a MatMul/Gemm a "matmul" of its FLOPs, anything else "memory" (the bytes it
reads and writes). A control-flow node (a Loop) counts as one node whatever its body runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from sixfold.partitioner.pricing.cost import OpCost

__all__ = ["onnx_op_profile", "ORT_LAUNCHES"]

ORT_LAUNCHES = 0.15
"""Launches (calibrated ``per_op_seconds``, one tiny aten add) one ONNX Runtime node costs.

A documented constant, not a calibrated figure: on the 2-core VM a chain of 100 one-element Adds
in one session cost 0.25 us a node beyond the first, 0.43 us on 2,048 elements, against a
calibrated aten add of 1.9 us. It scales with the host, since it multiplies the calibrated add."""

_GATHERS = frozenset({"Gather", "GatherND", "GatherElements"})


def _run_all(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every top-level node output of ``model`` on ``feeds``, plus the feeds."""
    import onnxruntime as ort
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    have = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        probe.graph.output.extend(onnx.ValueInfoProto(name=t) for t in node.output if t and t not in have)
        have.update(t for t in node.output if t)
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    wanted = {i.name for i in session.get_inputs()}
    return {**feeds, **dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in wanted})))}


def _nbytes(arrays: list[Any]) -> float:
    return float(sum(a.nbytes for a in arrays if isinstance(a, np.ndarray)))


def _indices(node: onnx.NodeProto, data: Any, ids: np.ndarray) -> int:
    """Slices a gather picks, as ``cost`` counts an ``index_select``'s: its indices times the dims before its axis."""
    if node.op_type == "GatherND":
        return int(math.prod(ids.shape[:-1])) if ids.ndim else 1
    if node.op_type == "GatherElements" or not isinstance(data, np.ndarray):
        return int(ids.size)
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % max(1, data.ndim)
    return int(ids.size * math.prod(data.shape[:axis]))


def _measure(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    env = _run_all(model, feeds)
    tables = {t.name: t for t in model.graph.initializer if len(t.dims) == 2}
    seen: dict[str, dict[str, Any]] = {}
    for node in model.graph.node:
        inputs = [env[t] for t in node.input if t in env]
        outputs = [env[t] for t in node.output if t in env]
        ids = env.get(node.input[1]) if node.op_type in _GATHERS and len(node.input) > 1 else None
        if ids is not None and node.input[0] in tables:
            table = tables[node.input[0]]
            row = int(table.dims[1]) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(table.data_type)).itemsize
            seen[node.name] = {"kind": "gather", "ids": float(np.asarray(ids).size), "row_bytes": float(row),
                               "bytes": _nbytes(inputs[1:] + outputs)}
        elif ids is not None:
            seen[node.name] = {"kind": "index", "ids": float(_indices(node, env.get(node.input[0]), np.asarray(ids))),
                               "bytes": _nbytes(inputs + outputs)}
        elif node.op_type in ("MatMul", "Gemm") and outputs and inputs:
            a, out = np.asarray(inputs[0]), np.asarray(outputs[0])
            transposed = node.op_type == "Gemm" and any(x.name == "transA" and x.i for x in node.attribute)
            k = a.shape[0] if transposed else a.shape[-1]
            seen[node.name] = {"kind": "matmul", "flops": 2.0 * out.size * k,
                               "products": float(math.prod(out.shape[:-2])) if out.ndim > 2 else 1.0,
                               "bytes": _nbytes(inputs + outputs)}
        else:
            seen[node.name] = {"kind": "memory", "bytes": _nbytes(inputs + outputs)}
    return seen


def onnx_op_profile(model: onnx.ModelProto, small: Mapping[str, np.ndarray], small_rows: int,
                    large: Mapping[str, np.ndarray], large_rows: int) -> tuple[OpCost, ...]:
    """The nodes of ``model`` with what each computes and moves, linear in the batch rows (``OpCost``s).

    ``small``/``large``: feeds holding ``model``'s inputs for batches of ``small_rows``/``large_rows``
    items. Nodes must be named (the ONNX frontend names them).
    """
    if large_rows <= small_rows:
        raise ValueError(f"large_rows ({large_rows}) must exceed small_rows ({small_rows})")
    a, b = _measure(model, small), _measure(model, large)
    span = large_rows - small_rows

    def line(key: str, lo: dict[str, Any], hi: dict[str, Any], default: float = 0.0) -> tuple[float, float]:
        x, y = float(lo.get(key, default)), float(hi.get(key, default))
        per = (y - x) / span
        return (x - per * small_rows, per)

    ops = []
    for name, hi in b.items():
        lo = a.get(name)
        if lo is None or lo["kind"] != hi["kind"]:
            continue
        ops.append(OpCost(name=name, kind=str(hi["kind"]), flops=line("flops", lo, hi),
                          products=line("products", lo, hi, 1.0), bytes=line("bytes", lo, hi),
                          ids=line("ids", lo, hi), row_bytes=float(hi.get("row_bytes", 0.0)),
                          launches=ORT_LAUNCHES))
    return tuple(ops)
