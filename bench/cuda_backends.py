"""The CUDA paths of the card backends against their CPU paths, on the zoo models' dense partitions.

For each model (dlrm-mlperf, rm2 by default; tables capped at ``--max-rows`` since only the
dense part matters) it partitions the model as ``sixfold-serve --card-spec gpu-l4 --cards 1``
does, runs the host (embedding) stage once per batch size to get the dense partition's real
inputs, then times the dense partition(s) per run, host arrays in and host arrays out (the
host<->device copies included, as the server calls ``Executable.run``):

    torch        cpu  (device spec host-cpu)    vs  cuda (device spec gpu-l4, when CUDA exists)
    onnxruntime  CPUExecutionProvider           vs  CUDAExecutionProvider (when onnxruntime has it)

and checks each CUDA path's outputs against its CPU path's (max abs diff, within ``--atol``).
Without CUDA (or without onnxruntime's CUDA provider) it says so and reports the CPU paths only.

With ``--e2e`` (the default; ``--no-e2e`` skips it) it also serves each model in-process
(``sixfold.server.loading.loader.load_partitioned``, one card, every batch on the card: no host dense fallback,
no batching window) with ``--backend torch`` on the gpu-l4 plan, ``--backend onnxruntime``
(CPU) and ``--backend simcard`` (the simulated gpu-l4 of the same plan), and times real queries
one at a time through ``ServedModel.infer`` (validation, batcher, host stage, card stage).

    .venv/bin/python bench/cuda_backends.py --quick                      # a minute on a CPU host
    python3 bench/cuda_backends.py --json runs/cuda_backends.json          # on a GPU host
    scripts/device_check.sh                                                # on a lent GPU machine

Prints a markdown table; ``--json PATH`` keeps every figure and the environment.
Writes nothing into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("dlrm-mlperf", "rm2")
BATCHES = (1, 16, 128, 256, 1024)
E2E_ROWS = (1, 128, 1024)


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count()}
    for mod in ("numpy", "torch", "onnxruntime", "onnx", "grpc", "google.protobuf"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            out[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            out[mod] = f"missing ({type(exc).__name__}: {exc})"
    try:
        import torch
        out["torch_threads"] = torch.get_num_threads()
        out["torch_cuda_build"] = torch.version.cuda
        out["cuda_available"] = bool(torch.cuda.is_available())
        if out["cuda_available"]:
            out["cuda_device"] = torch.cuda.get_device_name(0)
            out["cuda_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
            out["matmul_allow_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
    except Exception as exc:  # noqa: BLE001
        out["cuda_available"] = False
        out["cuda_error"] = f"{type(exc).__name__}: {exc}"
    try:
        import onnxruntime
        out["ort_providers"] = list(onnxruntime.get_available_providers())
        out["ort_device"] = onnxruntime.get_device()
        if "CUDAExecutionProvider" in out["ort_providers"] and hasattr(onnxruntime, "preload_dlls"):
            # onnxruntime-gpu finds CUDA/cuDNN from the nvidia-* wheels torch brought only when preloaded.
            try:
                onnxruntime.preload_dlls()
                out["ort_preload_dlls"] = "ok"
            except Exception as exc:  # noqa: BLE001
                out["ort_preload_dlls"] = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001
        out["ort_providers"] = []
        out["ort_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _time(run, inputs: dict[str, np.ndarray], *, budget_s: float, min_runs: int, max_runs: int,
          warmup: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Run ``run(inputs)`` ``warmup`` times, then until ``budget_s`` (at least min_runs, at most max_runs)."""
    out = None
    for _ in range(warmup):
        out = run(inputs)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < min_runs or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        out = run(inputs)
        times.append(time.perf_counter() - t0)
    times.sort()
    stats = {"median_ms": statistics.median(times) * 1e3, "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3,
             "min_ms": times[0] * 1e3, "runs": len(times)}
    return out, stats  # type: ignore[return-value]


def _chain(executables: list, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the dense stages in pipeline order (one stage when replicated): each stage's outputs feed the next."""
    env = dict(inputs)
    out: dict[str, np.ndarray] = {}
    for ex in executables:
        out = ex.run(env)
        env.update(out)
    return out


def _max_abs_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)))) if a[k].size else 0.0
               for k in a)


