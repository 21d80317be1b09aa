"""``sixfold-partition tiers``: price a plan's table tiers, or measure a disk for the price.

The model itself is ``tiers``; this is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sixfold.partitioner.plan import PartitionPlan
from sixfold.partitioner.pricing.tiers import measure_disk, print_plan_tiers

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        p = argparse.ArgumentParser(prog="sixfold-partition tiers calibrate")
        p.add_argument("--dir", default=".", help="a folder on the disk that will hold the tables")
        p.add_argument("--seconds", type=float, default=4.0)
        p.add_argument("--depth", type=int, default=32, help="concurrent readers (the store's io threads)")
        p.add_argument("--out", type=Path, default=None)
        args = p.parse_args(argv[1:])
        spec = measure_disk(args.dir, seconds=args.seconds, depth=args.depth)
        if args.out:
            args.out.write_text(spec.to_json() + "\n")
        print(spec.to_json())
        return 0
    p = argparse.ArgumentParser(prog="sixfold-partition tiers", description="print a plan's table tier table")
    p.add_argument("plan", help="plan.json of a table-batched model")
    p.add_argument("--disk-spec", default=None, help="JSON from `calibrate` (default: a generic NVMe SSD)")
    p.add_argument("--zipf", type=float, default=None, help="id skew (default: the plan's, else 1.05)")
    p.add_argument("--items", type=int, default=None, help="items per batch (default: the plan's batch rows)")
    p.add_argument("--table-memory", action="append", default=[], help="budgets to price (default 5/10/25/100%%)")
    args = p.parse_args(argv)
    print_plan_tiers(PartitionPlan.load(args.plan), args.table_memory or ["5%", "10%", "25%", "100%"],
                     disk_spec=args.disk_spec, zipf=args.zipf, items=args.items)
    return 0


if __name__ == "__main__":
    sys.exit(main())
