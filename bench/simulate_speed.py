"""How much faster than real time does sixfold-simulate run? One minute of 10k queries/s on 6 cards.

The platform: dlrm-mlperf on 6 x gpu-l4 with the generic ``host-cpu`` host (so 10k q/s is served,
not refused), sixfold-serve's default scheduling. Traffic: Poisson at 10,000 q/s for 60 virtual
seconds (+1 s warm-up), MLPerf query sizes (100..700 items: batches of ~3 queries, most split over
cards) and, as a second case, 16-item queries (many queries a batch, no splitting). Wall and CPU
time of the whole simulation (planning excluded: it is done once, before), the median of
``--runs``; the machine is shared, so the load average is reported beside them. ``--jobs 2``
simulates the window as two segments in two processes (CPU is the parent's alone there).

    .venv/bin/python bench/simulate_speed.py [--runs 3] [--seconds 60] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness.report import machine_line, publish  # noqa: E402
from sixfold.simulate import ServingSettings, build_platform, parse_traffic, simulate  # noqa: E402

SECTION = "simulate-speed"
COMMAND = ".venv/bin/python bench/simulate_speed.py"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--qps", type=float, default=10_000.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.runs, args.seconds = 1, 3.0
    platform = build_platform("dlrm-mlperf", cards=6, card_spec="gpu-l4", host_spec="host-cpu")
    load0 = os.getloadavg()[0]
    rows = []
    for sizes, jobs in (("mlperf", 1), ("mlperf", 2), ("fixed:16", 1)):
        traffic = parse_traffic("poisson", sizes)
        arrivals = traffic.draw(args.qps, args.seconds + 1.0, platform.ids_per_item, seed=0)
        walls, cpus, loads = [], [], []
        result = None
        for _ in range(args.runs):
            loads.append(os.getloadavg()[0])
            w, c = time.perf_counter(), time.process_time()
            result = simulate(platform, arrivals, settings=ServingSettings(), warmup_s=1.0, jobs=jobs)
            walls.append(time.perf_counter() - w)
            cpus.append(time.process_time() - c)
            print(f"{sizes} x{jobs}: wall {walls[-1]:.1f} s, cpu {cpus[-1]:.1f} s", file=sys.stderr)
        assert result is not None
        wall, cpu = statistics.median(walls), statistics.median(cpus)
        rows.append(f"| {sizes} | {jobs} | {len(arrivals):,} | {result.batches:,} | {result.card_batches:,} | "
                    f"{result.events:,} | {wall:.1f} ({min(walls):.1f}-{max(walls):.1f}) | {cpu:.1f} | "
                    f"{(args.seconds + 1) / wall:.2f}x | {cpu / len(arrivals) * 1e6:.0f} | "
                    f"{result.latency_ms['p50']:.2f} / {result.latency_ms['p99']:.2f} | "
                    f"{statistics.median(loads):.1f} |")
    text = "\n".join([
        "## Simulator speed (one minute of 10k queries/s on 6 cards)",
        "",
        f"Command: `{COMMAND} {' '.join(sys.argv[1:])}` ({machine_line(f'load average {load0:.1f} at start')}).",
        f"Platform: {platform.describe()}; sixfold-serve's default scheduling. Traffic: Poisson, "
        f"{args.qps:,.0f} q/s, {args.seconds:g} virtual s + 1 s warm-up. Median of {args.runs} run(s) "
        "(range in brackets); planning excluded.",
        "",
        "| query sizes | --jobs | requests | batches | card batches | loop callbacks | wall s | CPU s | faster than real time "
        "| CPU us / request | simulated p50 / p99 ms | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
    publish(SECTION, text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
