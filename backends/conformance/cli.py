"""``python -m sixfold.backends.conformance``: run the kit on a registered backend and print a table."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from sixfold.backends.options import load_options_file, parse_option
from sixfold.backends.conformance.cases import DEFAULT_MODELS
from sixfold.backends.conformance.kit import CHECKS, run_conformance

__all__ = ["main", "parse_option"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sixfold.backends.conformance",
                                description="Check a registered sixfold backend against ONNX Runtime.")
    p.add_argument("backend", nargs="?", help="entry-point name of the backend (see --list)")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated built-in models, MODEL@fp16 or MODEL@int8 for a dense precision "
                        f"(default {','.join(DEFAULT_MODELS)}; 'all' for every one)")
    p.add_argument("--repository", metavar="DIR",
                   help="check every model version's dense partitions in this model repository (each pipeline "
                        "stage, at the plan's precision) instead of the built-in models and op cases")
    p.add_argument("--max-batch", type=int, default=64, help="check batch sizes 1..N (default 64)")
    p.add_argument("--max-rows", type=int, default=200, help="rows per embedding table when building models")
    p.add_argument("--option", action="append", type=parse_option, default=[], metavar="KEY=VALUE",
                   help="backend option (repeatable); VALUE is JSON when it parses, else a string")
    p.add_argument("--options-file", help="JSON object of backend options (e.g. backends/specs/faults/*.json)")
    p.add_argument("--card-spec", default="m2-card", help="device spec name or JSON path (default m2-card)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of: {', '.join(CHECKS)}")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds any one call may take (default 10)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance against ONNX Runtime")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--no-ops", action="store_true",
                   help="skip the op cases (one-node models of every ONNX op use of the dense partitions)")
    p.add_argument("--list", action="store_true", help="list registered backends and exit")
    p.add_argument("--list-specs", action="store_true",
                   help="list named device specs (sixfold's, vendor entry points, backends' devices()) and exit")
    p.add_argument("--list-ops", action="store_true", help="print the ONNX ops a backend must run, and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from rich.console import Console

    from sixfold.backends.api import BackendError
    from sixfold.backends.registry import describe

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    if args.list:
        print(describe())
        return 0
    if args.list_specs:
        from sixfold.backends.spec_catalog import describe_specs
        print(describe_specs())
        return 0
    if args.list_ops:
        from sixfold.backends.conformance.ops import dense_ops, markdown_table
        print(markdown_table(dense_ops()))
        return 0
    if not args.backend:
        print("conformance: name a backend (see --list)", file=sys.stderr)
        return 2
    from sixfold.backends.conformance.cases import case_source
    names = case_source().names() if args.models == "all" else [m.strip() for m in args.models.split(",") if m.strip()]
    try:
        options = load_options_file(args.options_file) if args.options_file else {}
        options.update(dict(args.option))
        what = f"reading {args.repository}" if args.repository else f"building {', '.join(names)}"
        with console.status(f"{what} and checking backend {args.backend}..."):
            report = run_conformance(args.backend, models=names, max_batch=args.max_batch, max_rows=args.max_rows,
                                     card_spec=args.card_spec, options=options,
                                     checks=[c.strip() for c in args.checks.split(",") if c.strip()],
                                     timeout_s=args.timeout, atol=args.atol, seed=args.seed, ops=not args.no_ops,
                                     repository=args.repository)
    except (BackendError, KeyError, ValueError, FileNotFoundError, MemoryError) as exc:
        print(f"conformance: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    console.print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    code = 0 if report.passed else 1
    if report.hung:
        # NOTE: a hung backend thread would block interpreter exit (executor threads are joined at exit).
        console.print("conformance: a backend call never returned; exiting without waiting for it")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
