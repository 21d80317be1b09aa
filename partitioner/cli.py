"""sixfold-partition: cut a model into host + dense partitions, place them, write and explain the plan.

`sixfold-partition calibrate [--out host.json]` measures this host and writes a device spec.
`sixfold-partition show PLAN` prints a saved plan (plan.json or its version folder), tier table included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from sixfold import models

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sixfold-partition", description=__doc__)
    p.add_argument("model_file", nargs="?", help="a torch.export archive (.pt2) or an ONNX model (.onnx) "
                   "taking the canonical request (dense_features, sparse_lengths, sparse_indices); in ONNX, "
                   "lookups are Gather nodes on 2-D initializers (the tables)")
    p.add_argument("--model", help=f"a built-in model instead of a file: {', '.join(models.names())}")
    p.add_argument("--name", help="model name in the plan (default: the file's stem)")
    p.add_argument("--pooling", type=int, default=None, help="ids per (item, table) to trace a file model with "
                   "(default: 1 for .pt2; for .onnx, the first the model runs with)")
    p.add_argument("--max-rows", type=int, default=None, help="cap every embedding table at R rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cards", type=int, default=6, help="number of accelerator cards (default 6)")
    p.add_argument("--card-spec", default="m2-card", help="device spec name or JSON file for the cards")
    p.add_argument("--host-spec", default="host-cpu", help="device spec name or JSON file for the host")
    p.add_argument("--table-precision", default="fp32", choices=["fp32", "fp16", "int8", "int4"],
                   help="row-wise precision of the embedding tables: every lookup the partitioner recognises, "
                   "built-in or file model (ONNX: fp16 or int8)")
    p.add_argument("--batch-rows", type=int, default=256, help="batch size the estimates are for")
    p.add_argument("--strategy", default="auto", choices=["auto", "replicate", "pipeline"],
                   help="dense placement: replicate on every card, pipeline in stages across cards, or auto "
                   "(replicate when the dense part fits a card, else pipeline)")
    p.add_argument("--stages", type=int, default=None, help="pipeline stage count for --strategy pipeline "
                   "(default: the count with the highest throughput bound)")
    p.add_argument("--dense-precision", default="fp32", choices=["fp32", "fp16", "int8"],
                   help="weights and compute of the dense (card) partition; its inputs/outputs stay fp32")
    p.add_argument("--accuracy-report", action="store_true",
                   help="score synthetic labelled items through fp32 and the chosen precisions; "
                   "print it and write OUT/accuracy.json")
    p.add_argument("--accuracy-items", type=int, default=4096, help="items the accuracy report scores")
    p.add_argument("--sparse-on-cards", choices=["table", "row", "column", "auto"], default=None,
                   help="also place embedding tables on the cards as table-, row- or column-wise shards "
                   "balanced by lookup cost (auto: the lowest bottleneck); what does not fit stays on the host")
    p.add_argument("--draw", metavar="PNG", help="also draw the graph with partitions coloured, and the devices: "
                   "what each card holds (dense replicas, pipeline stages, table shards)")
    p.add_argument("--measure", action="store_true", help="calibrate this host, then time each stage of the plan "
                   "on it and print estimate vs measured (writes OUT/measure.json)")
    p.add_argument("--measure-seconds", type=float, default=3.0, help="calibration budget for --measure")
    p.add_argument("--table-memory", action="append", default=[], metavar="BYTES",
                   help="also price the table tiers: the row cache's hit rate, disk reads and host time per batch "
                        "at this table memory (512MiB, 4GiB, 10%%; repeat for several); printed with the plan and "
                        "stored in plan.json")
    p.add_argument("--disk-spec", default=None, help="disk JSON for the tier table (sixfold-partition calibrate "
                                                     "--disk DIR); default: a generic NVMe SSD")
    p.add_argument("--zipf", type=float, default=None, help="id skew for the tier table (default: the model's)")
    p.add_argument("--out", help="output folder (a model-repository version folder); required unless --plan-only")
    p.add_argument("--plan-only", action="store_true",
                   help="plan and explain, but compile no artifacts (no ONNX export); with --out, write plan.json only")
    return p


def _replan(args: argparse.Namespace, plan, host, card):
    """The same model and choices planned for other specs (``--measure``'s estimate), same dense stages."""
    from sixfold.partitioner.compile import partition_builtin, partition_file
    from sixfold.partitioner.precision.dense import apply_dense_precision
    stages = len(plan.dense_stages()) if plan.strategy == "pipeline" else None
    common = dict(cards=1 if stages is None else stages, card_spec=card, host_spec=host, batch_rows=args.batch_rows,
                  table_precision=args.table_precision, strategy=plan.strategy, stages=stages,
                  compile=args.dense_precision != "fp32")
    if args.model:
        _, replanned = partition_builtin(args.model, max_rows=args.max_rows, seed=args.seed, **common)
    else:
        replanned = partition_file(args.model_file, name=args.name, pooling=args.pooling, **common)
    apply_dense_precision(replanned, args.dense_precision)
    return replanned


def _take_disk_options(argv: list[str]) -> tuple[list[str], str | None, str]:
    rest, disk, out = [], None, "disk.json"
    it = iter(argv)
    for a in it:
        if a == "--disk":
            disk = next(it, None)
        elif a == "--disk-out":
            out = next(it, out)
        else:
            rest.append(a)
    return rest, disk, out


def _show(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="sixfold-partition show", description="print a saved plan: what runs where, "
                                "the estimates and, when it was priced with --table-memory, its table tiers")
    p.add_argument("plan", help="a plan.json, or the model-repository version folder holding one")
    args = p.parse_args(argv)
    from sixfold.partitioner.report.explain import print_plan
    from sixfold.partitioner.plan import PartitionPlan
    path = Path(args.plan)
    if path.is_dir():
        path = path / "plan.json"
    try:
        plan = PartitionPlan.load(path)
    except FileNotFoundError:
        print(f"sixfold-partition show: no plan at {str(path)!r}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, ValueError) as exc:
        print(f"sixfold-partition show: {str(path)!r} is not a readable plan: {exc}", file=sys.stderr)
        return 2
    print_plan(plan, Console(stderr=False, width=None if sys.stdout.isatty() else 120))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"]:
        # Measure this host (FLOP/s, memory and gather bandwidth) and write a device spec;
        # --disk DIR also measures the disk under DIR for the table tiers (--disk-out FILE, default disk.json).
        from sixfold.backends.host.calibrate import main as calibrate
        rest, disk, disk_out = _take_disk_options(argv[1:])
        code = calibrate(rest)
        if code == 0 and disk:
            from sixfold.partitioner.pricing.tiers import measure_disk
            spec = measure_disk(disk)
            Path(disk_out).write_text(spec.to_json() + "\n")
            print(f"disk under {disk}: {spec.iops:,.0f} random 4 KiB reads/s at {spec.depth} readers, "
                  f"{spec.read_latency_s * 1e6:.0f} us at one; wrote {disk_out}", file=sys.stderr)
        return code
    if argv[:1] == ["tables"]:  # build a model's tables to disk in chunks, or import a user's (table_build)
        from sixfold.partitioner.tables.build import main as tables
        return tables(argv[1:])
    if argv[:1] == ["tiers"]:  # price a plan's table tiers, or measure a disk (sixfold.partitioner.pricing.tiers_cli)
        from sixfold.partitioner.pricing.tiers_cli import main as tiers
        return tiers(argv[1:])
    if argv[:1] == ["show"]:  # print a saved plan, its stored tier table included
        return _show(argv[1:])
    args = _parser().parse_args(argv)
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 120)  # plans are wide
    err = Console(stderr=True)
    from sixfold.partitioner.artifacts import write_artifacts
    from sixfold.partitioner.compile import partition_builtin, partition_file
    from sixfold.partitioner.partitioned import HOST_PARTITION
    from sixfold.partitioner.report.explain import print_plan
    if bool(args.model) == bool(args.model_file):
        err.print("sixfold-partition: give either MODEL_FILE or --model NAME")
        return 2
    if not args.out and not args.plan_only:
        err.print("sixfold-partition: --out DIR is required (or --plan-only)")
        return 2
    if args.plan_only and (args.accuracy_report or args.dense_precision != "fp32" or args.measure):
        err.print("sixfold-partition: --plan-only compiles nothing, so it takes no --accuracy-report, "
                  "--measure or --dense-precision")
        return 2
    if args.stages is not None and args.strategy != "pipeline":
        err.print(f"sixfold-partition: --stages {args.stages} needs --strategy pipeline")
        return 2
    try:
        with console.status(f"exporting and partitioning {args.model or args.model_file}..."):
            if args.model:
                _, partitioned = partition_builtin(
                    args.model, max_rows=args.max_rows, seed=args.seed, cards=args.cards,
                    card_spec=args.card_spec, host_spec=args.host_spec, batch_rows=args.batch_rows,
                    table_precision=args.table_precision, strategy=args.strategy, compile=not args.plan_only,
                    stages=args.stages)
            else:
                partitioned = partition_file(
                    args.model_file, name=args.name, cards=args.cards, card_spec=args.card_spec,
                    host_spec=args.host_spec, pooling=args.pooling, batch_rows=args.batch_rows,
                    strategy=args.strategy, compile=not args.plan_only, table_precision=args.table_precision,
                    stages=args.stages)
            reference = None
            if args.accuracy_report:
                from sixfold.partitioner.precision.accuracy import reference_artifacts
                reference = reference_artifacts(partitioned)
            from sixfold.partitioner.precision.dense import apply_dense_precision
            apply_dense_precision(partitioned, args.dense_precision)
            if args.sparse_on_cards:
                from sixfold.partitioner.placement.sharding import shard_tables
                shard_tables(partitioned, args.sparse_on_cards)
            if args.table_memory:
                if not partitioned.plan.tables.get("rows"):
                    raise ValueError(f"--table-memory: {partitioned.plan.model}'s lookups are not table-batched "
                                     "(no table rows in its plan): it has no table tiers to price")
                from sixfold.partitioner.pricing.tiers import price_plan_tiers
                partitioned.plan.tiers = price_plan_tiers(partitioned.plan, args.table_memory,
                                                          disk_spec=args.disk_spec, zipf=args.zipf)
            if args.plan_only:
                path = None
                if args.out:
                    Path(args.out).mkdir(parents=True, exist_ok=True)
                    path = Path(args.out) / "plan.json"
                    partitioned.plan.save(path)
            else:
                path = write_artifacts(partitioned, args.out)
        if reference is not None:
            from sixfold.partitioner.precision.accuracy import accuracy_report, print_accuracy
            with console.status(f"scoring {args.accuracy_items} items for the accuracy report..."):
                report = accuracy_report(reference, partitioned, partitioned.plan, items=args.accuracy_items,
                                         seed=args.seed + 1)
        measured = None
        if args.measure:
            from sixfold.partitioner.pricing.measure import measure_plan
            with console.status("calibrating this host and timing each stage of the plan...") as status:
                host_info = partitioned.plan.partition(HOST_PARTITION)
                tables_dir = path.parent / host_info.artifact if host_info.format == "tables" else None
                measured = measure_plan(partitioned, lambda host, card: _replan(args, partitioned.plan, host, card),
                                        calibrate_seconds=args.measure_seconds, seed=args.seed + 7,
                                        tables_dir=tables_dir, progress=lambda line: (
                                            status.update(f"warming: {line}") if console.is_terminal
                                            else err.print(f"warming: {line}", highlight=False, soft_wrap=True)))
    except (KeyError, ValueError, MemoryError, FileNotFoundError, RuntimeError) as exc:
        err.print(f"[red]sixfold-partition: {exc.args[0] if exc.args else exc}[/]")
        return 2
    print_plan(partitioned.plan, console)
    if reference is not None:
        print_accuracy(report, console)
        console.print(f"wrote {report.save(path.parent / 'accuracy.json')}")
    if measured is not None:
        from sixfold.partitioner.pricing.measure import print_measure
        print_measure(measured, console)
        console.print(f"wrote {measured.save(path.parent / 'measure.json')}"
                      + (" (table shards on cards not measured)" if args.sparse_on_cards else ""))
    if args.draw:
        from sixfold.partitioner.report.draw import draw_partitioned
        plan = partitioned.plan
        drawn = draw_partitioned(partitioned, args.draw,
                                 title=f"{plan.model}: host (sparse) vs cards (dense), {plan.strategy}")
        console.print(f"drew {drawn}")
    if args.plan_only:
        console.print(f"wrote {path} (plan only)" if path else "plan only: nothing written")
        return 0
    onnx = ", ".join(f"{d}.onnx" for d in partitioned.plan.dense_stages())
    console.print(f"wrote {path.parent}/ (plan.json, {onnx}, {partitioned.plan.partition(HOST_PARTITION).artifact})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
