"""Dense-partition precision: serve the dense (card) stage with fp16 or int8 weights and compute.

``apply_dense_precision(partitioned, "fp16")`` rewrites the dense partition of a
partitioned model in place:

- the ONNX artifact: every float initializer and intermediate becomes fp16
  (``onnxconverter_common.float16.convert_float_to_float16``) while the graph's
  inputs and outputs stay fp32 (``keep_io_types``), so the server's tensor
  convention (FP32 dense features and pooled bags in, FP32 scores out) is unchanged;
- the torch-fx variant (for the torch backend): a half copy of the module between
  casts, same fp32 interface;
- the plan and the cost model: the partition's ``dtype`` becomes fp16, its weight
  bytes are the converted model's (about half), and the estimates are redone with
  the card's fp16 peak FLOP/s (``DeviceSpec.peak_flops["fp16"]``).

NOTE (ONNX Runtime CPU): the CPU execution provider has no fp16 Gemm/MatMul
kernel. Its graph optimizer (InsertCastTransformer) runs those nodes in fp32
between casts it inserts ("InsertedPrecisionFreeCast_*"), over weights rounded to
fp16. So on the CPU the *numerics* are those of fp16 storage with fp32
accumulation (what an inference card's fp16 unit with fp32 accumulators
computes) and the accuracy report is representative; the CPU *time* is not an
fp16 speed-up. A card execution provider runs the same graph in native fp16.

``"int8"`` is dynamic quantization, as inference cards with int8 units run MLPerf's DLRM
(``onnxruntime.quantization.quantize_dynamic``): every Gemm and every MatMul by a constant
weight gets int8 weights (per output channel) and quantizes its input at run time (uint8),
accumulating in int32. The input's scale is each item's own (``int8_rows``), not the batch's as
``quantize_dynamic`` writes it, so a request gets the same scores whatever it is batched with. The graph's inputs and outputs
stay fp32, and the feature interaction (a MatMul of two activations) stays fp32. Unlike fp16 this is
a real speed-up on a CPU too (MLAS's int8 GEMMs; 2.9-3.2x on the dense partition of dlrm-mlperf on
the reference VM). The torch-fx variants are dropped: int8 serves on ONNX Runtime (and simcard over it).
What it costs in accuracy, ``sixfold-partition --dense-precision int8 --accuracy-report`` says.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

import torch

from sixfold.partitioner.partitioned import PartitionedModel
from sixfold.partitioner.pricing.cost import PartitionCost, stage_seconds
from sixfold.partitioner.plan import DeviceEstimate, Estimates, PartitionPlan
from sixfold.partitioner.precision.int8_rows import quantize_rows

__all__ = ["DENSE_PRECISIONS", "apply_dense_precision", "onnx_to_fp16", "onnx_to_int8", "onnx_param_bytes",
           "HalfModule"]

DENSE_PRECISIONS = ("fp32", "fp16", "int8")

log = logging.getLogger(__name__)


def _check(precision: str) -> None:
    if precision not in DENSE_PRECISIONS:
        raise ValueError(f"unknown dense precision {precision!r}; known: {', '.join(DENSE_PRECISIONS)}")


def onnx_to_fp16(onnx_bytes: bytes) -> bytes:
    """The same ONNX model with fp16 weights and intermediates and fp32 graph inputs/outputs."""
    import onnx
    from onnxconverter_common import float16

    model = onnx.load_from_string(onnx_bytes)
    converted = float16.convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=False)
    onnx.checker.check_model(converted)
    return converted.SerializeToString()


def onnx_to_int8(onnx_bytes: bytes) -> bytes:
    """The same ONNX model with int8 weights in its Gemms and constant-weight MatMuls, inputs quantized
    per item (row) at run time (``int8_rows``); fp32 graph inputs and outputs."""
    import tempfile
    from pathlib import Path

    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    with tempfile.TemporaryDirectory(prefix="sixfold-int8-") as folder:
        source, target = Path(folder) / "fp32.onnx", Path(folder) / "int8.onnx"
        source.write_bytes(onnx_bytes)
        root.setLevel(logging.ERROR)  # its advice to pre-process for shape inference is for CNNs: not ours
        try:
            quantize_dynamic(source, target, weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["Gemm", "MatMul"], extra_options={"MatMulConstBOnly": True})
        finally:
            root.setLevel(level)
        converted = onnx.load(str(target))
    left = quantize_rows(converted)  # per item, not per batch: answers independent of batch-mates
    if left:
        log.warning("int8: %d activation quantizer(s) left per batch (not a Gemm/MatMul input as quantize_dynamic "
                    "writes it): %s; those answers depend on batch-mates", len(left), ", ".join(left[:5]))
    onnx.checker.check_model(converted)
    return converted.SerializeToString()


def onnx_param_bytes(onnx_bytes: bytes) -> int:
    """Bytes of the model's initializers (its weights), at their stored precision."""
    import numpy as np
    import onnx
    from onnx import helper

    model = onnx.load_from_string(onnx_bytes)
    total = 0
    for init in model.graph.initializer:
        count = int(np.prod(init.dims)) if init.dims else 1
        total += count * np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type)).itemsize
    return total


