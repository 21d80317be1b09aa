"""Measure a card through its backend and write it as a DeviceSpec: what the planner and simulator price with.

``sixfold-partition calibrate --card --backend NAME [--card-spec BASE]`` loads generated
dense partitions on the card through ``Backend.load`` and times ``Executable.run``,
the calls serving makes:

- ``peak_flops`` per precision: an MLP partition (``layers`` Gemm+Relu of ``width``
  units, the shape of a recommendation model's top MLP) at fp32, fp16 (the same graph
  converted, inputs and outputs kept fp32, as ``--dense-precision fp16`` makes) and
  int8 (ONNX Runtime's dynamic quantization), timed at several batch sizes; the
  highest FLOP/s seen. A precision the backend's ``supports()`` declines is left out.
- ``efficiency``: the fraction of the fp32 peak reached at ``typical_rows`` (a card's
  usual batch), so ``DeviceSpec.flops()`` predicts a typical batch;
- ``link_bandwidth`` and ``link_latency_s``: a copy partition (Identity of a wide
  fp32 tensor): the time of one row is the fixed cost of a transfer, the slope over
  rows the bandwidth (bytes in plus bytes out).

Memory size and memory bandwidth cannot be measured through the Backend API: they come
from the base spec (``--card-spec``, or the first device the backend's ``devices()``
reports). Each figure is the median of repeated runs within its share of the time budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.backends.api import Backend, CardRef, PartitionArtifact
from sixfold.backends.spec import DeviceSpec

__all__ = ["calibrate_card", "mlp_partition", "copy_partition", "main", "PRECISIONS"]

PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8")


def _graph_bytes(width: int, layers: int, seed: int) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    for k in range(layers):
        w = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{k}"), numpy_helper.from_array(np.zeros(width, np.float32), f"b{k}")]
        nodes += [helper.make_node("Gemm", [x, f"w{k}", f"b{k}"], [f"g{k}"]),
                  helper.make_node("Relu", [f"g{k}"], ["y" if k == layers - 1 else f"h{k}"])]
        x = f"h{k}"
    graph = helper.make_graph(nodes, "calibrate_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _at_precision(payload: bytes, precision: str) -> bytes:
    import onnx

    if precision == "fp32":
        return payload
    if precision == "fp16":
        from onnxconverter_common import float16
        return float16.convert_float_to_float16(onnx.load_from_string(payload), keep_io_types=True).SerializeToString()
    if precision == "int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic
        with tempfile.TemporaryDirectory(prefix="sixfold-calibrate-") as tmp:
            src, dst = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
            src.write_bytes(payload)
            logging.disable(logging.WARNING)  # its advice to pre-process the model is about accuracy, not speed
            try:
                quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8)
            finally:
                logging.disable(logging.NOTSET)
            return dst.read_bytes()
    raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")


def mlp_partition(precision: str = "fp32", *, width: int = 512, layers: int = 3, seed: int = 0) -> PartitionArtifact:
    """A dense partition of ``layers`` Gemm+Relu of ``width`` units at ``precision``; 2*width^2*layers FLOPs per row."""
    payload = _at_precision(_graph_bytes(width, layers, seed), precision)
    weight_bytes = {"fp32": 4, "fp16": 2, "int8": 1}[precision]
    return PartitionArtifact(name=f"calibrate-mlp-{precision}", format="onnx", payload=payload, input_names=("x",),
                             output_names=("y",), param_bytes=layers * width * (width + 1) * weight_bytes,
                             flops_per_item=2.0 * width * width * layers, bytes_per_item=8.0 * width, dtype=precision)


def copy_partition(width: int = 4096) -> PartitionArtifact:
    """A partition that only moves data: Identity of an fp32 [N, width] tensor (4*width bytes each way per row)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "calibrate_copy",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return PartitionArtifact(name="calibrate-copy", format="onnx", payload=model.SerializeToString(),
                             input_names=("x",), output_names=("y",), param_bytes=1, bytes_per_item=8.0 * width)


def _median_seconds(fn: Callable[[], Any], budget_s: float, min_runs: int = 3, max_runs: int = 200) -> float:
    fn()  # warm-up: first-call allocation and compilation are not what a batch costs
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _base_spec(backend: Backend, base: DeviceSpec | None) -> DeviceSpec:
    if base is not None:
        return base
    found = backend.devices()
    if not found:
        raise ValueError(f"backend {getattr(backend, 'name', type(backend).__name__)} reports no devices(); give the "
                         "card's base spec with --card-spec (its memory and memory bandwidth are kept)")
    return found[0]


