"""Several simulated cards on one functional session or one each: the dense partition's items/s.

Six simulated cards are six threads on the host running the same dense partition. With one
onnxruntime session each (``simcard share_functional=false``) every thread streams its own copy of
the weights through the caches; with one shared session (the default) they read one copy. This
runs the model's real dense partition on its real host-stage outputs, from ``threads`` threads in a
loop for ``--seconds``, against ``sessions`` sessions (1 intra-op thread each, as simcard's):

    .venv/bin/python bench/shared_session.py                       # dlrm-mlperf, 64 and 117 rows
    .venv/bin/python bench/shared_session.py --model rm2 --rows 256 --json runs/shared_session.json

Prints a markdown table (items/s per rows and threads x sessions) with the load average; writes
nothing into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sixfold import models  # noqa: E402
from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend  # noqa: E402
from sixfold.backends.spec_catalog import load_spec  # noqa: E402
from bench.harness.report import machine_line  # noqa: E402
from sixfold.partitioner.compile import partition_builtin  # noqa: E402
from sixfold.server.loading.loader import load_host_stage  # noqa: E402

SHAPES = ((1, 1), (2, 1), (6, 6), (6, 1))
"""(threads, sessions): one card alone, two on one session, six cards as before, six on one session."""


def items_per_s(executables: list, threads: int, feed: dict, rows: int, seconds: float) -> float:
    """Items/s of ``threads`` threads calling ``run`` in a loop, thread i on executable i % len."""
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        executable = executables[i % len(executables)]
        while time.perf_counter() < stop:
            executable.run(feed)
            counts[i] += 1

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return sum(counts) * rows / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dlrm-mlperf")
    p.add_argument("--max-rows", type=int, default=50_000, help="rows per table at most (default 50000)")
    p.add_argument("--rows", default="64,117", help="rows per call, comma-separated (default 64,117: a "
                   "270- and a 700-item query split over 6 cards are 45 and 117)")
    p.add_argument("--seconds", type=float, default=2.0, help="seconds per cell (default 2)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",") if r]

    _, partitioned = partition_builtin(args.model, max_rows=args.max_rows, seed=0, cards=6)
    host_spec = load_spec("host-cpu")
    host = load_host_stage(partitioned, host_spec)
    backend = OnnxRuntimeBackend(intra_op_threads=1)
    sessions = [backend.load(partitioned.artifact_for("dense", backend), host_spec) for _ in range(6)]
    generator = models.RequestGenerator.for_config(models.get_config(args.model, max_rows=args.max_rows), seed=1)
    load = [os.getloadavg()[0]]
    results: dict[int, dict[str, float]] = {}
    for rows in rows_list:
        request = generator.make(rows)
        feed = {**request, **host.run({k: request[k] for k in host.input_names})}
        for threads, count in SHAPES:
            rate = items_per_s(sessions[:count], threads, feed, rows, args.seconds)
            results.setdefault(rows, {})[f"{threads}x{count}"] = round(rate)
            print(f"{rows} rows, {threads} threads on {count} session(s): {rate:,.0f} items/s", file=sys.stderr)
    load.append(os.getloadavg()[0])
    for s in sessions:
        s.close()
    host.close()

    print(f"{args.model} dense partition, 1 intra-op thread per session, {args.seconds:g} s a cell "
          f"({machine_line(f'load average {load[0]:.1f} -> {load[1]:.1f}')}):\n")
    print("| rows per call | " + " | ".join(f"{t} thread(s), {c} session(s)" for t, c in SHAPES) + " |")
    print("|---|" + "---|" * len(SHAPES))
    for rows, cells in results.items():
        print(f"| {rows} | " + " | ".join(f"{cells[f'{t}x{c}']:,} items/s" for t, c in SHAPES) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "seconds": args.seconds, "load": load,
                                               "items_per_s": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