class HalfModule(torch.nn.Module):
    """``module`` in half precision between casts: float inputs in fp32, float outputs back to fp32."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.inner = copy.deepcopy(module).half().eval()

    def forward(self, *args: torch.Tensor) -> Any:
        cast = [a.half() if a.is_floating_point() else a for a in args]
        out = self.inner(*cast)
        if isinstance(out, torch.Tensor):
            return out.float()
        return tuple(o.float() if o.is_floating_point() else o for o in out)


def apply_dense_precision(partitioned: PartitionedModel, precision: str) -> list[str]:
    """Serve ``partitioned``'s dense partitions at ``precision`` (fp32: nothing to do). In place.

    Every partition of kind "dense" (one, or a pipeline's stages) is converted:
    its ONNX artifact, its torch-fx variants, the plan's partition info (dtype,
    param_bytes) and the plan's estimates change together. Returns the names
    converted. ValueError if a dense partition is not fp32 ONNX.
    """
    _check(precision)
    if precision == "fp32":
        return []
    plan = partitioned.plan
    names = [p.name for p in plan.partitions if p.kind == "dense"]
    if not names:
        raise ValueError(f"plan {plan.model!r} has no dense partition to convert")
    changes: dict[str, tuple[PartitionCost, PartitionCost]] = {}
    for name in names:
        old = partitioned.artifacts[name]
        if old.dtype != "fp32":
            raise ValueError(f"partition {name} is already {old.dtype}; convert from fp32 only")
        if old.format != "onnx":
            raise ValueError(f"partition {name} is {old.format!r}; {precision} conversion needs an ONNX artifact")
    for name in names:
        old = partitioned.artifacts[name]
        payload = onnx_to_fp16(old.payload) if precision == "fp16" else onnx_to_int8(old.payload)
        param_bytes = onnx_param_bytes(payload)
        partitioned.artifacts[name] = dataclasses.replace(
            old, payload=payload, param_bytes=param_bytes, dtype=precision,
            metadata={**old.metadata, "precision": precision})
        partitioned.variants[name] = [
            dataclasses.replace(v, payload=HalfModule(v.payload), param_bytes=param_bytes, dtype=precision,
                                metadata={**v.metadata, "precision": precision})
            for v in partitioned.variants.get(name, []) if v.format == "torch-fx" and precision == "fp16"]
        info = plan.partition(name)
        before = PartitionCost(param_bytes=info.param_bytes, flops_per_item=info.flops_per_item,
                               bytes_per_item=info.bytes_per_item, weight_bytes_per_batch=info.param_bytes,
                               dtype=info.dtype)
        changes[name] = before, dataclasses.replace(before, param_bytes=param_bytes,
                                                    weight_bytes_per_batch=param_bytes, dtype=precision)
        info.param_bytes, info.dtype = param_bytes, precision
    plan.estimates = _reestimate(plan, changes)
    return names


def _reestimate(plan: PartitionPlan, changes: dict[str, tuple[PartitionCost, PartitionCost]]) -> Estimates:
    """The plan's estimates with each changed partition's cost moved from ``before`` to ``after``.

    Transfers do not change (the graphs' inputs and outputs keep their dtype), so
    each device's batch time moves by exactly the difference in modelled compute.
    NOTE: the bound/latency summary mirrors ``pricing.estimate.estimate_plan``.
    """
    est = plan.estimates
    rows = est.batch_rows
    per_device: list[DeviceEstimate] = []
    for d in est.per_device:
        spec = plan.device(d.device).spec
        for name in d.partitions:
            if name in changes:
                before, after = changes[name]
                delta = stage_seconds(spec, after, rows, 0.0, 0.0) - stage_seconds(spec, before, rows, 0.0, 0.0)
                d = dataclasses.replace(d, batch_seconds=d.batch_seconds + delta,
                                        memory_bytes=d.memory_bytes - before.param_bytes + after.param_bytes)
        per_device.append(d)
    names = list(dict.fromkeys(n for d in per_device for n in d.partitions))
    rates = {n: sum(rows / d.batch_seconds for d in per_device if n in d.partitions and d.batch_seconds > 0)
             or float("inf") for n in names}
    bottleneck = min(rates, key=rates.get)
    bound = rates[bottleneck]
    for d in per_device:
        replicas = sum(1 for x in per_device if set(x.partitions) == set(d.partitions))
        d.utilisation = min(1.0, bound / replicas * d.batch_seconds / rows) if rows else 0.0
    latency = sum(max(d.batch_seconds for d in per_device if n in d.partitions) for n in names)
    return dataclasses.replace(est, per_device=per_device, bottleneck=bottleneck,
                               throughput_items_per_s=bound, latency_ms=latency * 1e3)