def calibrate_card(backend: Backend, base: DeviceSpec | None = None, *, name: str | None = None,
                   seconds_budget: float = 10.0, rows: Sequence[int] = (16, 128, 512), typical_rows: int = 128,
                   width: int = 512, layers: int = 3, copy_width: int = 4096, copy_rows: int = 256,
                   log: Callable[[str], None] | None = None) -> tuple[DeviceSpec, dict[str, Any]]:
    """Measure one card through ``backend``: (the DeviceSpec, the raw measurements).

    ``base`` gives what the Backend API cannot measure (memory size and bandwidth, power); None: the
    backend's first ``devices()``. ValueError when the backend takes no fp32 partition.
    """
    if seconds_budget <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds_budget}")
    if typical_rows not in rows:
        rows = sorted({*rows, typical_rows})
    spec = _base_spec(backend, base)
    card = CardRef(0, spec.name.split("/")[0])  # one physical card, named as the server names its cards
    device = dataclasses.replace(spec, name=card.device_name)
    say = log or (lambda _text: None)
    rng = np.random.default_rng(0)
    share = seconds_budget / (len(PRECISIONS) * len(rows) + 2)
    measured: dict[str, Any] = {"flops_per_second": {}, "declined": [], "rows": list(rows), "width": width,
                                "layers": layers}
    peaks: dict[str, float] = {}
    typical = 0.0
    for precision in PRECISIONS:
        artifact = mlp_partition(precision, width=width, layers=layers)
        if not backend.supports(artifact):
            if precision == "fp32":
                raise ValueError(f"backend {backend.name} declines an fp32 ONNX partition; a card must take fp32")
            measured["declined"].append(precision)
            say(f"{precision}: declined by supports()")
            continue
        exe = backend.load(artifact.for_card(card), device)
        try:
            curve = {}
            for n in rows:
                feed = {"x": rng.standard_normal((n, width)).astype(np.float32)}
                seconds = _median_seconds(lambda feed=feed: exe.run(feed), share)
                curve[n] = artifact.flops_per_item * n / seconds
            peaks[precision] = max(curve.values())
            measured["flops_per_second"][precision] = {str(n): f for n, f in curve.items()}
            if precision == "fp32":
                typical = curve[typical_rows]
            say(f"{precision}: {peaks[precision] / 1e9:,.1f} GFLOP/s at best ("
                + ", ".join(f"{n} rows {f / 1e9:,.1f}" for n, f in curve.items()) + ")")
        finally:
            exe.close()
    exe = backend.load(copy_partition(copy_width).for_card(card), device)
    try:
        one = {"x": rng.standard_normal((1, copy_width)).astype(np.float32)}
        many = {"x": rng.standard_normal((copy_rows, copy_width)).astype(np.float32)}
        t1 = _median_seconds(lambda: exe.run(one), share)
        tn = _median_seconds(lambda: exe.run(many), share)
    finally:
        exe.close()
    moved = 8.0 * copy_width * (copy_rows - 1)  # bytes in + out beyond the one-row call
    bandwidth = moved / (tn - t1) if tn > t1 else 8.0 * copy_width * copy_rows / tn
    latency = max(0.0, t1 - 8.0 * copy_width / bandwidth)
    measured.update({"copy_seconds": {"1": t1, str(copy_rows): tn}, "copy_width": copy_width})
    say(f"copies: {bandwidth / 1e9:,.2f} GB/s in+out, {latency * 1e6:,.1f} us fixed per call")
    result = dataclasses.replace(
        spec, name=name or f"{backend.name}-calibrated", peak_flops=peaks,
        efficiency=min(1.0, max(1e-6, typical / peaks["fp32"])), link_bandwidth=bandwidth, link_latency_s=latency,
        kind=spec.kind if spec.kind != "host" else "card",
        description=f"{spec.name} measured through backend {backend.name} by sixfold-partition calibrate --card")
    return result, measured


def main(argv: Sequence[str] | None = None, check: Callable[[argparse.Namespace], None] | None = None) -> int:
    """``sixfold-partition calibrate --card --backend NAME``: measure a card, print or write its DeviceSpec JSON.

    ``check(args)`` runs right after parsing, before any measuring (the CLI checks its files and specs there).
    """
    from sixfold.backends.options import load_options_file, parse_option
    from sixfold.backends.registry import get_backend
    from sixfold.backends.spec_catalog import load_spec

    parser = argparse.ArgumentParser(prog="sixfold-partition calibrate --card",
                                     description="Measure a card through its backend and write it as a device spec.")
    parser.add_argument("--card", action="store_true", required=True, help="measure a card (not this host)")
    parser.add_argument("--backend", required=True, help="the card's backend (sixfold-serve --list-backends)")
    parser.add_argument("--card-spec", default=None,
                        help="base spec: memory size and bandwidth, power (default: the backend's first devices())")
    parser.add_argument("--option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                        help="backend option (repeatable)")
    parser.add_argument("--options-file", help="JSON object of backend options")
    parser.add_argument("--seconds", type=float, default=10.0, help="time budget for all measurements")
    parser.add_argument("--rows", default="16,128,512", help="batch sizes (rows) the MLP partition is timed at")
    parser.add_argument("--typical-rows", type=int, default=128, help="the batch the efficiency is taken at")
    parser.add_argument("--width", type=int, default=512, help="units per layer of the generated MLP")
    parser.add_argument("--name", default=None, help="the spec's name (default BACKEND-calibrated)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if check is not None:
        check(args)
    try:
        rows = sorted({int(r) for r in args.rows.split(",") if r.strip()})
    except ValueError:
        parser.error(f"--rows {args.rows!r}: give comma-separated row counts such as 16,128,512")
    if not rows or min(rows) < 1 or args.typical_rows < 1 or args.width < 1:
        parser.error("--rows, --typical-rows and --width must be >= 1")
    options: dict[str, Any] = load_options_file(args.options_file) if args.options_file else {}
    options.update(dict(args.option))
    backend = get_backend(args.backend, **options)
    base = load_spec(args.card_spec) if args.card_spec else None
    spec, _measured = calibrate_card(backend, base, name=args.name, seconds_budget=args.seconds, rows=rows,
                                    typical_rows=args.typical_rows, width=args.width,
                                    log=lambda text: print(f"calibrate --card: {text}", file=sys.stderr))
    text = json.dumps(spec.to_dict(), indent=2) + "\n"
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out} ({spec.name}: fp32 {spec.peak_flops['fp32'] / 1e9:,.1f} GFLOP/s, "
              f"link {spec.link_bandwidth / 1e9:,.2f} GB/s)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
