"""sixfold-partition: cut a model into host + dense partitions, place them, write and explain the plan.

  sixfold-partition MODEL_FILE | --model NAME --out DIR   partition a model (the flags below)
  sixfold-partition calibrate [--out host.json] [--disk DIR]  measure this host (and a disk) as a device spec
  sixfold-partition calibrate --card --backend NAME [--out card.json]  measure a card through its backend
  sixfold-partition show PLAN                        print a saved plan (plan.json or its folder), tiers included
  sixfold-partition tables build|import ...          write a model's tables to disk in chunks, or import a user's
  sixfold-partition tiers PLAN [--table-memory B]    price a plan's table tiers (row cache, disk reads)
  sixfold-partition tiers calibrate --dir DIR        measure the disk under DIR for the tier prices

Each subcommand has its own --help.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from sixfold import models

__all__ = ["main", "UsageError", "OneLineParser", "DefaultsHelpFormatter", "error_text", "os_error_text",
           "check_input_file", "check_input_dir", "check_output_file", "check_output_dir", "read_token_file"]


# What the sixfold commands share for their users' mistakes (sixfold-serve, -delta and -simulate import it):
# each is one line naming the flag or file, why, and what to give instead; never a traceback or a bare errno.

class UsageError(ValueError):
    """A mistake in what the user gave (a flag, a file); the message names it and the fix."""


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help with each option's default, where its help does not say it already (and it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (action.option_strings and default is not None and default is not False and default != []
                and default is not argparse.SUPPRESS and "default" not in text):
            text += " (default %(default)s)"
        return text


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``PROG: error: ...; see PROG --help``), not the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def os_error_text(exc: OSError) -> str:
    """One line for an OSError: the file or address it concerns and why, never a bare errno."""
    if exc.strerror is None:  # raised with a message (ours, or a library's)
        return str(exc) or type(exc).__name__
    if exc.filename is not None:
        where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 is not None else str(exc.filename)
        return f"{where}: {exc.strerror}"
    return exc.strerror


def error_text(exc: BaseException) -> str:
    """One line for an exception a command reports: OSError as ``os_error_text``, KeyError without quotes."""
    if isinstance(exc, OSError):
        return os_error_text(exc)
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return " ".join(str(exc).split()) or type(exc).__name__


def check_input_file(path: str | Path, flag: str, what: str) -> Path:
    """``path`` is a readable file; UsageError (``FLAG PATH: why; give WHAT``) otherwise."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such file; give {what}")
    if p.is_dir():
        raise UsageError(f"{flag} {path}: a folder, not a file; give {what}")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{flag} {path}: this user cannot read it; give {what} it can read")
    return p


def read_token_file(path: str, flag: str) -> str:
    """The first line of ``path``, stripped; UsageError naming the flag if it is missing, unreadable or empty."""
    what = "a file whose first line is the token"
    check_input_file(path, flag, what)
    try:
        with open(path, encoding="utf-8") as f:
            token = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag} {path}: could not read it ({error_text(exc)}); give {what}") from None
    if not token:
        raise UsageError(f"{flag} {path}: its first line is empty; give {what}")
    return token


