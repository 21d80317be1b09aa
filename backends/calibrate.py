"""Measure this host and write it as a DeviceSpec (``kind="host"``), for the cost model.

Three measurements, each best-of within its share of ``seconds_budget``:

- fp32 matmul FLOP/s: ``torch.mm`` on square matrices at a few sizes;
- memory bandwidth: copying a large array (bytes read + bytes written per second);
- random-gather bandwidth: ``F.embedding_bag`` over random rows of a large table, the
  access pattern of embedding lookups (bytes of rows read per second). It goes into
  ``description`` and the returned ``measured`` dict; the spec's ``memory_bandwidth``
  stays the streaming figure, since that is what the roofline model expects.

Usage (the CLI the partitioner wires as ``sixfold-partition calibrate``)::

    python -m backends.calibrate --seconds 10 --out host.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .spec import DeviceSpec

__all__ = ["calibrate_host", "measure_host", "main"]


def _best_rate(work: float, fn: Callable[[], Any], deadline: float, min_runs: int = 2) -> float:
    """``work`` / best wall time of ``fn`` over runs until ``deadline`` (at least ``min_runs``)."""
    best = float("inf")
    runs = 0
    while runs < min_runs or time.perf_counter() < deadline:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return work / best


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 << 30


def measure_host(seconds_budget: float = 10.0, threads: int | None = None) -> dict[str, float]:
    """Raw measurements: ``fp32_flops``, ``memory_bandwidth``, ``gather_bandwidth`` (per second).

    Sizes shrink with the budget, so a tiny budget (tests) finishes in about that time.
    """
    import torch
    from torch.nn import functional as F

    if seconds_budget <= 0:
        raise ValueError(f"seconds_budget must be > 0, got {seconds_budget}")
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    small = seconds_budget < 2
    share = seconds_budget / 3
    out: dict[str, float] = {}
    try:
        with torch.inference_mode():
            # fp32 matmul: best over sizes (small ones are cache-bound, large ones compute-bound).
            sizes = (128, 256) if small else (256, 512, 1024)
            deadline = time.perf_counter() + share
            best = 0.0
            for i, n in enumerate(sizes):
                a, b = torch.randn(n, n), torch.randn(n, n)
                c = torch.empty(n, n)
                size_deadline = time.perf_counter() + (deadline - time.perf_counter()) / (len(sizes) - i)
                best = max(best, _best_rate(2.0 * n ** 3, lambda: torch.mm(a, b, out=c), size_deadline))
            out["fp32_flops"] = best

            # Streaming bandwidth: copy 64 MiB (16 MiB with a tiny budget): read + write.
            count = (16 << 20 if small else 64 << 20) // 4
            src, dst = torch.ones(count), torch.empty(count)
            dst.copy_(src)
            out["memory_bandwidth"] = _best_rate(2.0 * src.nbytes, lambda: dst.copy_(src),
                                                 time.perf_counter() + share)

            # Random gather: rows of a table larger than the last-level cache, 64 fp32 per row.
            rows, dim = (100_000 if small else 1_000_000), 64
            table = torch.randn(rows, dim)
            ids = torch.randint(0, rows, (200_000 if small else 1_000_000,))
            offsets = torch.arange(0, ids.shape[0], 100)
            out["gather_bandwidth"] = _best_rate(
                float(ids.shape[0] * dim * 4),
                lambda: F.embedding_bag(ids, table, offsets, mode="sum"), time.perf_counter() + share)
    finally:
        torch.set_num_threads(previous)
    out["threads"] = float(threads if threads is not None else previous)
    return out


def calibrate_host(seconds_budget: float = 10.0, *, threads: int | None = None, name: str = "host-calibrated",
                   efficiency: float = 0.5) -> DeviceSpec:
    """This host as a DeviceSpec: measured fp32 FLOP/s (fp16 and int8 assumed equal: no faster
    host kernels are used) and streaming memory bandwidth; physical memory; no link.

    ``peak_flops`` holds the *measured* best, so ``efficiency`` scales it down for real batches.
    """
    m = measure_host(seconds_budget, threads)
    flops = m["fp32_flops"]
    desc = (f"measured by backends.calibrate on {os.cpu_count()} CPUs, {int(m['threads'])} torch thread(s): "
            f"fp32 mm {flops / 1e9:.1f} GFLOP/s, copy {m['memory_bandwidth'] / 1e9:.1f} GB/s, "
            f"random row gather {m['gather_bandwidth'] / 1e9:.1f} GB/s")
    return DeviceSpec(name=name, memory_bytes=_host_memory_bytes(),
                      peak_flops={"fp32": flops, "fp16": flops, "int8": flops},
                      memory_bandwidth=m["memory_bandwidth"], link_bandwidth=0, link_latency_s=0.0,
                      efficiency=efficiency, kind="host", description=desc)


def main(argv: Sequence[str] | None = None) -> int:
    """``calibrate [--seconds S] [--threads N] [--name NAME] [--out FILE]``: print (or write) the spec as JSON."""
    parser = argparse.ArgumentParser(prog="sixfold-partition calibrate",
                                     description="Measure this host and print it as a device spec (JSON).")
    parser.add_argument("--seconds", type=float, default=10.0, help="time budget for all measurements")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--name", default="host-calibrated", help="the spec's name")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds must be > 0, got {args.seconds}")
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
