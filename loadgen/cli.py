"""``sixfold-loadgen``: load against a KServe v2 server, a JSON report, a table, plots.

Modes: open loop at ``--qps`` (default), closed loop (``--concurrency N``),
``--find-max-qps`` (a search over open-loop rates), ``--replay`` of a
``--record``-ed run, ``--export-perf-analyzer`` (write queries, send nothing) and
``--mlperf-scenario server|offline`` (MLCommons LoadGen drives and judges the run).

Exit status: 0 after a run (even one with request errors: the report says; an
MLPerf run VALID or INVALID: it prints which), 1 when the run could not happen
(unreachable server, unknown model, unusable signature), 2 for bad arguments,
3 for an MLPerf run that LoadGen judged INVALID (or that had failed requests)
when ``--mlperf-require-valid`` is given. Errors are one line, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from sixfold.loadgen.arrivals import ARRIVAL_FORMS
from sixfold.loadgen.config import CLIENTS, IDS_DTYPES, PROTOCOLS, LoadConfig, parse_float_list, parse_int_list
from sixfold.loadgen.errors import LoadgenError
from sixfold.loadgen.report import Report, endpoint_note, print_report

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sixfold-loadgen",
        description="Load for recommendation models over KServe v2 gRPC or REST. Open loop by default: requests go "
                    "out on a schedule (Poisson by default) whatever the server does; latency is measured from "
                    "each request's scheduled time. See docs/loadgen.md.")
    p.add_argument("--url", required=True,
                   help="server as HOST:PORT, no scheme: its gRPC port (e.g. 127.0.0.1:8001), or its REST port "
                        "with --protocol http (e.g. 127.0.0.1:8000)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="grpc",
                   help="grpc: KServe v2 gRPC (default); http: KServe v2 REST, tensors in the binary-data "
                        "extension (readiness, discovery and every request)")
    p.add_argument("--ssl", action="store_true", help="TLS: gRPC over TLS, or HTTPS with --protocol http")
    p.add_argument("--root-certificates", default=None, metavar="PEM",
                   help="with --ssl: trust the server's certificate by these CA certificates (PEM file; "
                        "default: the system's)")
    p.add_argument("--model", required=True, help="model name on the server")
    p.add_argument("--model-version", default="", help="model version (default: the server's choice)")
    p.add_argument("--qps", type=float, default=None,
                   help="target queries per second (offered load); required for open-loop runs except "
                        "with --arrival trace:... (the trace's rate)")
    p.add_argument("--duration", type=float, default=None,
                   help="measured window in seconds (required except with --replay, --find-max-qps, "
                        "--export-perf-analyzer; with --mlperf-scenario: the minimum duration, default 600)")
    p.add_argument("--arrival", default="poisson", help=f"arrival process: {ARRIVAL_FORMS} (default poisson)")
    p.add_argument("--query-size", default="mlperf",
                   help="items per query: mlperf (100..700, default), fixed:N, uniform:A-B, "
                        "lognormal:MEAN,SIGMA or file:PATH")
    p.add_argument("--report", default=None,
                   help="path of the JSON report to write (required for runs; optional with --mlperf-scenario)")
    p.add_argument("--plot", default=None,
                   help="PNG plots: a PATH.png (main plot there, others as PATH-cdf.png, ...) or a PREFIX "
                        "(PREFIX-timeline.png, PREFIX-cdf.png, PREFIX-sweep.png)")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, sizes and contents (default 0)")
    p.add_argument("--max-requests", type=int, default=None, help="send at most this many requests")
    p.add_argument("--warmup", type=float, default=0.0,
                   help="seconds of traffic before the measured window (each step's, for --find-max-qps), "
                        "left out of the stats")
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
    p.add_argument("--zipf", default=None,
                   help="id popularity power-law exponent: S for all tables or S1,S2,... per table (default: "
                        "the server's sixfold.zipf, else 1.05)")
    p.add_argument("--id-drift", type=float, default=0.0,
                   help="popular ids rotate by this fraction of each table per second (default 0: fixed)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: keep N requests outstanding for --duration (or --max-requests); "
                        "with --mlperf-scenario offline: requests outstanding (default 8)")
    p.add_argument("--channels", type=int, default=1,
                   help="gRPC connections the raw and shm clients spread requests over (default 1); a server of "
                        "several processes (sixfold-serve --workers N) sees only those its connections reach")
    p.add_argument("--ids-dtype", choices=IDS_DTYPES, default="int64",
                   help="sparse_indices on the wire: int64 (the signature's, default) or int32, half the bytes; "
                        "sixfold takes int32 ids for table-batched models (the zoo's), another server may not")
    p.add_argument("--deadline-ms", type=float, default=None, metavar="MS",
                   help="send every request with this gRPC deadline (default: none): a client's own SLA, which "
                        "sixfold-serve admits each request against when no --p99-ms is set (docs/admission.md)")
    p.add_argument("--batch-dim", action="store_true",
                   help="send every input with a leading batch dimension of 1 and take scores [1, items, 1]: a "
                        "Triton model with max_batch_size > 0 and ragged inputs (its dynamic batcher then batches "
                        "whole requests)")
    p.add_argument("--client", choices=CLIENTS, default="raw",
                   help="raw: requests pre-serialized, sent on a gRPC channel or HTTP connections (default); "
                        "tritonclient: every request through InferenceServerClient.infer (tritonclient.grpc.aio "
                        "or .http.aio); "
                        "shm: a server on this host reads each query's tensors from a shared memory segment "
                        "(Triton's system shared memory extension), so only a small request crosses the socket")
    p.add_argument("--lag-threshold-ms", type=float, default=5.0,
                   help="a send later than this counts as the generator falling behind (default 5)")
    search = p.add_argument_group("find-max-qps (highest QPS whose p99 meets a target)")
    search.add_argument("--find-max-qps", action="store_true", help="sweep then binary-search the offered QPS")
    search.add_argument("--p99-ms", type=float, default=None, help="the p99 latency target in ms (required)")
    search.add_argument("--min-qps", type=float, default=10.0, help="first step's QPS (default 10)")
    search.add_argument("--floor-qps", type=float, default=0.25,
                        help="if the first step fails, halve down to this QPS at least (default 0.25)")
    search.add_argument("--max-qps", type=float, default=10_000.0, help="highest QPS tried (default 10000)")
    search.add_argument("--step-duration", type=float, default=10.0, help="measured seconds per step (default 10)")
    search.add_argument("--tolerance", type=float, default=0.05,
                        help="stop when pass and fail rates are within this fraction (default 0.05)")
    search.add_argument("--max-steps", type=int, default=16, help="at most this many steps (default 16)")
    search.add_argument("--max-error-rate", type=float, default=0.0,
                        help="a step with more failed requests than this fraction fails (default 0)")
    traces = p.add_argument_group("record, replay, export")
    traces.add_argument("--record", default=None, metavar="PATH",
                        help="save what was sent, when and what came back to PATH (.npz: the queries as their "
                             "generator's seed and parameters, a few KB; see docs)")
    traces.add_argument("--replay", default=None, metavar="PATH",
                        help="send a recorded run's tensors on its schedule, for the model shape it recorded "
                             "(ignores --qps, --arrival, sizes, --table-rows, --pooling, --dense-dim, --zipf)")
    traces.add_argument("--export-perf-analyzer", default=None, metavar="PATH",
                        help="write the queries as perf_analyzer --input-data JSON (first --max-requests, "
                             "else --pool of them) and exit")
    mlperf = p.add_argument_group("MLPerf LoadGen (mlcommons-loadgen drives the run and judges it; "
                                  "see docs/mlperf.md)")
    mlperf.add_argument("--mlperf-scenario", choices=("server", "offline"), default=None,
                        help="run LoadGen's Server (Poisson at --qps, latency bound) or Offline (all samples "
                             "at once, throughput) scenario; --duration is the minimum duration "
                             "(default 600 s, MLPerf's)")
    mlperf.add_argument("--mlperf-latency-ms", type=float, default=60.0,
                        help="Server: latency bound at --mlperf-latency-percentile (default 60)")
    mlperf.add_argument("--mlperf-latency-percentile", type=float, default=99.0,
                        help="Server: the percentile the bound applies to (default 99)")
    mlperf.add_argument("--mlperf-min-queries", type=int, default=None,
                        help="LoadGen's min_query_count (default MLPerf's: 270336 queries for Server, "
                             "24576 samples for Offline); lower it for short, non-compliant runs")
    mlperf.add_argument("--mlperf-samples", type=int, default=1024,
                        help="query sample library size: distinct pre-generated queries (default 1024)")
    mlperf.add_argument("--mlperf-log-dir", default="runs/mlperf",
                        help="where LoadGen writes mlperf_log_summary.txt and mlperf_log_detail.txt "
                             "(default runs/mlperf)")
    mlperf.add_argument("--mlperf-warmup-queries", type=int, default=32,
                        help="queries sent one at a time before LoadGen starts, not timed (default 32; 0: none)")
    mlperf.add_argument("--mlperf-require-valid", action="store_true",
                        help="exit 3 when LoadGen judges the run INVALID or a request failed")
    p.add_argument("--processes", type=int, default=1,
                   help="spread an open-loop run over N generator processes (when one falls behind)")
    p.add_argument("--quiet", action="store_true",
                   help="no live progress and no table (--find-max-qps still prints its answer, one line)")
    return p


_MLPERF_EXCLUSIVE = (("find_max_qps", "--find-max-qps"), ("replay", "--replay"), ("record", "--record"),
                     ("export_perf_analyzer", "--export-perf-analyzer"), ("plot", "--plot"),
                     ("max_requests", "--max-requests"))


def _mlperf_settings(args: argparse.Namespace) -> Any:
    """The MLPerf settings from the flags (ValueError names the flag)."""
    from sixfold.loadgen.mlperf import MLPERF_MIN_DURATION_S, MLPerfSettings
    for attr, flag in _MLPERF_EXCLUSIVE:
        if getattr(args, attr):
            raise ValueError(f"{flag} does not go with --mlperf-scenario (LoadGen decides what is sent)")
    if args.processes != 1:
        raise ValueError("--processes does not go with --mlperf-scenario")
    if args.qps is None or not args.qps > 0:
        raise ValueError("--mlperf-scenario needs --qps > 0 (Server: target QPS; Offline: expected QPS)")
    if args.concurrency is not None and args.mlperf_scenario == "server":
        raise ValueError("--concurrency applies to --mlperf-scenario offline only (requests outstanding)")
    if not 0 < args.mlperf_latency_percentile < 100:
        raise ValueError(f"--mlperf-latency-percentile must be in (0, 100), got {args.mlperf_latency_percentile:g}")
    for flag, value in (("--mlperf-latency-ms", args.mlperf_latency_ms),
                        ("--duration", args.duration if args.duration is not None else 1.0)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value:g}")
    for flag, number in (("--mlperf-min-queries", args.mlperf_min_queries), ("--mlperf-samples", args.mlperf_samples),
                         ("--concurrency", args.concurrency)):
        if number is not None and number < 1:
            raise ValueError(f"{flag} must be >= 1, got {number}")
    if args.mlperf_warmup_queries < 0:
        raise ValueError(f"--mlperf-warmup-queries must be >= 0, got {args.mlperf_warmup_queries}")
    return MLPerfSettings(
        scenario=args.mlperf_scenario, qps=args.qps, latency_ms=args.mlperf_latency_ms,
        latency_percentile=args.mlperf_latency_percentile,
        min_duration_s=args.duration if args.duration is not None else MLPERF_MIN_DURATION_S,
        min_queries=args.mlperf_min_queries, samples=args.mlperf_samples, log_dir=args.mlperf_log_dir,
        offline_inflight=args.concurrency or 8, warmup_queries=args.mlperf_warmup_queries)


def _config(args: argparse.Namespace) -> LoadConfig:
    if args.mlperf_scenario:
        # NOTE: LoadGen owns rate and duration; the LoadConfig only names the server and the queries.
        return LoadConfig(
            url=args.url, model=args.model, model_version=args.model_version, qps=args.qps or 1.0,
            duration_s=1.0, query_size=args.query_size, seed=args.seed, wait_ready_s=args.wait_ready,
            table_rows=parse_int_list(args.table_rows, "--table-rows") if args.table_rows else None,
            pooling=parse_int_list(args.pooling, "--pooling") if args.pooling else None,
            dense_dim=args.dense_dim, zipf=_zipf(args), client=args.client, channels=args.channels,
            ids_dtype=args.ids_dtype, batch_dim=args.batch_dim, deadline_s=_deadline(args), **_connection(args))
    rate_free = args.concurrency is not None or args.replay or args.arrival.strip().lower().startswith("trace:")
    if args.qps is None and not (rate_free or args.find_max_qps or args.export_perf_analyzer):
        raise ValueError("--qps is required (or give --concurrency, --find-max-qps, --replay, "
                         "or --arrival trace:PATH)")
    if args.duration is None and not (args.replay or args.find_max_qps or args.export_perf_analyzer):
        raise ValueError("--duration is required (except with --replay, --find-max-qps, --export-perf-analyzer)")
    if args.report is None and not args.export_perf_analyzer:
        raise ValueError("--report PATH is required")
    if args.find_max_qps and args.p99_ms is None:
        raise ValueError("--find-max-qps needs --p99-ms (the p99 latency target)")
    qps = args.qps
    if qps is None:
        # NOTE: a search sets each step's rate; an export only needs the queries' order (nominal rate).
        qps = 0.0 if rate_free else (args.min_qps if args.find_max_qps else 100.0)
    duration = args.duration if args.duration is not None else (args.step_duration if args.find_max_qps else 10.0)
    return LoadConfig(
        url=args.url, model=args.model, model_version=args.model_version, qps=qps,
        duration_s=duration, arrival=args.arrival, query_size=args.query_size, seed=args.seed,
        max_requests=args.max_requests, warmup_s=args.warmup, wait_ready_s=args.wait_ready,
        drain_timeout_s=args.drain_timeout, pool=args.pool,
        table_rows=parse_int_list(args.table_rows, "--table-rows") if args.table_rows else None,
        pooling=parse_int_list(args.pooling, "--pooling") if args.pooling else None,
        dense_dim=args.dense_dim, zipf=_zipf(args),
        id_drift=args.id_drift, concurrency=args.concurrency, record_path=args.record, replay_path=args.replay,
        client=args.client, lag_threshold_ms=args.lag_threshold_ms, channels=args.channels,
        ids_dtype=args.ids_dtype, batch_dim=args.batch_dim, deadline_s=_deadline(args), **_connection(args))


def _deadline(args: argparse.Namespace) -> float | None:
    """--deadline-ms in seconds (None: not given)."""
    return None if args.deadline_ms is None else args.deadline_ms / 1e3


def _connection(args: argparse.Namespace) -> dict[str, Any]:
    """--protocol, --ssl, --root-certificates as LoadConfig fields (ValueError names the flag)."""
    if args.root_certificates and not args.ssl:
        raise ValueError("--root-certificates needs --ssl")
    if args.protocol == "http" and args.client == "shm":
        raise ValueError("--client shm needs --protocol grpc (sixfold's REST serves no shared memory)")
    if args.protocol == "http" and args.channels != 1:
        raise ValueError("--channels is for gRPC; over --protocol http connections open as requests need them")
    return {"protocol": args.protocol, "ssl": args.ssl, "root_certificates": args.root_certificates}


def _zipf(args: argparse.Namespace) -> float | tuple[float, ...] | None:
    zipf = parse_float_list(args.zipf, "--zipf") if args.zipf else None
    return zipf[0] if zipf and len(zipf) == 1 else zipf


def _run_mlperf(args: argparse.Namespace, config: LoadConfig, settings: Any, console: Console | None) -> int:
    from sixfold.loadgen.mlperf import run_mlperf
    if console is not None:
        console.print(f"MLPerf LoadGen {settings.scenario}: {config.model} @ {config.url}"
                      f"{endpoint_note({'protocol': config.protocol, 'ssl': config.ssl})}, "
                      f"{settings.qps:g} q/s, >= {settings.min_duration_s:g} s and >= "
                      f"{settings.min_query_count} {'queries' if settings.scenario == 'server' else 'samples'}"
                      + (f", p{settings.latency_percentile:g} <= {settings.latency_ms:g} ms"
                         if settings.scenario == "server" else ""), markup=False, highlight=False)
    result = run_mlperf(config, settings)
    if args.report:
        path = Path(args.report)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    pct = f"p{settings.latency_percentile:g}"
    latency = result.latency_ms.get(pct)
    head = f"MLPerf {settings.scenario.capitalize()}: {result.result} (LoadGen's verdict)"
    if result.errors:
        head += f", but {result.errors} of {result.samples_sent} requests failed: not a valid result"
    lines = [head,
             f"  {'completed' if settings.scenario == 'server' else 'achieved'} samples/s: "
             f"{result.samples_per_s if result.samples_per_s is not None else float('nan'):.2f}"
             f" (target {settings.qps:g}); {pct} latency: "
             + (f"{latency:.1f} ms" if latency is not None else "n/a")
             + (f" (bound {settings.latency_ms:g} ms)" if settings.scenario == "server" else ""),
             "  checks: " + (", ".join(f"{k.replace('_', ' ')} {'yes' if v else 'NO'}"
                                       for k, v in result.checks.items()) or "none"),
             f"  requests: {result.samples_sent} sent, {result.errors} failed"
             + (f", {result.retries} retried after RESOURCE_EXHAUSTED" if result.retries else "")
             + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(result.errors_by_reason.items()))})"
                if result.errors else ""),
             f"  logs: {result.summary_path}, {result.detail_path}" + (f"; report: {args.report}" if args.report else "")]
    print("\n".join(lines))
    if args.mlperf_require_valid and not result.valid:
        return 3
    return 0


def _fail(message: str, code: int) -> int:
    print(f"sixfold-loadgen: error: {' '.join(str(message).split())}", file=sys.stderr)
    return code


def _os_error(exc: OSError) -> str:
    """One line for an OSError: the file it concerns and why, never a bare errno (as sixfold-serve says it)."""
    if exc.strerror is None:
        return str(exc) or type(exc).__name__
    return f"{exc.filename}: {exc.strerror}" if exc.filename is not None else exc.strerror


def _check_paths(args: argparse.Namespace) -> None:
    """The files a run reads and writes, before it runs (a report written after minutes of load must not fail
    on its folder): ValueError naming the flag and the fix."""
    import os
    certificates = getattr(args, "root_certificates", None)
    if certificates and not Path(certificates).is_file():
        raise ValueError(f"--root-certificates {certificates}: no such file; give the CA certificates (PEM) "
                         "that signed the server's certificate")
    outputs = [("--report", args.report), ("--record", args.record), ("--plot", args.plot),
               ("--export-perf-analyzer", args.export_perf_analyzer)]
    if args.mlperf_scenario:
        outputs.append(("--mlperf-log-dir", str(Path(args.mlperf_log_dir) / "mlperf_log_summary.txt")))
    for flag, path in outputs:
        if not path:
            continue
        p = Path(path)
        if p.is_dir() and flag != "--plot":
            raise ValueError(f"{flag} {path}: a folder; give a file path")
        parent = p.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"{flag} {path}: {parent} is a file, not a folder; give a path in a folder")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: this user cannot write in {parent}; give a path in a folder it can "
                             "write")


def _run(args: argparse.Namespace, config: LoadConfig, console: Console | None) -> Report | None:
    if args.export_perf_analyzer:
        from sixfold.loadgen.export import export_perf_analyzer_async
        path, count = asyncio.run(export_perf_analyzer_async(config, args.export_perf_analyzer))
        if console is not None:
            console.print(f"wrote {count} queries as perf_analyzer input data: {path}", markup=False,
                          highlight=False)
        return None
    if args.find_max_qps:
        from sixfold.loadgen.sweep import SweepConfig, find_max_qps
        sweep = SweepConfig(p99_ms=args.p99_ms, min_qps=args.min_qps, max_qps=args.max_qps,
                            floor_qps=min(args.floor_qps, args.min_qps),
                            step_duration_s=args.step_duration, tolerance=args.tolerance,
                            max_steps=args.max_steps, max_error_rate=args.max_error_rate)
        return find_max_qps(config, sweep, console=console)
    if args.processes != 1:
        from sixfold.loadgen.multiprocess import run_load_processes
        return run_load_processes(config, args.processes, console=console)
    from sixfold.loadgen.runner import run_load
    return run_load(config, console=console)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run, write the report; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        settings = _mlperf_settings(args) if args.mlperf_scenario else None
        config = _config(args)
        _check_paths(args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    console = Console()
    if settings is not None:
        try:
            return _run_mlperf(args, config, settings, None if args.quiet else console)
        except ValueError as exc:
            return _fail(str(exc), 2)
        except OSError as exc:
            return _fail(_os_error(exc), 1)
        except (LoadgenError, RuntimeError, TimeoutError) as exc:
            return _fail(str(exc), 1)
        except KeyboardInterrupt:
            return _fail("interrupted", 130)
    try:
        report = _run(args, config, None if args.quiet else console)
    except ValueError as exc:
        return _fail(str(exc), 2)
    except OSError as exc:
        return _fail(_os_error(exc), 1)
    except (LoadgenError, RuntimeError, TimeoutError) as exc:
        return _fail(str(exc), 1)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    if report is None:
        return 0
    try:
        path = report.write_json(args.report)
        plots = []
        if args.plot:
            from sixfold.loadgen.plot import plot_all
            plots = plot_all(report, args.plot)
    except OSError as exc:
        return _fail(_os_error(exc), 1)
    if args.quiet:
        if report.sweep is not None:  # NOTE: the one line a --quiet search exists to give
            from sixfold.loadgen.sweep import answer_line
            print(answer_line(report))
    else:
        print_report(report, console)
        if report.sweep is not None:
            from sixfold.loadgen.sweep import print_sweep
            print_sweep(report, console)
        console.print(f"report: {path}" + (f", plots: {', '.join(map(str, plots))}" if plots else "")
                      + (f", recording: {report.recording}" if report.recording else ""),
                      markup=False, highlight=False)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
