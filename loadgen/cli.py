"""``sixfold-loadgen``: open-loop load against a KServe v2 server, a JSON report, a table.

Exit status: 0 after a run (even one with request errors: the report says),
1 when the run could not happen (unreachable server, unknown model, unusable
signature), 2 for bad arguments. Errors are one line, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rich.console import Console

from .config import LoadConfig, parse_int_list
from .errors import LoadgenError
from .report import print_report
from .runner import run_load

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sixfold-loadgen",
        description="Open-loop load for recommendation models over KServe v2 gRPC. Requests go out on "
                    "a schedule (Poisson by default) whatever the server does; latency is measured from "
                    "each request's scheduled time.")
    p.add_argument("--url", required=True, help="server as HOST:PORT (gRPC), e.g. 127.0.0.1:8001")
    p.add_argument("--model", required=True, help="model name on the server")
    p.add_argument("--model-version", default="", help="model version (default: the server's choice)")
    p.add_argument("--qps", type=float, required=True, help="target queries per second (offered load)")
    p.add_argument("--duration", type=float, required=True, help="measured window in seconds")
    p.add_argument("--arrival", default="poisson", help="arrival process: poisson (default) or constant")
    p.add_argument("--query-size", default="mlperf",
                   help="items per query: mlperf (100..700, default) or fixed:N")
    p.add_argument("--report", required=True, help="path of the JSON report to write")
    p.add_argument("--plot", default=None, help="also draw the timeline to this PNG file")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, sizes and contents (default 0)")
    p.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of traffic before the measured window, left out of the stats")
    p.add_argument("--wait-ready", type=float, default=30.0,
                   help="wait up to this many seconds for ServerReady/ModelReady (default 30)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="after the last send, seconds in-flight requests may still answer; "
                        "later ones count as errors 'timeout' (default 10)")
    p.add_argument("--pool", type=int, default=32,
                   help="distinct pre-generated queries to cycle through (at least one per query size; default 32)")
    p.add_argument("--table-rows", default=None,
                   help="rows per table: N for all tables or N1,N2,...; overrides the server's "
                        "sixfold.table_rows (required for servers that do not publish it)")
    p.add_argument("--pooling", default=None,
                   help="mean ids per item and table: P or P1,P2,...; overrides sixfold.pooling (default 1)")
    p.add_argument("--dense-dim", type=int, default=None, help="dense features per item (overrides metadata)")
    p.add_argument("--zipf", type=float, default=None, help="id popularity power-law exponent (default 1.05)")
    p.add_argument("--client", choices=("raw", "tritonclient"), default="raw",
                   help="raw: requests pre-serialized, sent on a gRPC channel (default); "
                        "tritonclient: every request through InferenceServerClient.infer")
    p.add_argument("--lag-threshold-ms", type=float, default=5.0,
                   help="a send later than this counts as the generator falling behind (default 5)")
    p.add_argument("--quiet", action="store_true", help="no live progress and no table")
    return p


def _config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        url=args.url, model=args.model, model_version=args.model_version, qps=args.qps,
        duration_s=args.duration, arrival=args.arrival, query_size=args.query_size, seed=args.seed,
        max_requests=args.max_requests, warmup_s=args.warmup, wait_ready_s=args.wait_ready,
        drain_timeout_s=args.drain_timeout, pool=args.pool,
        table_rows=parse_int_list(args.table_rows, "--table-rows") if args.table_rows else None,
        pooling=parse_int_list(args.pooling, "--pooling") if args.pooling else None,
        dense_dim=args.dense_dim, zipf=args.zipf, client=args.client, lag_threshold_ms=args.lag_threshold_ms)


def _fail(message: str, code: int) -> int:
    print(f"sixfold-loadgen: error: {' '.join(str(message).split())}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run, write the report; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        config = _config(args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    console = Console()
    try:
        report = run_load(config, console=None if args.quiet else console)
    except ValueError as exc:
        return _fail(str(exc), 2)
    except LoadgenError as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    path = report.write_json(args.report)
    if args.plot:
        from .plot import plot_report
        plot_report(report, args.plot)
    if not args.quiet:
        print_report(report, console)
        console.print(f"report: {path}" + (f", plot: {args.plot}" if args.plot else ""),
                      markup=False, highlight=False)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
