"""Measure this host and write it as a DeviceSpec (``kind="host"``), for the cost model.

Each figure is the median of repeated runs within its share of ``seconds_budget``
(median, not best: the spec predicts the latency a server sees, and on a shared machine the
best of hundreds of runs is faster than what a stage typically gets), measured on the
runtime that executes that kind of op in sixfold:

- matrix products (``matmul_efficiency``, ``peak_flops``): ONNX Runtime, which runs dense
  partitions: batched matmuls of small products (the dot interaction's shape) and GEMMs with
  constant weights (an MLP layer, prepacked as in a real model), keyed by one product's FLOPs;
  torch when onnxruntime is missing;
- memory bandwidth: copying a large array (bytes read + bytes written per second);
- gathers (``gather_bandwidth``, ``per_id_seconds``): ``F.embedding_bag``, which runs host
  partitions, over a table larger than the L2 cache, at two row widths, with power-law ids
  (Zipf 1.05 per sub-table, scattered by a hash: the skew of recommendation traffic and of
  ``models.RequestGenerator``). Two widths separate the per-row-byte cost from the per-id
  cost. Uniform ids over the same table are slower (reported in ``measured``, not used);
- element-wise index ops (``per_index_seconds``): ONNX Runtime's ``Gather`` picking the
  upper-triangle pairs of a batch of interaction matrices (what an ``index_select`` becomes
  in a dense partition), a fixed cost per index beyond the bytes it moves;
- fixed costs: one tiny torch op (``per_op_seconds``) and one call of a one-op ONNX Runtime
  session beyond that op (``per_batch_seconds``).

Usage::

    sixfold-partition calibrate --seconds 10 --out host.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.backends.host.native import cache_dir, write_json_atomic
from sixfold.backends.spec import DeviceSpec

__all__ = ["calibrate_host", "measure_host", "main", "MATMUL_SHAPES", "GATHER_DIMS", "machine_key", "cache_dir",
           "cached_host_spec", "auto_host_spec"]

MATMUL_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    # (batch of products, m, k, n); batch 0 = one GEMM with constant (prepacked) weights [k, n].
    (256, 8, 32, 8), (256, 16, 32, 16), (256, 32, 64, 32), (64, 64, 64, 64),
    (0, 256, 128, 128), (0, 256, 512, 512), (0, 256, 1024, 1024),
)
GATHER_DIMS: tuple[int, int] = (32, 128)
"""Row widths (fp32 values) the gather is timed at."""
_ZIPF = 1.05
_HASH = 2_654_435_761
_SUB_TABLES = 8
_BAG = 20


def _median_seconds(fn: Callable[[], Any], deadline: float, min_runs: int = 3) -> float:
    """Median wall time of ``fn`` over runs until ``deadline`` (at least ``min_runs``)."""
    times = []
    while len(times) < min_runs or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_of_rounds(fns: Sequence[Callable[[], Any]], deadline: float, min_rounds: int = 3) -> list[float]:
    """Median wall time of each of ``fns``, running them in turn until ``deadline``.

    Round-robin, so a burst of load from another process slows one round of every
    measurement, not every run of one of them; each timed call follows an untimed call of
    the same function, so caches hold what that op itself left there (a stage's steady state).
    """
    times: list[list[float]] = [[] for _ in fns]
    rounds = 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        for i, fn in enumerate(fns):
            fn()  # warm: what a stage sees when its previous batch ran the same op
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
        rounds += 1
    return [statistics.median(t) for t in times]


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def _ort_matmul(batch: int, m: int, k: int, n: int, threads: int) -> Callable[[], Any] | None:
    """A one-node ONNX Runtime session computing the product, ready to call; None without ORT."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    rng = np.random.default_rng(0)
    a_shape = [batch, m, k] if batch else [m, k]
    a = rng.random(a_shape, dtype=np.float32)
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_shape)]
    feeds = {"a": a}
    initializers = []
    if batch:  # both operands are activations (the interaction's bmm)
        inputs.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [batch, k, n]))
        feeds["b"] = rng.random((batch, k, n), dtype=np.float32)
        node = helper.make_node("MatMul", ["a", "b"], ["c"])
    else:  # an MLP layer: constant weights and bias, which ORT prepacks
        initializers = [numpy_helper.from_array(rng.random((k, n), dtype=np.float32), "w"),
                        numpy_helper.from_array(rng.random((n,), dtype=np.float32), "bias")]
        node = helper.make_node("Gemm", ["a", "w", "bias"], ["c"])
    graph = helper.make_graph([node], "calibrate", inputs,
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda: session.run(None, feeds)


def _torch_matmul(batch: int, m: int, k: int, n: int) -> Callable[[], Any]:
    import torch

    if batch:
        a, b = torch.rand(batch, m, k), torch.rand(batch, k, n)
        return lambda: torch.bmm(a, b)
    a, b = torch.rand(m, k), torch.rand(k, n)
    return lambda: torch.mm(a, b)


def _matmul_curve(deadline: float, threads: int, small: bool) -> tuple[list[tuple[float, float]], str]:
    """(FLOPs of one product, FLOP/s) for ``MATMUL_SHAPES``, and the runtime that ran them."""
    shapes = [s for s in MATMUL_SHAPES if not small or 2 * s[1] * s[2] * s[3] * max(1, s[0]) < 1e8]
    runtime = "onnxruntime" if _ort_matmul(0, 1, 1, 1, threads) is not None else "torch"
    fns = [_ort_matmul(b, m, k, n, threads) if runtime == "onnxruntime" else _torch_matmul(b, m, k, n)
           for b, m, k, n in shapes]
    for fn in fns:
        fn()  # first run: allocations, prepacking
    seconds = _median_of_rounds(fns, deadline)
    return [(2.0 * m * k * n, 2.0 * m * k * n * max(1, b) / t) for (b, m, k, n), t in zip(shapes, seconds)], runtime


def _power_law_ids(rng: np.random.Generator, rows: int, count: int, sub_tables: int) -> np.ndarray:
    """Bounded power-law ids (Zipf ``_ZIPF``) in ``sub_tables`` equal sub-tables, hot rows hashed apart."""
    per = rows // sub_tables
    u = rng.random(count)
    rank = np.minimum(np.floor(((per ** (1 - _ZIPF) - 1) * u + 1) ** (1 / (1 - _ZIPF))).astype(np.int64) - 1,
                      per - 1)
    table = rng.integers(0, sub_tables, count)
    return table * per + (rank * _HASH + table * 7919) % per


def _gather(deadline: float, small: bool, copy_bandwidth: float, per_op: float) -> dict[str, float]:
    """Per-id cost and row bandwidth of ``embedding_bag`` under power-law ids, and the uniform figure.

    Each timing is priced as the cost model prices a gather op: ``per_op + ids * (per_id +
    row_bytes / gather_bandwidth) + (indices + output bytes) / memory_bandwidth``; two row
    widths give the two unknowns.
    """
    import torch
    from torch.nn import functional as F

    table_bytes = (32 if small else 256) << 20
    count = 20_000 if small else 200_000
    storage = torch.ones(table_bytes // 4)  # written, so every page is real memory (not the zero page)
    rng = np.random.default_rng(0)
    offsets = torch.arange(0, count, _BAG)

    def lookup(dim: int, ids: torch.Tensor) -> Callable[[], Any]:
        table = storage.view(storage.numel() // dim, dim)
        return lambda: F.embedding_bag(ids, table, offsets, mode="sum")

    fns = [lookup(dim, torch.from_numpy(_power_law_ids(rng, storage.numel() // dim, count, _SUB_TABLES)))
           for dim in GATHER_DIMS]
    wide_rows = storage.numel() // GATHER_DIMS[1]
    fns.append(lookup(GATHER_DIMS[1], torch.randint(0, wide_rows, (count,))))  # uniform ids, for the record
    *seconds, uniform = _median_of_rounds(fns, deadline)
    per_id_cost = []  # seconds per id beyond the launch and the indices/output traffic
    for dim, t in zip(GATHER_DIMS, seconds):
        moved = count * 8 + offsets.numel() * 8 + offsets.numel() * dim * 4
        per_id_cost.append(max(0.0, t - per_op - moved / copy_bandwidth) / count)
    narrow, wide = GATHER_DIMS[0] * 4, GATHER_DIMS[1] * 4
    slope = (per_id_cost[1] - per_id_cost[0]) / (wide - narrow)  # seconds per row byte
    if slope <= 0:  # wider rows no dearer: noise; take it all as bandwidth at the wide width
        slope = per_id_cost[1] / wide
    per_id = max(0.0, per_id_cost[0] - slope * narrow)
    return {"gather_bandwidth": 1.0 / slope, "per_id_seconds": per_id,
            "uniform_gather_bandwidth": count * GATHER_DIMS[1] * 4 / uniform,
            "gather_table_bytes": float(table_bytes)}


INDEX_SHAPE: tuple[int, int] = (256, 33)
"""(rows, features) of the calibrated pair gather: rows x F*(F-1)/2 indices into [rows, F*F]."""


def _ort_index(rows: int, features: int, threads: int) -> tuple[Callable[[], Any], int, int] | None:
    """A one-node ONNX Runtime ``Gather`` (axis 1) of the upper-triangle pairs, its index count and
    the bytes it moves (indices + output); None without ORT."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        return None
    i, j = np.triu_indices(features, 1)
    pairs = (i * features + j).astype(np.int64)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["z", "pairs"], ["out"], axis=1)], "calibrate_index",
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [rows, features * features])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], [numpy_helper.from_array(pairs, "pairs")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"z": np.random.default_rng(0).random((rows, features * features), dtype=np.float32)}
    indices = rows * pairs.size
    return (lambda: session.run(None, feeds)), indices, pairs.nbytes + indices * 4


def _index_cost(deadline: float, threads: int, copy_bandwidth: float, per_op: float, per_call: float,
                small: bool) -> dict[str, float]:
    """Seconds per index of ONNX Runtime's element gather, priced as the cost model prices an index
    op: ``per_call + per_op + indices * per_index + moved / memory_bandwidth``."""
    rows, features = INDEX_SHAPE
    made = _ort_index(rows // 4 if small else rows, features, threads)
    if made is None:
        return {}
    fn, indices, moved = made
    fn()
    (seconds,) = _median_of_rounds([fn], deadline)
    return {"per_index_seconds": max(0.0, seconds - per_call - per_op - moved / copy_bandwidth) / indices}


def _fixed_costs(deadline: float, threads: int) -> dict[str, float]:
    """One tiny torch op, and one call of a one-op ONNX Runtime session beyond it."""
    import torch

    x = torch.ones(1)
    add = torch.ops.aten.add.Tensor  # how an exported graph calls its ops
    per_op = _median_seconds(lambda: add(x, x), time.perf_counter() + (deadline - time.perf_counter()) / 2,
                           min_runs=50)
    call = _ort_matmul(0, 1, 1, 1, threads)
    per_call = _median_seconds(call, deadline, min_runs=50) if call is not None else per_op
    return {"per_op_seconds": per_op, "per_batch_seconds": max(0.0, per_call - per_op)}


def measure_host(seconds_budget: float = 10.0, threads: int | None = None) -> dict[str, Any]:
    """Raw measurements (per second / seconds): ``fp32_flops``, ``memory_bandwidth``,
    ``gather_bandwidth``, ``per_id_seconds``, ``uniform_gather_bandwidth``, ``per_index_seconds`` (absent
    without ONNX Runtime), ``per_op_seconds``,
    ``per_batch_seconds``, ``matmul_curve`` [(product FLOPs, FLOP/s)], ``matmul_runtime``, ``threads``.

    Sizes shrink with the budget, so a tiny budget (tests) finishes in about that time.
    """
    import torch

    if not seconds_budget > 0:
        raise ValueError(f"seconds_budget must be > 0, got {seconds_budget}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    used = threads if threads is not None else previous
    small = seconds_budget < 2
    start = time.perf_counter()

    def until(fraction: float) -> float:
        return start + fraction * seconds_budget

    out: dict[str, Any] = {}
    try:
        with torch.inference_mode():
            out.update(_fixed_costs(until(0.05), used))
            count = (16 << 20 if small else 64 << 20) // 4
            src, dst = torch.ones(count), torch.empty(count)
            dst.copy_(src)
            out["memory_bandwidth"] = 2.0 * src.nbytes / _median_seconds(lambda: dst.copy_(src), until(0.15))
            del src, dst
            curve, runtime = _matmul_curve(until(0.6), used, small)
            out["matmul_curve"], out["matmul_runtime"] = curve, runtime
            out["fp32_flops"] = max(rate for _, rate in curve)
            out.update(_index_cost(until(0.65), used, out["memory_bandwidth"], out["per_op_seconds"],
                                   out["per_batch_seconds"], small))
            out.update(_gather(until(1.0), small, out["memory_bandwidth"], out["per_op_seconds"]))
    finally:
        torch.set_num_threads(previous)
    out["threads"] = float(used)
    return out


def _efficiency_table(curve: Sequence[tuple[float, float]], peak: float) -> tuple[tuple[float, float], ...]:
    """Sorted (product FLOPs, fraction of peak), made non-decreasing.

    A larger product is never slower per FLOP than a smaller one at these sizes, so a point
    below its predecessor is a measurement that load slowed down: it takes its predecessor's
    value. Shapes of equal FLOPs keep the slower (the safer price).
    """
    best: dict[float, float] = {}
    for flops, rate in curve:
        best[flops] = min(best.get(flops, math.inf), rate)
    table: list[tuple[float, float]] = []
    for flops, rate in sorted(best.items()):
        eff = min(1.0, rate / peak)
        table.append((flops, max(eff, table[-1][1]) if table else eff))
    return tuple(table)


def calibrate_host(seconds_budget: float = 10.0, *, threads: int | None = None, name: str = "host-calibrated",
                   efficiency: float | None = None) -> DeviceSpec:
    """This host as a DeviceSpec: measured peak FLOP/s (fp16 and int8 assumed equal: no faster
    host kernels are used), matmul efficiency by product size, streaming and gather bandwidth,
    per-id, per-index, per-op and per-batch costs; physical memory; no link.

    ``efficiency`` (the roofline's factor, for costs without an op profile) defaults to the
    measured efficiency of the largest GEMM.
    """
    m = measure_host(seconds_budget, threads)
    flops = m["fp32_flops"]
    table = _efficiency_table(m["matmul_curve"], flops)
    desc = (f"measured by sixfold.backends.host.calibrate on {os.cpu_count()} CPUs, {int(m['threads'])} thread(s): "
            f"matmul ({m['matmul_runtime']}) {table[0][1] * flops / 1e9:.1f}..{flops / 1e9:.1f} GFLOP/s, "
            f"copy {m['memory_bandwidth'] / 1e9:.1f} GB/s, power-law row gather "
            f"{m['gather_bandwidth'] / 1e9:.1f} GB/s + {m['per_id_seconds'] * 1e9:.1f} ns/id "
            f"(uniform ids: {m['uniform_gather_bandwidth'] / 1e9:.1f} GB/s at {GATHER_DIMS[1]} floats/row), "
            f"element gather {m.get('per_index_seconds', 0.0) * 1e9:.1f} ns/index, "
            f"op {m['per_op_seconds'] * 1e6:.1f} us, call {m['per_batch_seconds'] * 1e6:.1f} us")
    return DeviceSpec(name=name, memory_bytes=_host_memory_bytes(),
                      peak_flops={"fp32": flops, "fp16": flops, "int8": flops},
                      memory_bandwidth=m["memory_bandwidth"], link_bandwidth=0, link_latency_s=0.0,
                      efficiency=efficiency if efficiency is not None else table[-1][1],
                      kind="host", description=desc, matmul_efficiency=table,
                      gather_bandwidth=m["gather_bandwidth"], per_id_seconds=m["per_id_seconds"],
                      per_index_seconds=m.get("per_index_seconds", 0.0),
                      per_op_seconds=m["per_op_seconds"], per_batch_seconds=m["per_batch_seconds"])


def machine_key() -> str:
    """Names this machine for the cache: host name, CPU model, CPU count and memory (a VM resized is a new one)."""
    import hashlib
    import platform

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{platform.node()}|{platform.machine()}|{model}|{os.cpu_count()}|{_host_memory_bytes()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cached_host_spec() -> Path | None:
    """This machine's cached calibration (``auto_host_spec`` writes it), or None when there is none yet."""
    path = cache_dir() / f"host-{machine_key()}.json"
    return path if path.is_file() else None


def auto_host_spec(seconds_budget: float | None = None) -> DeviceSpec:
    """This machine as a host spec: the cached calibration, measured and cached on first use.

    What ``--host-spec auto`` resolves to. The first call measures for ``seconds_budget``
    (default $SIXFOLD_CALIBRATE_SECONDS, else 10 s) and says so on stderr; later calls read the file.
    """
    path = cached_host_spec()
    if path is not None:
        try:
            return DeviceSpec.from_dict(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):  # a stale or damaged file: measure again
            pass
    budget = seconds_budget or float(os.environ.get("SIXFOLD_CALIBRATE_SECONDS", "10"))
    target = cache_dir() / f"host-{machine_key()}.json"
    print(f"sixfold: calibrating this host once ({budget:g} s); cached in {target}", file=sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    spec = calibrate_host(budget, name=f"host-auto-{machine_key()}")
    load = max(load, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    spec = dataclasses.replace(spec, description=f"{spec.description}; load average {load:.1f} while measured")
    if load > (os.cpu_count() or 1):
        print(f"sixfold: warning: the host was busy while calibrated (load average {load:.1f} on {os.cpu_count()} "
              f"CPUs), so its figures are slow; delete {target} to measure again when it is quiet", file=sys.stderr)
    write_json_atomic(target, spec.to_dict())
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    """``calibrate [--seconds S] [--threads N] [--name NAME] [--out FILE]``: print (or write) the spec as JSON."""
    parser = argparse.ArgumentParser(prog="sixfold-partition calibrate",
                                     description="Measure this host and print it as a device spec (JSON).")
    parser.add_argument("--seconds", type=float, default=10.0, help="time budget for all measurements (< 30)")
    parser.add_argument("--threads", type=int, default=None, help="torch and ONNX Runtime threads (default: torch's)")
    parser.add_argument("--name", default="host-calibrated", help="the spec's name")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 30:
        parser.error(f"--seconds must be in (0, 30], got {args.seconds}")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    spec = calibrate_host(args.seconds, threads=args.threads, name=args.name)
    text = json.dumps(spec.to_dict(), indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
        print(f"wrote {args.out}: {spec.description}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
