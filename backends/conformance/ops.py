"""The ONNX ops a card backend must run: derived from the zoo's dense partitions, one test model per use.

``dense_ops.json`` (next to this file) lists every way the dense partitions of
sixfold's zoo models use an ONNX op, at the precisions sixfold serves them
(fp32, and fp16 with ``--dense-precision fp16``): the opset, the op type, its
attributes, and its inputs (dtype; shape, with dims that grow with the batch
written as ``{"per_item": k}``; constants' integer values, e.g. a Reshape's
shape or a Gather's indices). It is generated, never written by hand:
``python scripts/dense_ops.py`` re-derives it (exporting every zoo model) and
rewrites the table in docs/backends.md; ``tests/backends/conformance/test_dense_ops.py``
fails when either is stale.

``op_cases()`` turns each use into a one-node ONNX model (float constants
random, integer constants as recorded) with feeds for a few batch sizes and
ONNX Runtime's answers; the kit's ``op`` check runs each through the backend
(fp16 uses within 8 fp16 ulps of the largest output, the rest at the kit's atol).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.backends.api import PartitionArtifact
from sixfold.backends.conformance.cases import Case, case_from_artifact

__all__ = ["DENSE_OPS_FILE", "dense_ops", "inventory", "markdown_table", "op_model", "op_cases", "OP_BATCH_SIZES"]

DENSE_OPS_FILE = Path(__file__).with_name("dense_ops.json")
OP_BATCH_SIZES = (1, 2, 3)
_DTYPES = {"float32": 1, "int32": 6, "int64": 7, "float16": 10, "float64": 11, "bool": 9}


def dense_ops() -> dict[str, Any]:
    """The checked-in inventory (``dense_ops.json``)."""
    return json.loads(DENSE_OPS_FILE.read_text())


# -- deriving the inventory from exported models --------------------------------------------------


def _attributes(node: Any) -> dict[str, Any]:
    from onnx import helper

    out = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, (list, tuple)):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
        elif not isinstance(value, (int, float, str)):
            raise ValueError(f"{node.op_type}: attribute {attr.name} of type {type(value).__name__} is not supported")
        out[attr.name] = value
    return dict(sorted(out.items()))


def _shapes_at(model: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor's (shape, dtype) when ``model`` runs ``feeds`` on ONNX Runtime."""
    import onnx
    import onnxruntime as ort

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    names = [o for n in exposed.graph.node for o in n.output if o]
    known = {o.name for o in exposed.graph.output}
    del exposed.graph.output[:]
    for name in names:
        exposed.graph.output.append(onnx.ValueInfoProto(name=name))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(exposed.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = session.run(names, dict(feeds))
    shapes = {n: (tuple(np.shape(v)), np.asarray(v).dtype.name) for n, v in zip(names, values)}
    shapes.update({n: (tuple(a.shape), a.dtype.name) for n, a in feeds.items()})
    del known
    return shapes


def _per_item(one: tuple[int, ...], two: tuple[int, ...], where: str) -> list[Any]:
    if len(one) != len(two):
        raise ValueError(f"{where}: rank changes with the batch ({one} vs {two})")
    dims: list[Any] = []
    for a, b in zip(one, two):
        if a == b:
            dims.append(int(a))
        elif b == 2 * a:
            dims.append({"per_item": int(a)})
        else:
            raise ValueError(f"{where}: dim {a} at 1 item, {b} at 2 items: not proportional to the batch")
    return dims


def inventory(models: Iterable[tuple[str, Any, Any]]) -> dict[str, Any]:
    """The inventory of ``(label, onnx ModelProto, feed(items) -> inputs)`` triples (see the module docstring).

    One entry per distinct use: op type, domain, attributes, and per input its
    dtype, rank and whether it is a constant. The first model a use appears in
    gives the entry's shapes and integer constants; ``models`` lists them all.
    """
    from onnx import numpy_helper

    opsets: dict[str, int] = {}
    uses: dict[str, dict[str, Any]] = {}
    for label, model, feed in models:
        for entry in model.opset_import:
            opsets[entry.domain or ""] = max(opsets.get(entry.domain or "", 0), int(entry.version))
        consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        for node in model.graph.node:  # Constant nodes fold into constants, like initializers
            if node.op_type == "Constant":
                consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        at1, at2 = _shapes_at(model, feed(1)), _shapes_at(model, feed(2))
        for node in model.graph.node:
            if node.op_type == "Constant":
                continue
            where = f"{label}: {node.op_type} {node.name}"
            inputs = []
            for name in node.input:
                if not name:
                    inputs.append(None)
                elif name in consts:
                    value = consts[name]
                    item: dict[str, Any] = {"dtype": value.dtype.name, "shape": list(value.shape), "const": True}
                    if value.dtype.kind in "iub":
                        item["value"] = value.reshape(-1).tolist()
                    inputs.append(item)
                else:
                    inputs.append({"dtype": at1[name][1], "shape": _per_item(at1[name][0], at2[name][0], where)})
            outputs = [{"dtype": at1[o][1], "shape": _per_item(at1[o][0], at2[o][0], where)} for o in node.output]
            attributes = _attributes(node)
            key = json.dumps([node.op_type, node.domain, attributes,
                              [None if i is None else (i["dtype"], len(i["shape"]), bool(i.get("const")))
                               for i in inputs]], sort_keys=True)
            if key in uses:
                if label not in uses[key]["models"]:
                    uses[key]["models"].append(label)
                continue
            uses[key] = {"op": node.op_type, "domain": node.domain or "", "attributes": attributes,
                         "inputs": inputs, "outputs": outputs, "models": [label]}
    ops = sorted(uses.values(), key=lambda u: (u["op"], json.dumps(u["attributes"], sort_keys=True),
                                               json.dumps(u["inputs"], sort_keys=True)))
    return {"opset": dict(sorted(opsets.items())), "ops": ops}


def _describe_input(item: Mapping[str, Any] | None) -> str:
    if item is None:
        return "-"
    dims = ["N" if isinstance(d, dict) and d["per_item"] == 1 else f"{d['per_item']}N" if isinstance(d, dict)
            else str(d) for d in item["shape"]]
    text = f"{item['dtype']}[{','.join(dims)}]"
    return text + " const" if item.get("const") else text


def markdown_table(inv: Mapping[str, Any]) -> str:
    """The inventory as the Markdown table docs/backends.md carries (one row per use)."""
    opset = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in inv["opset"].items())
    ops = sorted({u["op"] for u in inv["ops"]})
    lines = [f"Opset: {opset}. Ops ({len(ops)}): {', '.join(f'`{o}`' for o in ops)}.", "",
             "| op | attributes | inputs (N: items in the batch) | models |", "|---|---|---|---|"]
    for use in inv["ops"]:
        attrs = ", ".join(f"{k}={v}" for k, v in use["attributes"].items()) or "-"
        inputs = "; ".join(_describe_input(i) for i in use["inputs"])
        lines.append(f"| `{use['op']}` | {attrs} | {inputs} | {', '.join(use['models'])} |")
    return "\n".join(lines)


