"""Host embedding stage benchmark: HostEmbeddingStage vs the raw torch kernel, and fp32 vs fp16/int8/int4.

Cases (row counts capped so the bench fits a small machine):
  rm2          32 tables x 50k rows, dim 64, ~120 ids per bag (uniform 100..140), 270 items per query
  dlrm-mlperf  26 tables x 100k rows, dim 128, one-hot (1 id per bag), 270 items per query

Variants, timed side by side in one process (interleaved, order rotated every run):
  raw-kernel        F.embedding_bag on the fp32 stage's fused weight, rows/offsets precomputed (a floor:
                    it skips the index arithmetic and id checks, which the model does too)
  model-tbe         the model's own torch module (sixfold.models.dlrm.TableBatchedEmbedding) on the same weight:
                    the same jagged request in, the same index arithmetic plus the kernel; what the
                    unpartitioned model runs, so "stage vs model" is the stage's own overhead
  fp32              HostEmbeddingStage, fused layout (the default)
  fp32-per-table    HostEmbeddingStage, one kernel call per table (the zero-copy-from-files layout)
  fp16, int8, int4  HostEmbeddingStage, fused

Each run times ``--batches`` consecutive batches per variant; the report is the median over
``--runs`` runs of ms per batch, and of each run's ratio to the fp32 stage (and of fp32 to the
raw kernel: the stage's overhead). Ids are uniform (no hot rows), so caches flatter nothing.

    .venv/bin/python bench/host_embedding.py            # writes the section into BENCHMARKS.md
    .venv/bin/python bench/host_embedding.py --quick --no-write
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sixfold.backends.host.host_embedding import HostEmbeddingStage  # noqa: E402
from sixfold.models.dlrm import TableBatchedEmbedding  # noqa: E402
from bench.harness.report import publish  # noqa: E402

SECTION = "host-embedding"
COMMAND = ".venv/bin/python bench/host_embedding.py"


@dataclass(frozen=True)
class Case:
    name: str
    tables: int
    rows: int
    dim: int
    pooling: tuple[int, int]  # ids per bag: uniform in [lo, hi]
    items: int = 270  # MLPerf DLRM's mean query size is ~270 user-item pairs


CASES = (
    Case("rm2", tables=32, rows=50_000, dim=64, pooling=(100, 140)),
    Case("dlrm-mlperf", tables=26, rows=100_000, dim=128, pooling=(1, 1)),
)
VARIANTS = ("raw-kernel", "model-tbe", "fp32", "fp32-per-table", "fp16", "int8", "int4")


def make_requests(case: Case, count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lo, hi = case.pooling
        lengths = rng.integers(lo, hi + 1, (case.items, case.tables)).astype(np.int32)
        ids = rng.integers(0, case.rows, int(lengths.sum()))
        out.append((torch.from_numpy(lengths), torch.from_numpy(ids)))
    return out


def build(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.empty(case.tables * case.rows, case.dim).uniform_(-0.05, 0.05, generator=gen)
    tables = [weight[t * case.rows:(t + 1) * case.rows] for t in range(case.tables)]
    offsets = torch.arange(case.tables, dtype=torch.int64) * case.rows

    def raw_inputs(lengths, ids):
        flat = lengths.reshape(-1).to(torch.int64)
        bag_off = (torch.zeros_like(lengths, dtype=torch.int64) + offsets).reshape(-1)
        rows = ids + torch.repeat_interleave(bag_off, flat, output_size=ids.shape[0])
        return rows, torch.cumsum(flat, 0) - flat

    stages = {
        "fp32": HostEmbeddingStage(tables, "fp32"),
        "fp32-per-table": HostEmbeddingStage(tables, "fp32", layout="per-table"),
        "fp16": HostEmbeddingStage(tables, "fp16"),
        "int8": HostEmbeddingStage(tables, "int8"),
        "int4": HostEmbeddingStage(tables, "int4"),
    }
    # NOTE: the raw kernel reads the fp32 stage's own fused weight, so both touch the same memory
    # (two separate 400 MB buffers differ by ~10% here: page placement, huge pages).
    fused = stages["fp32"].weights()[0]
    model = TableBatchedEmbedding((1,) * case.tables, case.dim, torch.Generator().manual_seed(0))
    model.weight = torch.nn.Parameter(fused, requires_grad=False)  # the same memory again
    model.table_rows = (case.rows,) * case.tables
    model.table_offsets = offsets
    return fused, raw_inputs, stages, model


def bench_case(case: Case, threads: int, runs: int, batches: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(threads)
    weight, raw_inputs, stages, model = build(case)
    requests = make_requests(case, batches, seed=threads)
    raw = [raw_inputs(*r) for r in requests]
    fns = {"raw-kernel": lambda i: F.embedding_bag(raw[i][0], weight, raw[i][1], mode="sum"),
           "model-tbe": lambda i: model(*requests[i])}
    for name, stage in stages.items():
        fns[name] = lambda i, s=stage: s(*requests[i])
    with torch.inference_mode():
        ref = fns["fp32"](0)
        assert torch.equal(ref, fns["raw-kernel"](0)) and torch.equal(ref, fns["fp32-per-table"](0))
        assert torch.equal(ref, fns["model-tbe"](0))
        for name in VARIANTS:  # warm up: page in every weight, size the allocator
            for i in range(batches):
                fns[name](i)
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for r in range(runs):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for name in order:
                t0 = time.perf_counter()
                for i in range(batches):
                    fns[name](i)
                times[name].append((time.perf_counter() - t0) / batches)
    result = {}
    for name in VARIANTS:
        ms = statistics.median(times[name]) * 1e3
        vs_fp32 = statistics.median(a / b for a, b in zip(times[name], times["fp32"]))
        result[name] = {"ms": ms, "items_per_s": case.items / (ms / 1e3), "vs_fp32": vs_fp32}
    result["fp32"]["overhead"] = statistics.median(a / b for a, b in zip(times["fp32"], times["raw-kernel"]))
    result["fp32"]["vs_model"] = statistics.median(a / b for a, b in zip(times["fp32"], times["model-tbe"]))
    result["fp32-per-table"]["overhead"] = statistics.median(
        a / b for a, b in zip(times["fp32-per-table"], times["raw-kernel"]))
    return result


def format_table(results: dict[tuple[str, int], dict[str, dict[str, float]]], runs: int, batches: int) -> str:
    lines = [f"| case | threads | variant | ms / batch (median of {runs}) | items/s | time vs fp32 stage "
             f"| time vs raw kernel | time vs model's module |",
             "|---|---|---|---|---|---|---|---|"]
    for (case, threads), res in results.items():
        for name in VARIANTS:
            r = res[name]
            over = f"{r['overhead']:.3f}" if "overhead" in r else ""
            vs_model = f"{r['vs_model']:.3f}" if "vs_model" in r else ""
            lines.append(f"| {case} | {threads} | {name} | {r['ms']:.2f} | {r['items_per_s']:,.0f} "
                         f"| {r['vs_fp32']:.3f} | {over} | {vs_model} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per variant (median reported)")
    parser.add_argument("--batches", type=int, default=3, help="batches per variant per run")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--quick", action="store_true", help="5 runs of 1 batch (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if args.quick:
        args.runs, args.batches = 5, 1
    t0 = time.perf_counter()
    results = {}
    for case in CASES:
        for threads in args.threads:
            results[(case.name, threads)] = bench_case(case, threads, args.runs, args.batches)
            print(f"  {case.name} threads={threads} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    table = format_table(results, args.runs, args.batches)
    cmd = COMMAND + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip()
    machine = (f"{platform.machine()}, {torch.get_num_threads() and __import__('os').cpu_count()} CPUs, "
               f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    text = (f"## Host embedding stage\n\n"
            f"Command: `{cmd.strip()}` ({time.perf_counter() - t0:.0f} s; {machine}).\n"
            f"Each run times {args.batches} batch(es) of 270 items per variant, variants interleaved; "
            f"figures are medians over {args.runs} runs, ratios are medians of per-run ratios.\n\n"
            f"{table}\n")
    publish(SECTION, text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