def check_input_dir(path: str | Path, flag: str, what: str) -> Path:
    """``path`` is a folder this user can read; UsageError otherwise."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: no such folder; give {what}")
    if not p.is_dir():
        raise UsageError(f"{flag} {path}: a file, not a folder; give {what}")
    if not os.access(p, os.R_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: this user cannot read it; give {what} it can read")
    return p


def _writable_ancestor(p: Path, flag: str, path: str | Path) -> None:
    """The nearest existing folder above ``p`` takes new entries (``p``'s missing parents are made there)."""
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is a file, not a folder; give a path in a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: this user cannot write in {parent}; give a path in a folder it can write")


def check_output_file(path: str | Path, flag: str) -> Path:
    """A file can be written at ``path`` (its missing folders made): checked before the work that writes it."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: a folder; give a file path")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise UsageError(f"{flag} {path}: this user cannot overwrite it; give another path")
        return p
    _writable_ancestor(p, flag, path)
    return p


def check_output_dir(path: str | Path, flag: str) -> Path:
    """A folder can be written at ``path`` (made when missing): checked before the work that writes it."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise UsageError(f"{flag} {path}: a file, not a folder; give a folder path")
        if not os.access(p, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: this user cannot write in it; give a folder it can write")
        return p
    _writable_ancestor(p, flag, path)
    return p


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="sixfold-partition", description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("model_file", nargs="?", help="a torch.export archive (.pt2) or an ONNX model (.onnx) "
                   "taking the canonical request (dense_features, sparse_lengths, sparse_indices); in ONNX, "
                   "lookups are Gather nodes on 2-D initializers (the tables)")
    p.add_argument("--model", help=f"a built-in model instead of a file: {', '.join(models.names())}")
    p.add_argument("--name", help="model name in the plan (default: the file's stem)")
    p.add_argument("--pooling", type=int, default=None, help="ids per (item, table) to trace a file model with "
                   "(default: 1 for .pt2; for .onnx, the first the model runs with)")
    p.add_argument("--max-rows", type=int, default=None, help="cap every embedding table at R rows")
    p.add_argument("--seed", type=int, default=0, help="seed of a built-in model's synthetic weights")
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
    p = OneLineParser(prog="sixfold-partition show", description="print a saved plan: what runs where, "
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
        print(f"sixfold-partition show: no plan at {str(path)!r}; give a plan.json or the version folder "
              "sixfold-partition --out wrote", file=sys.stderr)
        return 2
    except (OSError, KeyError, TypeError, ValueError) as exc:
        print(f"sixfold-partition show: {str(path)!r} is not a readable plan: {error_text(exc)}", file=sys.stderr)
        return 2
    print_plan(plan, Console(stderr=False, width=None if sys.stdout.isatty() else 120))
    return 0


def _option(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in ``argv`` (``--flag V`` or ``--flag=V``; the last one), else None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value


def _check_calibrate(rest: list[str], disk: str | None, disk_out: str) -> None:
    """calibrate's paths, before it measures for seconds: where it writes, and the disk folder it measures."""
    out = _option(rest, "--out")
    if out:
        check_output_file(out, "--out")
    if disk:
        check_input_dir(disk, "--disk", "a folder on the disk to measure (a file is written and read there)")
        if not os.access(disk, os.W_OK):
            raise UsageError(f"--disk {disk}: this user cannot write in it; the disk is measured through a file "
                             "written there")
        check_output_file(disk_out, "--disk-out")


def _positionals(argv: list[str], takes_value: set[str]) -> list[str]:
    """The arguments of ``argv`` that are not options or option values (``takes_value``: options with one)."""
    found, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in takes_value:
            skip = True
        elif not a.startswith("-"):
            found.append(a)
    return found


def _check_tiers(argv: list[str]) -> None:
    """tiers' files, named, before it prices or measures."""
    if argv[:1] == ["calibrate"]:
        if directory := _option(argv, "--dir"):
            check_input_dir(directory, "--dir", "a folder on the disk to measure")
        if out := _option(argv, "--out"):
            check_output_file(out, "--out")
        return
    plans = _positionals(argv, {"--disk-spec", "--zipf", "--items", "--table-memory"})
    if plans:
        from sixfold.partitioner.plan import PartitionPlan
        path = plans[0]
        check_input_file(path, "PLAN", "a plan.json (sixfold-partition --out writes one)")
        try:
            PartitionPlan.load(path)
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"PLAN {path}: not a readable plan ({error_text(exc)}); give a plan.json "
                             "sixfold-partition --out wrote") from None
    if disk := _option(argv, "--disk-spec"):
        check_input_file(disk, "--disk-spec", "a disk JSON written by sixfold-partition calibrate --disk")


def _check_tables(argv: list[str]) -> None:
    """tables' folders, named, before it builds or imports (minutes for a large model)."""
    if out := _option(argv, "--out"):
        check_output_dir(out, "--out")
    if argv[:1] == ["import"]:
        sources = _positionals(argv[1:], {"--out", "--keys", "--table-precision"})
        if sources and not Path(sources[0]).exists():
            raise UsageError(f"SOURCE {sources[0]}: no such file or folder; give a state dict (torch.save) or a "
                             "folder of .npy tables")


def _subcommand(name: str, run, argv: list[str], check=None) -> int:
    """A subcommand whose mistakes (a missing file, a bad value) are one line, not a traceback; ``check``
    looks at its files first."""
    try:
        if check is not None and "-h" not in argv and "--help" not in argv:
            check(argv)
        return run(argv)
    except (UsageError, OSError, KeyError, ValueError, RuntimeError) as exc:
        print(f"sixfold-partition {name}: {error_text(exc)}", file=sys.stderr)
        return 2


def _check_args(args: argparse.Namespace) -> None:
    """What can be checked in a moment, before exporting and partitioning (which take seconds to minutes)."""
    if args.model and args.model not in models.names():
        raise UsageError(f"--model {args.model}: unknown model {args.model!r}; built-in models: "
                         f"{', '.join(models.names())} (or give a model file)")
    if args.model_file:
        check_input_file(args.model_file, "MODEL_FILE", "a torch.export archive (.pt2) or an ONNX model (.onnx)")
        if Path(args.model_file).suffix not in (".pt2", ".onnx"):
            raise UsageError(f"MODEL_FILE {args.model_file}: give a torch.export archive (.pt2) or an ONNX model "
                             "(.onnx), named so")
    for flag, value in (("--card-spec", args.card_spec), ("--host-spec", args.host_spec)):
        check_spec(value, flag)
    if args.disk_spec:
        from sixfold.partitioner.pricing.tiers import DiskSpec
        check_input_file(args.disk_spec, "--disk-spec", "a disk JSON written by sixfold-partition calibrate --disk")
        try:
            DiskSpec.load(args.disk_spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise UsageError(f"--disk-spec {args.disk_spec}: not a disk spec ({error_text(exc)}); give the JSON "
                             "sixfold-partition calibrate --disk DIR wrote") from None
    from sixfold.backends.host.table_store import parse_table_memory
    for text in args.table_memory:
        try:
            if parse_table_memory(text) is None:
                raise ValueError("empty")
        except ValueError as exc:
            raise UsageError(f"--table-memory {text!r}: {error_text(exc)}; give a size such as 4GiB or a share "
                             "such as 10%") from None
    if args.out:
        check_output_dir(args.out, "--out")
    if args.draw:
        check_output_file(args.draw, "--draw")


def check_spec(value: str | None, flag: str) -> None:
    """A device spec name or JSON file, read now (``auto`` is measured later): UsageError naming ``flag``."""
    if value is None or value == "auto":
        return
    from sixfold.backends.spec_catalog import SpecConflict, UnknownSpec, load_spec
    try:
        load_spec(value)
    except (UnknownSpec, SpecConflict) as exc:  # their messages list the names there are
        raise UsageError(f"{flag}: {error_text(exc)}") from None
    except FileNotFoundError as exc:
        raise UsageError(f"{flag} {value}: {error_text(exc)}; give a spec name (sixfold-serve --list-specs) "
                         "or a JSON file such as sixfold-partition calibrate --out writes") from None
    except (KeyError, TypeError, ValueError, OSError) as exc:
        raise UsageError(f"{flag} {value}: not a device spec ({error_text(exc)}); give a spec name or a device "
                         "spec JSON file") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["calibrate"] and ("--card" in argv or any(a == "--backend" or a.startswith("--backend=")
                                                              for a in argv)):
        # Measure a card through its backend (sixfold.backends.spec_calibrate) and write its device spec.
        from sixfold.backends.spec_calibrate import main as calibrate_card

        def check_card(args: argparse.Namespace) -> None:  # after parsing, before seconds of measuring
            check_spec(args.card_spec, "--card-spec")
            if args.out:
                check_output_file(args.out, "--out")
                try:
                    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise UsageError(f"--out {args.out}: {os_error_text(exc)}") from None

        def run_card(rest: list[str]) -> int:
            if "--card" not in rest and "-h" not in rest and "--help" not in rest:
                raise UsageError("--backend measures a card: add --card (without them, calibrate measures this host)")
            return calibrate_card(rest, check_card)
        return _subcommand("calibrate", run_card, argv[1:])
    if argv[:1] == ["calibrate"]:
        # Measure this host (FLOP/s, memory and gather bandwidth) and write a device spec;
        # --disk DIR also measures the disk under DIR for the table tiers (--disk-out FILE, default disk.json).
        from sixfold.backends.host.calibrate import main as calibrate
        rest, disk, disk_out = _take_disk_options(argv[1:])

        def run(rest: list[str]) -> int:
            if "-h" not in rest and "--help" not in rest:
                _check_calibrate(rest, disk, disk_out)
                if out := _option(rest, "--out"):  # written after seconds of measuring: its folder now
                    Path(out).parent.mkdir(parents=True, exist_ok=True)
            code = calibrate(rest)
            if code == 0 and disk:
                from sixfold.partitioner.pricing.tiers import measure_disk
                spec = measure_disk(disk)
                Path(disk_out).write_text(spec.to_json() + "\n")
                print(f"disk under {disk}: {spec.iops:,.0f} random 4 KiB reads/s at {spec.depth} readers, "
                      f"{spec.read_latency_s * 1e6:.0f} us at one; wrote {disk_out}", file=sys.stderr)
            return code
        return _subcommand("calibrate", run, rest)
    if argv[:1] == ["tables"]:  # build a model's tables to disk in chunks, or import a user's (table_build)
        from sixfold.partitioner.tables.build import main as tables
        return _subcommand("tables", tables, argv[1:], _check_tables)
    if argv[:1] == ["tiers"]:  # price a plan's table tiers, or measure a disk (sixfold.partitioner.pricing.tiers_cli)
        from sixfold.partitioner.pricing.tiers_cli import main as tiers
        return _subcommand("tiers", tiers, argv[1:], _check_tiers)
    if argv[:1] == ["show"]:  # print a saved plan, its stored tier table included
        return _show(argv[1:])
    args = _parser().parse_args(argv)
    console = Console(stderr=False, width=None if sys.stdout.isatty() else 120)  # plans are wide
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def fail(text: str) -> int:
        from rich.markup import escape
        err.print(f"[red]sixfold-partition: {escape(text)}[/]")
        return 2

    if bool(args.model) == bool(args.model_file):
        return fail("give either MODEL_FILE or --model NAME")
    if not args.out and not args.plan_only:
        return fail("--out DIR is required (or --plan-only)")
    if args.plan_only and (args.accuracy_report or args.dense_precision != "fp32" or args.measure):
        return fail("--plan-only compiles nothing, so it takes no --accuracy-report, --measure or --dense-precision")
    if args.stages is not None and args.strategy != "pipeline":
        return fail(f"--stages {args.stages} needs --strategy pipeline")
    try:
        _check_args(args)
    except UsageError as exc:
        return fail(str(exc))
    from sixfold.partitioner.artifacts import write_artifacts
    from sixfold.partitioner.compile import partition_builtin, partition_file
    from sixfold.partitioner.partitioned import HOST_PARTITION
    from sixfold.partitioner.report.explain import print_plan
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
            Path(args.draw).parent.mkdir(parents=True, exist_ok=True)
            plan = partitioned.plan
            drawn = draw_partitioned(partitioned, args.draw,
                                     title=f"{plan.model}: host (sparse) vs cards (dense), {plan.strategy}")
            console.print(f"drew {drawn}")
    except (KeyError, ValueError, MemoryError, OSError, RuntimeError) as exc:
        return fail(error_text(exc))
    if args.plan_only:
        console.print(f"wrote {path} (plan only)" if path else "plan only: nothing written")
        return 0
    onnx = ", ".join(f"{d}.onnx" for d in partitioned.plan.dense_stages())
    console.print(f"wrote {path.parent}/ (plan.json, {onnx}, {partitioned.plan.partition(HOST_PARTITION).artifact})")
    return 0

if __name__ == "__main__":
    sys.exit(main())
