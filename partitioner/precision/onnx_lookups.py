"""Table precision for an ONNX model's host partition: every lookup reads fp16 or int8 rows.

Each lookup ``find_lookups`` recognises (a Gather or GatherND on a table
initializer) is rewritten in the host ONNX model; the rest of the host graph
(index arithmetic, pooling, weighting) and its fp32 outputs are unchanged:

* fp16: the table stored as FLOAT16; ``Gather -> Cast(FLOAT)``. 2 bytes a value.
* int8: row-wise affine, as FBGEMM's byte rows: per row ``scale = (max - min) / 255``,
  ``bias = min``, ``q = round((x - bias) / scale)`` as UINT8; the lookup becomes
  ``Cast(Gather(q, ids)) * Gather(scale, ids) + Gather(bias, ids)``. dim + 8 bytes a row.

int4 needs ONNX's 4-bit types (opset 21), which this exporter's opsets lack: it is
refused, with int8 suggested. Tables of dim <= 2 (per-sample weights) stay fp32
at int8, which would make them larger. The fp32 host artifact is kept as a host variant
(``PartitionedModel.variants["sparse"]``): the accuracy report's reference.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["ONNX_TABLE_PRECISIONS", "quantize_onnx_host", "quantize_onnx_lookups"]

ONNX_TABLE_PRECISIONS = ("fp32", "fp16", "int8")


def _int8_rows(table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    low = table.min(axis=1, keepdims=True)
    span = table.max(axis=1, keepdims=True) - low
    scale = np.where(span > 0, span / 255.0, 1.0).astype(np.float32)
    q = np.clip(np.rint((table - low) / scale), 0, 255).astype(np.uint8)
    return q, scale, low.astype(np.float32)


def quantize_onnx_host(host: onnx.ModelProto | bytes, precision: str) -> onnx.ModelProto:
    """A copy of the host model whose lookups read ``precision`` rows (module docstring)."""
    from sixfold.partitioner.frontends.onnx_frontend import _named, find_lookups

    if precision not in ONNX_TABLE_PRECISIONS:
        hint = "; int4 needs ONNX 4-bit types: use int8" if precision == "int4" else ""
        raise ValueError(f"table precision {precision!r} is not available for ONNX models "
                         f"(known: {', '.join(ONNX_TABLE_PRECISIONS)}){hint}")
    model = _named(host if isinstance(host, onnx.ModelProto) else onnx.load_from_string(host))
    if precision == "fp32":
        return model
    lookups = find_lookups(model)
    if not lookups:
        raise ValueError("the host model has no embedding lookup to quantize")
    inits = {t.name: t for t in model.graph.initializer}
    made: dict[str, list[str]] = {}  # table -> the initializers that replace it
    replacement: dict[str, list[onnx.NodeProto]] = {}
    for lk in lookups:
        if precision == "int8" and lk.dim + 8 >= 4 * lk.dim:
            continue  # NOTE: a narrow table (per-sample weights, dim 1) would grow: scale and bias cost 8 bytes a row
        node = next(n for n in model.graph.node if n.name == lk.gather)
        op, ids, out = node.op_type, node.input[1], node.output[0]
        extra = [a for a in node.attribute]
        if lk.table not in made:
            table = numpy_helper.to_array(inits[lk.table]).astype(np.float32)
            if precision == "fp16":
                arrays = {f"{lk.table}__fp16": table.astype(np.float16)}
            else:
                q, scale, bias = _int8_rows(table)
                arrays = {f"{lk.table}__q": q, f"{lk.table}__scale": scale, f"{lk.table}__bias": bias}
            model.graph.initializer.extend(numpy_helper.from_array(a, name) for name, a in arrays.items())
            made[lk.table] = list(arrays)

        def gather(source: str, output: str) -> onnx.NodeProto:
            g = helper.make_node(op, [source, ids], [output], name=f"{lk.gather}__{output}")
            g.attribute.extend(extra)
            return g

        if precision == "fp16":
            half = made[lk.table][0]
            replacement[lk.gather] = [gather(half, f"{out}__fp16"),
                                      helper.make_node("Cast", [f"{out}__fp16"], [out], to=TensorProto.FLOAT,
                                                       name=f"{lk.gather}__cast")]
        else:
            q, scale, bias = made[lk.table]
            replacement[lk.gather] = [
                gather(q, f"{out}__q"), gather(scale, f"{out}__scale"), gather(bias, f"{out}__bias"),
                helper.make_node("Cast", [f"{out}__q"], [f"{out}__qf"], to=TensorProto.FLOAT,
                                 name=f"{lk.gather}__cast"),
                helper.make_node("Mul", [f"{out}__qf", f"{out}__scale"], [f"{out}__scaled"], name=f"{lk.gather}__mul"),
                helper.make_node("Add", [f"{out}__scaled", f"{out}__bias"], [out], name=f"{lk.gather}__add")]
    nodes = []
    for node in model.graph.node:
        nodes.extend(replacement.get(node.name, [node]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    still_read = {t for n in model.graph.node for t in n.input}
    kept = [t for t in model.graph.initializer if t.name in still_read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)  # the fp32 tables go
    onnx.checker.check_model(model)
    return model


def quantize_onnx_lookups(partitioned, precision: str) -> None:
    """Serve an ONNX ``partitioned``'s host partition with ``precision`` lookups; in place (see the module)."""
    from sixfold.partitioner.partitioned import HOST_PARTITION
    from sixfold.partitioner.frontends.onnx_frontend import _initializer_bytes

    if precision == "fp32":
        return
    old = partitioned.artifacts[HOST_PARTITION]
    if old.format != "onnx" or old.metadata.get("precision", "fp32") != "fp32":
        raise ValueError(f"the host partition is {old.format} {old.metadata.get('precision', 'fp32')}; "
                         "convert from the fp32 ONNX host only")
    model = quantize_onnx_host(old.payload, precision)
    param_bytes = _initializer_bytes(model)
    partitioned.artifacts[HOST_PARTITION] = dataclasses.replace(
        old, payload=model.SerializeToString(), param_bytes=param_bytes,
        metadata={**old.metadata, "precision": precision})
    partitioned.variants[HOST_PARTITION] = [old]  # the fp32 reference for the accuracy report
    partitioned.plan.resize_partition(HOST_PARTITION, param_bytes)
    partitioned.plan.tables["precision"] = precision