# -- one test model per use -----------------------------------------------------------------------


def _dims(shape: list[Any], items: int) -> list[int]:
    return [d["per_item"] * items if isinstance(d, dict) else int(d) for d in shape]


def _value_info(name: str, item: Mapping[str, Any]) -> Any:
    from onnx import helper

    dims = [f"N*{d['per_item']}" if isinstance(d, dict) else int(d) for d in item["shape"]]
    return helper.make_tensor_value_info(name, _DTYPES[item["dtype"]], dims)


def op_model(use: Mapping[str, Any], opset: Mapping[str, int], *, seed: int = 0) -> tuple[bytes, list[str], list[str]]:
    """A one-node ONNX model of ``use``: (bytes, input names, output names)."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    inputs, names, graph_inputs, initializers = [], [], [], []
    for k, item in enumerate(use["inputs"]):
        if item is None:
            names.append("")
            continue
        name = f"x{k}"
        names.append(name)
        if item.get("const"):
            if "value" in item:
                value = np.asarray(item["value"], dtype=item["dtype"]).reshape(item["shape"])
            else:
                # NOTE: scaled by the fan-in so a product's outputs stay O(1) (fp16 rounds large sums coarsely)
                fan_in = item["shape"][-1] if item["shape"] else 1
                value = (rng.standard_normal(item["shape"]) / np.sqrt(max(1, fan_in))).astype(item["dtype"])
            initializers.append(numpy_helper.from_array(value, name))
        else:
            graph_inputs.append(_value_info(name, item))
            inputs.append(name)
    outputs = [f"y{k}" for k in range(len(use["outputs"]))]
    node = helper.make_node(use["op"], names, outputs, domain=use["domain"] or None, **use["attributes"])
    graph = helper.make_graph([node], f"op_{use['op']}", graph_inputs,
                              [_value_info(o, item) for o, item in zip(outputs, use["outputs"])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opset.items()])
    model.ir_version = min(model.ir_version, 9)
    return model.SerializeToString(), inputs, outputs


def _feed(use: Mapping[str, Any], names: list[str], items: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + items)
    feed = {}
    live = [i for i in use["inputs"] if i is not None and not i.get("const")]
    for name, item in zip(names, live):
        if np.dtype(item["dtype"]).kind != "f":
            raise ValueError(f"{use['op']}: a non-float, non-constant input cannot be generated")
        feed[name] = rng.standard_normal(_dims(item["shape"], items)).astype(item["dtype"])
    return feed


def op_label(use: Mapping[str, Any]) -> str:
    """``Gemm(transB=1) float32`` : how the report names one use."""
    attrs = ",".join(f"{k}={v}" for k, v in use["attributes"].items())
    dtype = next((i["dtype"] for i in use["inputs"] if i is not None and not i.get("const")), "")
    return f"{use['op']}({attrs}) {dtype}".replace("() ", " ")


@lru_cache(maxsize=4)
def _op_cases(seed: int) -> tuple[Case, ...]:
    inv = dense_ops()
    cases = []
    for k, use in enumerate(inv["ops"]):
        payload, inputs, outputs = op_model(use, inv["opset"], seed=seed + k)
        const_bytes = sum(int(np.prod(i["shape"], dtype=np.int64)) * np.dtype(i["dtype"]).itemsize
                          for i in use["inputs"] if i is not None and i.get("const"))
        half = any(i is not None and i["dtype"] == "float16" for i in [*use["inputs"], *use["outputs"]])
        # NOTE: labelled with its true precision, as serving labels a partition, so a backend whose supports()
        # declines fp16 declines these cases too (reported skipped) instead of failing them
        artifact = PartitionArtifact(name=f"op-{use['op'].lower()}-{k}", format="onnx", payload=payload,
                                     input_names=tuple(inputs), output_names=tuple(outputs),
                                     param_bytes=max(1, const_bytes), dtype="fp16" if half else "fp32")
        case = case_from_artifact(f"op {op_label(use)}", artifact,
                                  lambda n, use=use, inputs=inputs, k=k: _feed(use, inputs, n, seed + k),
                                  OP_BATCH_SIZES)
        case.notes["op"] = use["op"]
        if half:  # NOTE: fp16 sums may round differently: allow 8 fp16 ulps of the largest output
            top = max(float(np.max(np.abs(a), initial=0.0)) for out in case.expected.values() for a in out.values())
            case.notes["atol"] = f"{8 * 2.0 ** -10 * max(1.0, top):.3g}"
        cases.append(case)
    return tuple(cases)


def op_cases(seed: int = 0) -> list[Case]:
    """One ``Case`` per use in ``dense_ops.json`` (cached per seed)."""
    return list(_op_cases(seed))