def _paths(env: dict[str, Any]) -> list[dict[str, Any]]:
    """The (backend, path) pairs to time, each with how to build its backend and device spec, or why it is absent."""
    from sixfold.backends.spec_catalog import load_spec

    host, gpu = load_spec("host-cpu"), load_spec("gpu-l4")
    paths: list[dict[str, Any]] = [
        {"backend": "torch", "path": "cpu", "spec": host, "options": {}},
        {"backend": "torch", "path": "cuda", "spec": gpu, "options": {},
         "absent": None if env.get("cuda_available") else "torch.cuda.is_available() is False"},
        {"backend": "onnxruntime", "path": "cpu", "spec": host, "options": {"providers": ["CPUExecutionProvider"]}},
        {"backend": "onnxruntime", "path": "cuda", "spec": gpu,
         "options": {"providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]},
         "absent": None if "CUDAExecutionProvider" in env.get("ort_providers", [])
         else f"CUDAExecutionProvider not in onnxruntime's providers {env.get('ort_providers')}"},
    ]
    return paths


def bench_model(name: str, args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    from sixfold import models
    from sixfold.backends import registry
    from sixfold.backends.spec_catalog import load_spec
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.server.loading.loader import load_host_stage

    t0 = time.perf_counter()
    _, partitioned = partition_builtin(name, max_rows=args.max_rows, seed=0, cards=1, card_spec="gpu-l4")
    plan = partitioned.plan
    stages = plan.dense_stages()
    result: dict[str, Any] = {"model": name, "dense_stages": stages, "partition_s": time.perf_counter() - t0,
                              "dense_param_bytes": sum(partitioned.artifacts[s].param_bytes for s in stages),
                              "cells": [], "paths": {}}
    host = load_host_stage(partitioned, load_spec("host-cpu"))
    gen = models.RequestGenerator.for_config(models.get_config(name, max_rows=args.max_rows), seed=1)
    feeds: dict[int, dict[str, np.ndarray]] = {}
    for rows in args.batches:
        request = gen.make(rows)
        feeds[rows] = {**request, **host.run({k: request[k] for k in host.input_names})}
    host.close()

    loaded: dict[tuple[str, str], list] = {}
    for p in _paths(env):
        key = (p["backend"], p["path"])
        info: dict[str, Any] = {"spec": p["spec"].name}
        if p.get("absent"):
            info["absent"] = p["absent"]
            result["paths"][f"{key[0]}/{key[1]}"] = info
            print(f"  {name}: {key[0]}/{key[1]} absent: {p['absent']}", flush=True)
            continue
        try:
            backend = registry.get_backend(p["backend"], **p["options"])
            exes = [backend.load(partitioned.artifact_for(s, backend), p["spec"]) for s in stages]
        except Exception as exc:  # noqa: BLE001 - e.g. CUDA provider listed but its libraries missing
            info["error"] = f"{type(exc).__name__}: {exc}"
            result["paths"][f"{key[0]}/{key[1]}"] = info
            print(f"  {name}: {key[0]}/{key[1]} failed to load: {info['error']}", flush=True)
            continue
        if p["backend"] == "torch":
            info["torch_device"] = [e.torch_device for e in exes]
            if p["path"] == "cuda" and any(d == "cpu" for d in info["torch_device"]):
                info["warning"] = "loaded on CPU although the spec is a gpu"
        else:
            info["providers"] = [e.providers for e in exes]
            if p["path"] == "cuda" and exes[0].providers[0] != "CUDAExecutionProvider":
                info["warning"] = f"session fell back to {exes[0].providers}"
        result["paths"][f"{key[0]}/{key[1]}"] = info
        loaded[key] = exes

    for rows in args.batches:
        feed = feeds[rows]
        reference: dict[str, dict[str, np.ndarray]] = {}
        for (backend, path), exes in loaded.items():
            cell: dict[str, Any] = {"model": name, "rows": rows, "backend": backend, "path": path}
            try:
                out, stats = _time(lambda x, exes=exes: _chain(exes, x), feed, budget_s=args.budget_s,
                                   min_runs=args.min_runs, max_runs=args.max_runs, warmup=args.warmup)
            except Exception as exc:  # noqa: BLE001 - one failing cell must not lose the others
                cell["error"] = f"{type(exc).__name__}: {exc}"
                print(f"  {name} rows={rows} {backend}/{path} failed: {cell['error']}", flush=True)
                result["cells"].append(cell)
                continue
            cell.update(stats)
            cell["us_per_row"] = stats["median_ms"] * 1e3 / rows
            if path == "cpu":
                reference[backend] = out
            elif backend in reference:
                diff = _max_abs_diff(reference[backend], out)
                cell["max_abs_diff_vs_cpu"] = diff
                cell["match"] = bool(diff <= args.atol)
            cell["finite"] = bool(all(np.isfinite(v).all() for v in out.values()))
            result["cells"].append(cell)
        if "torch" in reference and "onnxruntime" in reference:
            result.setdefault("torch_cpu_vs_ort_cpu_max_abs_diff", {})[str(rows)] = _max_abs_diff(
                reference["torch"], reference["onnxruntime"])
        line = "  ".join(f"{c['backend']}/{c['path']} {c['median_ms']:.3f} ms" for c in result["cells"]
                         if c["rows"] == rows and "median_ms" in c)
        print(f"  {name} rows={rows}: {line}", flush=True)
    for exes in loaded.values():
        for e in exes:
            e.close()
    return result


async def _e2e_one(served, queries: list[dict[str, np.ndarray]], warmup: int) -> tuple[list[float], list[np.ndarray]]:
    for q in queries[:warmup]:
        await served.infer(q, ["scores"])
    times, scores = [], []
    for q in queries:
        t0 = time.perf_counter()
        out = await served.infer(q, ["scores"])
        times.append(time.perf_counter() - t0)
        scores.append(out["scores"])
    return times, scores


def e2e_model(name: str, args: argparse.Namespace, env: dict[str, Any]) -> dict[str, Any]:
    """Serve ``name`` in-process on each card backend and time queries through ServedModel.infer, one at a time."""
    from sixfold import models
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.server.scheduling.batcher import BatchingConfig
    from sixfold.server.loading.loader import load_partitioned
    from sixfold.server.observability.metrics import ServerMetrics

    _, partitioned = partition_builtin(name, max_rows=args.max_rows, seed=0, cards=1, card_spec="gpu-l4")
    gen = models.RequestGenerator.for_config(models.get_config(name, max_rows=args.max_rows), seed=2)
    queries = {rows: [gen.make(rows) for _ in range(args.e2e_queries)] for rows in args.e2e_rows}
    backends = [("torch", "torch on gpu-l4 plan" + (" (CUDA)" if env.get("cuda_available") else " (no CUDA: CPU)")),
                ("onnxruntime", "onnxruntime CPU"), ("simcard", "simcard (simulated gpu-l4)")]
    result: dict[str, Any] = {"model": name, "queries_per_size": args.e2e_queries, "rows": {}, "backends": {}}
    scores_by: dict[str, dict[int, list[np.ndarray]]] = {}
    for backend, label in backends:
        info: dict[str, Any] = {"label": label}
        result["backends"][backend] = info
        try:
            served = load_partitioned(partitioned, backend=backend, metrics=ServerMetrics(),
                                      batching=BatchingConfig(max_queue_delay_microseconds=0), host_dense_max_rows=0)
        except Exception as exc:  # noqa: BLE001
            info["error"] = f"{type(exc).__name__}: {exc}"
            print(f"  e2e {name} {backend} failed to load: {info['error']}", flush=True)
            continue
        if backend == "torch":
            info["torch_device"] = [getattr(c, "torch_device", "?") for c in served.runtime.cards]

        async def drive():
            try:
                return {rows: await _e2e_one(served, qs, args.e2e_warmup) for rows, qs in queries.items()}
            finally:
                await served.batcher.close()
        try:
            measured = asyncio.run(drive())
        except Exception as exc:  # noqa: BLE001
            info["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            continue
        finally:
            served.runtime.close()
        scores_by[backend] = {}
        for rows, (times, scores) in measured.items():
            times.sort()
            info[str(rows)] = {"median_ms": statistics.median(times) * 1e3,
                               "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3, "queries": len(times)}
            scores_by[backend][rows] = scores
        print(f"  e2e {name} {backend}: " + "  ".join(
            f"rows={r} {info[str(r)]['median_ms']:.3f} ms" for r in queries), flush=True)
    if "torch" in scores_by and "onnxruntime" in scores_by:
        result["torch_vs_onnxruntime_max_abs_diff"] = max(
            float(np.max(np.abs(a - b))) for r in queries for a, b in zip(scores_by["torch"][r], scores_by["onnxruntime"][r]))
    return result


def table(results: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = ["| model | rows | torch cpu ms | torch cuda ms | speedup | max diff | ort cpu ms | ort cuda ms | speedup | max diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def fmt(cell: dict | None, key: str, spec: str) -> str:
        if cell is None:
            return "absent"
        if "error" in cell:
            return "error"
        return format(cell[key], spec) if key in cell else ""

    for res in results:
        rows_seen = sorted({c["rows"] for c in res["cells"]})
        for rows in rows_seen:
            cells = {(c["backend"], c["path"]): c for c in res["cells"] if c["rows"] == rows}
            row = [res["model"], str(rows)]
            for backend in ("torch", "onnxruntime"):
                cpu, cuda = cells.get((backend, "cpu")), cells.get((backend, "cuda"))
                speed = (f"{cpu['median_ms'] / cuda['median_ms']:.2f}x" if cpu and cuda and "median_ms" in cpu
                         and "median_ms" in cuda else "")
                diff = fmt(cuda, "max_abs_diff_vs_cpu", ".1e") if cuda else ""
                row += [fmt(cpu, "median_ms", ".3f"), fmt(cuda, "median_ms", ".3f"), speed, diff]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def e2e_table(results: list[dict[str, Any]]) -> str:
    lines = ["| model | backend | " + " | ".join(f"{r} rows p50 ms" for r in E2E_ROWS_USED) + " |",
             "|---|---|" + "---:|" * len(E2E_ROWS_USED)]
    for res in results:
        for backend, info in res["backends"].items():
            vals = ["error" if "error" in info else f"{info[str(r)]['median_ms']:.3f}" if str(r) in info else ""
                    for r in E2E_ROWS_USED]
            lines.append(f"| {res['model']} | {info['label']} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


E2E_ROWS_USED: tuple[int, ...] = E2E_ROWS


def main(argv: list[str] | None = None) -> int:
    global E2E_ROWS_USED
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="batch sizes (rows), comma-separated")
    ap.add_argument("--max-rows", type=int, default=1000, help="rows per embedding table (only the dense part matters)")
    ap.add_argument("--budget-s", type=float, default=0.4, help="timed seconds per cell (after warmup)")
    ap.add_argument("--min-runs", type=int, default=10)
    ap.add_argument("--max-runs", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--atol", type=float, default=1e-4, help="CUDA vs CPU outputs: max abs diff allowed")
    ap.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=True,
                    help="also serve each model in-process on torch (gpu-l4 plan), onnxruntime and simcard")
    ap.add_argument("--e2e-rows", default=",".join(map(str, E2E_ROWS)))
    ap.add_argument("--e2e-queries", type=int, default=40)
    ap.add_argument("--e2e-warmup", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer sizes, shorter cells, fewer e2e queries")
    ap.add_argument("--json", type=Path, help="write every figure and the environment here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.budget_s, args.min_runs, args.warmup = "1,128,1024", 0.15, 5, 3
        args.e2e_rows, args.e2e_queries, args.e2e_warmup = "1,128", 10, 2
    args.models = [m for m in args.models.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.e2e_rows = [int(b) for b in args.e2e_rows.split(",") if b]
    E2E_ROWS_USED = tuple(args.e2e_rows)

    import logging
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.perf_counter()
    env = _versions()
    print("environment: " + json.dumps(env), flush=True)
    if not env.get("cuda_available"):
        print("CUDA absent (torch.cuda.is_available() is False): reporting the CPU paths only", flush=True)
    if "CUDAExecutionProvider" not in env.get("ort_providers", []):
        print(f"onnxruntime has no CUDAExecutionProvider (providers: {env.get('ort_providers')}): "
              "its CUDA path is absent", flush=True)

    report: dict[str, Any] = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                              "env": env, "dense": [], "e2e": [], "errors": []}

    def save() -> None:
        report["total_s"] = time.perf_counter() - started
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))

    def each_model(part: str, title: str, bench: Any) -> None:
        """``bench`` per model into ``report[part]``; a model that fails is recorded and the rest still run."""
        for name in args.models:
            print(f"{title} {name}:", flush=True)
            try:
                report[part].append(bench(name, args, env))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                report["errors"].append(f"{part} {name}: {type(exc).__name__}: {exc}")
            save()

    each_model("dense", "dense partition of", bench_model)
    if args.e2e:
        each_model("e2e", "served in-process,", e2e_model)

    device = env.get("cuda_device", "no CUDA device")
    print(f"\nDense partition per run, median ms, host arrays in and out ({platform.machine()}, "
          f"{os.cpu_count()} CPUs, {device}; torch {env.get('torch')} with {env.get('torch_threads')} threads, "
          f"onnxruntime {env.get('onnxruntime')} with 1 intra-op thread as served; max diff: CUDA vs CPU of the "
          f"same backend, atol {args.atol}):\n")
    print(table(report["dense"], env))
    if report["e2e"]:
        print("\nServed in-process (ServedModel.infer, one query at a time, one card, no host dense fallback, "
              "no batching window), median ms per query:\n")
        print(e2e_table(report["e2e"]))
        for res in report["e2e"]:
            if "torch_vs_onnxruntime_max_abs_diff" in res:
                print(f"  {res['model']}: served scores, torch vs onnxruntime max abs diff "
                      f"{res['torch_vs_onnxruntime_max_abs_diff']:.1e}")
    mismatches = [c for r in report["dense"] for c in r["cells"] if c.get("match") is False]
    failed = [c for r in report["dense"] for c in r["cells"] if "error" in c]
    report["mismatches"] = len(mismatches)
    report["failed_cells"] = len(failed)
    save()
    print(f"\n{len(mismatches)} CUDA cell(s) outside atol {args.atol}, {len(failed)} failed cell(s), "
          f"{len(report['errors'])} error(s); {report['total_s']:.0f} s in all", flush=True)
    if args.json:
        print(f"wrote {args.json}")
    return 1 if mismatches or failed or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
