"""sixfold-serve: serve a recommendation model on host + N cards over KServe v2 gRPC and REST until stopped."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from sixfold import models
from sixfold.backends.api import BackendError
from sixfold.backends.cpu_layout import AUTO, CPU, LANE_BACKEND
from sixfold.partitioner.cli import (DefaultsHelpFormatter, OneLineParser, UsageError, check_input_dir,
                                     check_input_file, check_spec, error_text, read_token_file)

from sixfold.server.memory.allocator import keep_freed_memory
from sixfold.server.app import ServerConfig, SixfoldServer, check_ports
from sixfold.server.scheduling.batcher import (DEFAULT_NO_WAIT_ROWS, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_WORK_MS,
                                              DEFAULT_TIMEOUT_US, SLA_P99_MS, BatchingConfig)
from sixfold.server.core import InferenceCore
from sixfold.server.transport.limits import TransportLimits
from sixfold.server.errors import ServingError
from sixfold.server.observability.logs import LEVELS, configure_logging, emit, parse_level, write_line
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.workers.process import READY_PREFIX, ready_address
from sixfold.server.execution.runtime import CARD_SCHEDULING, DEFAULT_CARD_SCHEDULING, DEFAULT_MIN_SPLIT_ROWS
from sixfold.server.workers.supervisor import follow_supervisor, worker_ports_line

__all__ = ["main"]

_LOGGER = "sixfold-serve"
_WORKER_LINE = re.compile(r"^\[worker (\d+)\] (.*)$", re.S)


class _Parser(OneLineParser):
    """One-line usage errors; a JSON object when the command line asks for --log-format json."""

    json_errors = False

    def exit(self, status: int = 0, message: str | None = None):
        if message and self.json_errors:
            emit(message.strip(), level="error" if status else "info", logger=_LOGGER, stream="stderr",
                 event="usage_error" if status else "usage")
            sys.exit(status)
        super().exit(status, message)


def _wants_json(argv: list[str]) -> bool:
    return any(a == "--log-format=json" or (a == "--log-format" and argv[i + 1:i + 2] == ["json"])
               for i, a in enumerate(argv))


class _Output:
    """What sixfold-serve tells its operator: text on stdout (errors on stderr), or with --log-format json
    one JSON object a line (``sixfold.server.observability.logs.emit``), ``event`` naming what it says."""

    def __init__(self, fmt: str) -> None:
        self.json = fmt == "json"
        self.console = Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 120)

    def say(self, text: str, event: str, **fields: Any) -> None:
        if self.json:
            emit(text, logger=_LOGGER, event=event, **fields)
        else:
            self.console.print(text, markup=False, soft_wrap=True)

    def error(self, text: str) -> None:
        if self.json:
            emit(f"sixfold-serve: {text}", level="error", logger=_LOGGER, stream="stderr", event="error")
        else:
            print(f"sixfold-serve: {text}", file=sys.stderr, flush=True)

    def warning(self, text: str) -> None:
        if self.json:
            emit(f"sixfold-serve: {text}", level="warning", logger=_LOGGER, stream="stderr", event="warning")
        else:
            print(f"sixfold-serve: warning: {text}", file=sys.stderr, flush=True)

    def status(self, text: str, event: str, **fields: Any):
        """A spinner while something slow runs (text on a terminal), or one JSON line saying it started."""
        if self.json:
            self.say(text, event, **fields)
            return contextlib.nullcontext()
        return self.console.status(text)

    def protocol_line(self, text: str) -> None:
        """A line another process reads as it is (a worker's ports, for its supervisor): never JSON."""
        if self.json:
            write_line(text, past_capture=True)
        else:
            self.console.print(text, markup=False, soft_wrap=True)

    def plan(self, served: Any) -> None:
        """The plan a model runs, priced as it is served: with its table memory, the host stage as tiered."""
        from sixfold.partitioner.report.explain import print_plan

        plan, resident = _served_plan(served)
        est = plan.estimates
        summary = (f"plan of {served.name} version {served.version}: {plan.strategy} on {len(plan.devices) - 1} cards + host; bottleneck "
                   f"{est.bottleneck}; throughput bound {est.throughput_items_per_s:,.0f} items/s; unloaded latency "
                   f"{est.latency_ms:.2f} ms (batches of {est.batch_rows} items)")
        tiered = _tiered_note(plan, resident)
        lone = _lone_query(served, plan)
        if self.json:
            fields = _plan_fields(plan, resident)
            if lone is not None:
                fields["served_latency"] = lone.to_dict()
            emit(summary + (f"; {tiered}" if tiered else "") + (f"; {lone.describe(est.batch_rows)}" if lone else ""),
                 logger=_LOGGER, event="plan", model=served.name, version=served.version, plan=fields)
            return
        print_plan(plan, self.console)
        if tiered:
            self.console.print(f"  {tiered}", markup=False, soft_wrap=True)
        if lone is not None:
            self.console.print(f"  unloaded, as served: {lone.describe(est.batch_rows)}", markup=False, soft_wrap=True)

    def supervisor_line(self, text: str) -> None:
        """A line of the --workers supervisor: its own, or a worker's (``[worker N] ...``) with ``worker`` set."""
        if not self.json:
            print(text, flush=True)
            return
        match = _WORKER_LINE.match(text)
        if match:
            index, inner = int(match[1]), match[2].strip()
            try:
                entry = json.loads(inner) if inner.startswith("{") else None
            except ValueError:
                entry = None
            if isinstance(entry, dict):
                entry["worker"] = index
                write_line(json.dumps(entry))
            else:
                emit(inner, logger=_LOGGER, event="worker_output", worker=index)
        elif address := ready_address(text):
            emit(text, logger=_LOGGER, event="ready", grpc=address)
        else:
            emit(text, logger=_LOGGER, event="workers")


def _log_level(text: str) -> str:
    try:
        return parse_level(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give one of {', '.join(LEVELS)}") from None


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="sixfold-serve", description=__doc__, formatter_class=DefaultsHelpFormatter,
                usage="sixfold-serve (--model NAME | --model-repository REPO) [options]")
    model = p.add_argument_group("model (what to serve)")
    model.add_argument("--model", help=f"built-in model to serve: {', '.join(models.names())}")
    model.add_argument("--model-repository", metavar="REPO",
                       help="serve the models in REPO (REPO/NAME/VERSION/plan.json, written by sixfold-partition "
                            "--out)")
    model.add_argument("--model-control-mode", choices=["none", "explicit"], default="none",
                       help="none: load every repository model at start; explicit: clients load and unload models "
                            "(RepositoryModelLoad/Unload), and only --load-model ones load at start")
    model.add_argument("--load-model", action="append", default=[], metavar="NAME",
                       help="with --model-control-mode explicit: load NAME at start ('*' for all; repeatable)")
    model.add_argument("--max-rows", type=int, default=None, metavar="R", help="cap every embedding table at R rows")
    model.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    model.add_argument("--no-warmup", action="store_true",
                       help="serve each model without first running synthetic batches of 1..max-batch-rows rows "
                            "through it (by default they run before READY, so the first requests do not pay "
                            "one-time costs)")
    model.add_argument("--allow-nonfinite", action="store_true",
                       help="score dense features that are NaN or infinite (default: refused with INVALID_ARGUMENT "
                            "naming the input and the first bad position)")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0: all)")
    net.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; 0: pick a free one)")
    net.add_argument("--http-port", type=int, default=8000,
                     help="KServe v2 REST port (default 8000, as Triton; 0: pick a free one; -1: off)")
    net.add_argument("--metrics-port", type=int, default=8002,
                     help="Prometheus /metrics port (default 8002; 0: pick a free one; -1: off)")
    net.add_argument("--max-message-mb", type=int, default=64, help="largest request/response in MiB (default 64)")
    net.add_argument("--no-shared-memory", action="store_true",
                     help="refuse Triton's system shared memory extension (on by default: co-located clients may "
                          "register /dev/shm segments and send tensors by region instead of over the socket)")
    net.add_argument("--drain-seconds", type=float, default=5.0,
                     help="on SIGTERM, report not ready and keep serving this long before refusing new requests, "
                          "so load balancers notice first (default 5; 0: refuse at once; a second SIGTERM ends it)")
    net.add_argument("--workers", type=int, default=1,
                     help="front-end processes sharing the ports, each with its own event loop, over one engine "
                          "that holds the models (default 1: one process; see docs/workers.md)")
    net.add_argument("--as-engine", default=None, help=argparse.SUPPRESS)  # RUN FOLDER, set by --workers
    net.add_argument("--as-supervisor", action="store_true", help=argparse.SUPPRESS)  # set by --workers (_Supervise)
    limits = p.add_argument_group("limits (what clients may hold before admission; docs/serving.md, Limits)")
    limits.add_argument("--max-connections", type=_count, default=1000,
                        help="open connections per port (gRPC, REST, metrics); one more is closed at once "
                             "(default 1000; 0: no cap)")
    limits.add_argument("--header-timeout-s", type=_seconds, default=10.0,
                        help="REST and /metrics: a request's headers must arrive within this many seconds of its "
                             "first byte, else the connection closes (default 10; 0: no limit)")
    limits.add_argument("--body-timeout-s", type=_seconds, default=30.0,
                        help="a REST body (408) or gRPC ModelInfer message (DEADLINE_EXCEEDED) must arrive within "
                             "this many seconds of its read starting (default 30; 0: no limit)")
    limits.add_argument("--handshake-timeout-s", type=_seconds, default=10.0,
                        help="TLS and HTTP/2 handshakes must finish this soon after a connection opens "
                             "(default 10; 0: the libraries' own 60-120 s)")
    limits.add_argument("--grpc-idle-timeout-s", type=_seconds, default=300.0,
                        help="close a gRPC connection with no RPC for this long (default 300; 0: never)")
    limits.add_argument("--grpc-max-connection-age-s", type=_seconds, default=3600.0,
                        help="ask a gRPC connection this old to reconnect, so load balancers rebalance "
                             "(default 3600; 0: never)")
    limits.add_argument("--grpc-max-streams", type=_count, default=1024,
                        help="gRPC RPCs at once per connection (default 1024; 0: gRPC's unlimited)")
    sec = p.add_argument_group("security (TLS and tokens)")
    sec.add_argument("--tls-cert", metavar="PEM",
                     help="PEM certificate chain: serve gRPC, REST and /metrics over TLS (with --tls-key)")
    sec.add_argument("--tls-key", metavar="PEM", help="PEM private key for --tls-cert")
    sec.add_argument("--control-token", default=None,
                     help="bearer token model-control RPCs must carry; any local user can read it in the process "
                          "list: prefer --control-token-file or $SIXFOLD_CONTROL_TOKEN (unset: none)")
    sec.add_argument("--control-token-file", metavar="PATH",
                     help="read --control-token from the first line of PATH (kept out of the process list)")
    sec.add_argument("--insecure-model-control", action="store_true",
                     help="allow --model-control-mode explicit without --control-token (any client may then load "
                          "and unload models); without it such a server refuses to start")
    sec.add_argument("--metrics-token", default=None,
                     help="bearer token a /metrics scrape must carry (unset: none); any local user can read it in "
                          "the process list: prefer --metrics-token-file or $SIXFOLD_METRICS_TOKEN; with "
                          "--tls-cert, /metrics is served over HTTPS either way")
    sec.add_argument("--metrics-token-file", metavar="PATH",
                     help="read --metrics-token from the first line of PATH (kept out of the process list)")
    cards = p.add_argument_group("cards and placement")
    cards.add_argument("--cards", type=int, default=None,
                       help="accelerator cards (default 6; with --backend cpu: one lane per usable core; with "
                            "--model-repository, each version is served on its "
                            "plan's cards, and a count or --card-spec that differs from them is refused)")
    cards.add_argument("--backend", default="auto",
                       help="card backend (see --list-backends), or a layout: auto (the default) picks a plug-in "
                            "accelerator that reports a device, else emulated simcards; cpu: the dense part on one "
                            "lane per usable host core (docs/serving.md, 'CPU host')")
    cards.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE",
                       help="option for the card backend, value read as JSON when it parses (repeatable)")
    cards.add_argument("--backend-options-file", metavar="JSON",
                       help="backend options as a JSON object, e.g. backends/specs/faults/flaky.json for simcard")
    cards.add_argument("--card-spec", default=None,
                       help="device spec name or JSON file for the cards (default: the first device the backend "
                            "reports, else m2-card; see --list-specs)")
    cards.add_argument("--host-spec", default=None,
                       help="device spec name or JSON file for the host (e.g. one written by 'sixfold-partition "
                            "calibrate'; auto: this host, calibrated once and cached, as make serve and make demo "
                            "use); prices the host stage in the printed plan (default host-cpu; auto on the cpu layout)")
    cards.add_argument("--dense-precision", default="fp32", choices=["fp32", "fp16", "int8"],
                       help="precision of the dense partition on the cards (built-in models; default fp32; "
                            "int8: dynamic quantization, ONNX Runtime cards)")
    cards.add_argument("--sparse-on-cards", choices=["table", "row", "column", "auto"],
                       help="place embedding tables on the cards as table-, row- or column-wise shards "
                            "(built-in models; default: all tables on the host)")
    cards.add_argument("--max-card-batch-rows", type=int, default=256,
                       help="a card takes at most this many items per batch; a larger batch is split across cards, "
                            "which run its parts at once (default 256; 0: never split)")
    cards.add_argument("--min-split-rows", type=int, default=DEFAULT_MIN_SPLIT_ROWS,
                       help="a batch of at least twice this many items is also split over cards (which: "
                            f"--card-scheduling), in equal parts of at least this many (default "
                            f"{DEFAULT_MIN_SPLIT_ROWS}; 0: only split batches over --max-card-batch-rows)")
    cards.add_argument("--card-scheduling", choices=CARD_SCHEDULING, default=DEFAULT_CARD_SCHEDULING,
                       help="fifo: batches get the cards in arrival order, each split over as many as it can use "
                            "(waiting for them); greedy: split over the cards idle when it arrives, else whole on "
                            f"the least-loaded card (default {DEFAULT_CARD_SCHEDULING}); see docs/scheduling.md")
    cards.add_argument("--card-timeout-multiple", type=float, default=10.0,
                       help="a card is hung when a batch takes this many times its expected time (cost model; "
                            "default 10; 0: the floor alone); see docs/reliability.md")
    cards.add_argument("--card-timeout-floor-ms", type=int, default=500,
                       help="shortest hang deadline of a card batch, milliseconds (default 500)")
    cards.add_argument("--host-dense-max-rows", type=int, default=-1,
                       help="batches of at most this many items run their dense part on the host CPU "
                            "(-1: tuned automatically from measured latencies; 0: never)")
    cards.add_argument("--host-chunk-rows", type=int, default=0, metavar="ROWS",
                       help="run the host stage of a batch of at least 2 x ROWS items in chunks of about ROWS, each "
                            "chunk's card stage overlapping the next chunk's host stage (default 0: whole batches)")
    tables = p.add_argument_group("embedding tables")
    tables.add_argument("--table-precision", default="fp32", choices=["fp32", "fp16", "int8", "int4"],
                        help="embedding tables row-wise precision on the host (default fp32)")
    tables.add_argument("--table-memory", type=_table_memory, default=None, metavar="BYTES",
                        help="keep embedding tables on disk behind a DRAM row cache of this size (512MiB, 4GiB, or a "
                             "share of the table bytes such as 10%%; default: every row resident); the plan "
                             "printed at start prices it. A model's config.pbtxt may set its own "
                             "(sixfold.table_memory)")
    tables.add_argument("--table-cache-policy", choices=["tinylfu", "clock"], default="tinylfu",
                        help="row cache admission: tinylfu (a row enters on its fourth miss; default) or clock "
                             "(every miss)")
    tables.add_argument("--cache-dir", metavar="DIR", default=None,
                        help="where tables derived from a model's (fused, fp16/int8/int4) are written, keyed by the "
                             "tables' checksums; never into the model repository (default: $SIXFOLD_CACHE_DIR, else "
                             "$XDG_CACHE_HOME/sixfold or ~/.cache/sixfold). Not writable: the tables are served as "
                             "they are, and the log says why (docs/serving.md)")
    tables.add_argument("--cache-max-bytes", type=_cache_cap, default=None, metavar="BYTES",
                        help="cap the --cache-dir folder (e.g. 64GiB; 0: no cap; default: 4x its largest entry): "
                             "least recently used entries no process maps are removed when a new one is written "
                             "(docs/serving.md)")
    tables.add_argument("--warm-from", metavar="RECORDING",
                        help="before serving, fill the row cache of models with a table memory from the queries of "
                             "this sixfold-loadgen --record file (docs/tiered-tables.md); a model's config.pbtxt may "
                             "set its own (sixfold.warm_from)")
    tables.add_argument("--watch-deltas", metavar="DIR",
                        help="apply table-delta folders that appear in DIR, in sequence order, to the repository "
                             "models they name (docs/deltas.md); a bad one is logged and skipped")
    batching = p.add_argument_group("batching and admission")
    batching.add_argument("--max-batch-rows", type=int, default=1024, help="items per batch at most")
    batching.add_argument("--max-queue-delay-us", type=int, default=2000, help="batching window (microseconds)")
    batching.add_argument("--no-all-in-dispatch", action="store_true",
                          help="let every batch wait out the batching window (Triton's semantics); by default a "
                               "batch leaves once every request the clients keep outstanding is queued or running")
    batching.add_argument("--preferred-batch-rows", type=int, action="append", default=[], metavar="ROWS",
                          help="dispatch a batch as soon as it reaches ROWS items (repeatable; Triton's "
                               "preferred_batch_size)")
    batching.add_argument("--no-wait-rows", type=int, default=DEFAULT_NO_WAIT_ROWS, metavar="ROWS",
                          help="a batch of at least ROWS items leaves at once, without waiting out the batching "
                               f"window (default {DEFAULT_NO_WAIT_ROWS}: a batch that fills a card; 0: every batch "
                               "waits)")
    batching.add_argument("--max-inflight-batches", type=int, default=0,
                          help="batches running at once per model (0: cards + 1)")
    batching.add_argument("--max-queue-size", type=int, default=256,
                          help="requests waiting at most; more get RESOURCE_EXHAUSTED at once (0: unbounded)")
    batching.add_argument("--p99-ms", type=float, default=None, metavar="MS",
                          help=f"the p99 latency this deployment promises (default {SLA_P99_MS:g}: MLPerf DLRM's); "
                               "the work bound defaults to half of it and the queue timeout to at least 4x it, so a "
                               "loose SLA queues deeper instead of refusing. Unset (and no --max-queue-work-ms), a "
                               "request with a client deadline is admitted against half of that deadline: the SLA "
                               "its client states (docs/admission.md)")
    batching.add_argument("--max-queue-work-ms", type=float, default=None,
                          help="refuse a request (RESOURCE_EXHAUSTED) when the queued work ahead of it (its own not "
                               "counted) would take longer than this to serve (default: half of --p99-ms, "
                               f"{DEFAULT_QUEUE_WORK_MS:g} at the default SLA; 0: off)")
    batching.add_argument("--max-queue-bytes-mb", type=int, default=DEFAULT_QUEUE_BYTES >> 20,
                          help=f"MiB of inputs queued requests may hold (default {DEFAULT_QUEUE_BYTES >> 20}; "
                               "0: unbounded)")
    batching.add_argument("--default-timeout-us", type=int, default=None,
                          help="drop a request still queued after this long with DEADLINE_EXCEEDED "
                               f"(default {DEFAULT_TIMEOUT_US}, or 4x --p99-ms if longer; 0: only client deadlines)")
    batching.add_argument("--priority-levels", type=int, default=0,
                          help="request priority levels (1 = highest; 0: priorities off)")
    batching.add_argument("--default-priority-level", type=int, default=0,
                          help="level of a request that gives no priority (default: the lowest, --priority-levels)")
    logs = p.add_argument_group("logging and discovery")
    logs.add_argument("--log-level", type=_log_level, default="INFO", metavar="LEVEL",
                      help=f"least severe record logged: {', '.join(LEVELS)}")
    logs.add_argument("--log-format", choices=["text", "json"], default="text",
                      help="json: every line on stdout and stderr is one JSON object (the plan, READY, warnings of "
                           "the libraries too), for log collectors")
    logs.add_argument("--list-backends", action="store_true", help="show discovered backends and exit")
    logs.add_argument("--list-specs", action="store_true",
                      help="show every named device spec (sixfold's, vendor packages', backends' devices()) and exit")
    return p


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count >= 0")
    return value


def _limits(args: argparse.Namespace) -> TransportLimits:
    """The transports' limits from the flags; the bytes in flight are the queue's (--max-queue-bytes-mb)."""
    return TransportLimits(receive_bytes=args.max_queue_bytes_mb << 20, max_connections=args.max_connections,
                           header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s,
                           handshake_timeout_s=args.handshake_timeout_s, idle_timeout_s=args.grpc_idle_timeout_s,
                           max_connection_age_s=args.grpc_max_connection_age_s,
                           max_streams_per_connection=args.grpc_max_streams)


def _table_memory(text: str) -> int | float:
    from sixfold.backends.host.table_store import parse_table_memory
    try:
        value = parse_table_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value is None:
        raise argparse.ArgumentTypeError("give a size such as 4GiB or a share such as 10%")
    return value


def _cache_cap(text: str) -> int:
    """--cache-max-bytes: a size (64GiB) or 0 (no cap)."""
    from sixfold.backends.host.table_store import parse_bytes
    if text.strip() == "0":
        return 0
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; or 0 for no cap") from None


def _resolve_layout(args: argparse.Namespace, out: _Output) -> Any:
    """--backend auto/cpu as a layout (``sixfold.backends.cpu_layout``), said in the start-up output; None for a named
    backend. A repository's versions keep their plans' cards: auto serves them on simcard, as before."""
    from sixfold.backends.cpu_layout import resolve_layout

    if args.backend not in (AUTO, CPU):
        layout = None
    elif not args.model:
        layout = None
        args.backend = "simcard" if args.backend == AUTO else LANE_BACKEND
    else:
        layout = resolve_layout(args.backend, cards=args.cards, card_spec=args.card_spec)
        args.backend = layout.backend
        if layout.on_host:
            args.cards, args.card_spec = layout.cards, layout.card_spec
            if args.host_spec is None:
                args.host_spec = "auto"  # this host, calibrated once and cached: the lanes' host
        out.say(f"sixfold-serve: layout {layout.name}: {layout.reason}", "layout", layout=layout.name,
                backend=layout.backend, lanes=layout.cards, reason=layout.reason)
    if args.host_spec is None:
        args.host_spec = "host-cpu"
    return layout


def _default_card_spec(backend: str) -> str:
    """The first device the backend reports on this machine (a vendor's own card), else m2-card."""
    from sixfold.backends.registry import get_backend

    try:
        devices = get_backend(backend).devices()
    except Exception:  # noqa: BLE001 - an unusable backend is reported when the model loads
        devices = []
    return devices[0].name if devices else "m2-card"


_TOKENS = (("control", "--control-token", "SIXFOLD_CONTROL_TOKEN"),
           ("metrics", "--metrics-token", "SIXFOLD_METRICS_TOKEN"))


def _resolve_tokens(args: argparse.Namespace) -> list[str]:
    """Set ``args.control_token`` / ``args.metrics_token`` from the flag, its ``-file`` or the environment
    (in that order); UsageError for a flag given with its file, or a file that gives no token. Returns
    the warnings to log: one per token given in argv, which any local user can read in the process list."""
    warnings = []
    for kind, flag, env in _TOKENS:
        direct, path = getattr(args, f"{kind}_token"), getattr(args, f"{kind}_token_file")
        if direct is not None and path is not None:
            raise UsageError(f"{flag} and {flag}-file both given: give one ({flag}-file keeps the token out of "
                             "the process list)")
        if path is not None:
            token = read_token_file(path, f"{flag}-file")
        elif direct is not None:
            token = direct
            warnings.append(f"{flag} on the command line: any local user can read it in the process list "
                            f"(ps, /proc/PID/cmdline); give {flag}-file PATH or ${env} instead")
        else:
            token = os.environ.get(env)
        setattr(args, f"{kind}_token", token or None)
    return warnings


_TOKEN_OPTIONS = ("--control-token", "--control-token-file", "--metrics-token", "--metrics-token-file")


def _without_tokens(argv: list[str]) -> list[str]:
    """``argv`` less its token options (and their values): what the --workers workers get, the tokens
    going to them in their environment instead (``_token_env``), out of their process list."""
    def is_token_option(key: str) -> bool:  # argparse takes a unique prefix: --control-token-f is the file
        return key in _TOKEN_OPTIONS or any(o.endswith("-file") and o.startswith(key) and len(key) > len(o) - 5
                                            for o in _TOKEN_OPTIONS)
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith("--") and is_token_option(arg.split("=", 1)[0]):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def _token_env(args: argparse.Namespace) -> dict[str, str | None]:
    """The workers' token environment: each resolved token (None: unset it there)."""
    return {env: getattr(args, f"{kind}_token") for kind, _, env in _TOKENS}


def apply_sla(args: argparse.Namespace) -> None:
    """The admission knobs not given, from the SLA (``--p99-ms``): the work bound is half of it (the other half is
    the batching window and a large query's own service; 30 ms at MLPerf's 60), the queue timeout at least 4x it.
    With no SLA stated (neither flag), clients state their own: a request's deadline, halved, bounds its work."""
    if args.p99_ms is not None and not (math.isfinite(args.p99_ms) and args.p99_ms > 0):
        raise UsageError(f"--p99-ms {args.p99_ms:g}: give the p99 latency the deployment promises, in ms (> 0)")
    p99 = SLA_P99_MS if args.p99_ms is None else args.p99_ms
    args.deadline_work_share = (DEFAULT_QUEUE_WORK_MS / SLA_P99_MS
                                if args.p99_ms is None and args.max_queue_work_ms is None else 0.0)
    if args.max_queue_work_ms is None:
        args.max_queue_work_ms = DEFAULT_QUEUE_WORK_MS * p99 / SLA_P99_MS
    if args.default_timeout_us is None:
        args.default_timeout_us = max(DEFAULT_TIMEOUT_US, int(4 * p99 * 1e3))


def _check_before_loading(args: argparse.Namespace) -> dict[str, Any]:
    """Every mistake that can be seen in a moment, before partitioning and loading (seconds to minutes):
    the flags that go together, the files, the backend, the specs, TLS, and the ports. UsageError (or
    PortError) naming the flag and the fix; returns the backend options."""
    if args.model and args.model not in models.names():
        raise UsageError(f"--model {args.model}: unknown model {args.model!r}; built-in models: "
                         f"{', '.join(models.names())} (or --model-repository REPO for your own)")
    if args.cards is not None and args.cards < 1:
        raise UsageError(f"--cards {args.cards}: the dense partition needs at least 1 card")
    if args.model_control_mode == "explicit" and not args.control_token and not args.insecure_model_control:
        raise UsageError("--model-control-mode explicit lets clients load and unload models: give --control-token-file "
                         "PATH (or $SIXFOLD_CONTROL_TOKEN), or --insecure-model-control to allow it without a token")
    if args.model_repository:
        check_input_dir(args.model_repository, "--model-repository",
                        "the folder sixfold-partition --out wrote into (REPO/NAME/VERSION/plan.json)")
    if args.drain_seconds < 0:
        raise UsageError(f"--drain-seconds {args.drain_seconds:g}: give 0 or more seconds")
    apply_sla(args)
    if args.watch_deltas:
        if not args.model_repository:
            raise UsageError("--watch-deltas needs --model-repository (deltas are persisted in the version folders)")
        if Path(args.watch_deltas).exists() and not Path(args.watch_deltas).is_dir():
            raise UsageError(f"--watch-deltas {args.watch_deltas}: a file, not a folder; give the folder table "
                             "deltas are written into")
    from sixfold.backends.registry import discover
    infos = discover()
    info = infos.get(args.backend)
    if args.backend == CPU and args.card_spec is not None:
        raise UsageError(f"--backend cpu prices its lanes as this host's cores; --card-spec {args.card_spec} names "
                         "emulated cards: give --backend simcard for those")
    if args.backend not in (AUTO, CPU) and (info is None or not info.usable):
        why = "no such backend" if info is None else f"it is {info.status} here ({info.reason})"
        usable = ", ".join(name for name, i in infos.items() if i.usable) or "none"
        raise UsageError(f"--backend {args.backend}: {why}; usable backends: {usable} (see --list-backends)")
    from sixfold.backends.options import load_options_file, parse_option
    backend_options: dict[str, Any] = {}
    if args.backend_options_file:
        check_input_file(args.backend_options_file, "--backend-options-file",
                         "a JSON object of backend options (e.g. backends/specs/faults/flaky.json)")
        try:
            backend_options = load_options_file(args.backend_options_file)
        except ValueError as exc:
            raise UsageError(f"--backend-options-file {args.backend_options_file}: {error_text(exc)}; give a JSON "
                             "object of backend options") from None
    for text in args.backend_option:
        try:
            backend_options.update([parse_option(text)])
        except ValueError as exc:
            raise UsageError(f"--backend-option: {error_text(exc)}") from None
    check_spec(args.host_spec, "--host-spec")
    check_spec(args.card_spec, "--card-spec")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise UsageError("TLS needs both --tls-cert and --tls-key (the PEM certificate chain and its private key)")
    if args.tls_cert:
        _check_tls(args.tls_cert, args.tls_key)
    if args.warm_from:
        check_input_file(args.warm_from, "--warm-from", "a recording written by sixfold-loadgen --record")
    if args.as_engine is None:  # the engine binds loopback ports of its own; its supervisor checked the server's
        check_ports(args.host, {"gRPC (--grpc-port)": args.grpc_port,
                                "REST (--http-port)": None if args.http_port == -1 else args.http_port,
                                "metrics (--metrics-port)": None if args.metrics_port == -1 else args.metrics_port},
                    host_label="--host")
    return backend_options


def _check_tls(cert: str, key: str) -> None:
    """Both files readable, PEM, and the key the certificate's (as the TLS servers will load them)."""
    import ssl

    check_input_file(cert, "--tls-cert", "the server's PEM certificate chain")
    check_input_file(key, "--tls-key", "the PEM private key of --tls-cert")
    if "-----BEGIN CERTIFICATE-----" not in Path(cert).read_text(errors="replace"):
        raise UsageError(f"--tls-cert {cert}: no PEM certificate in it (-----BEGIN CERTIFICATE-----); give the "
                         "server's certificate chain, PEM-encoded")
    text = Path(key).read_text(errors="replace")
    if "-----BEGIN" not in text or "PRIVATE KEY-----" not in text:
        raise UsageError(f"--tls-key {key}: no PEM private key in it (-----BEGIN ... PRIVATE KEY-----); give the "
                         "certificate's private key, PEM-encoded")
    if "ENCRYPTED" in text:
        raise UsageError(f"--tls-key {key}: the key is encrypted; give it unencrypted (openssl pkey -in KEY -out "
                         "KEY.plain), readable by this user only")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key, password=lambda: b"")  # a key that wants a password fails, not prompts
    except ssl.SSLError as exc:
        why = "the key is not the certificate's" if "MISMATCH" in str(exc) else f"ssl: {exc.reason or exc}"
        raise UsageError(f"--tls-cert {cert} / --tls-key {key}: they do not load as a pair ({why}); give the "
                         "certificate chain and its own private key") from None


def _served_plan(served: Any) -> tuple[Any, Any]:
    """``served``'s plan as it runs: with a table memory, its host stage priced as tiered (row cache plus disk
    reads, ``sixfold.partitioner.pricing.tiers``) in a copy; and the all-resident estimates (None: no tiers)."""
    plan = served.plan
    budget = served.parameters.get("sixfold.table_memory")
    if not budget or not plan.tables.get("rows"):
        return plan, None
    from sixfold.partitioner.pricing.tiers import price_plan_tiers
    pricing = price_plan_tiers(plan, [budget])
    tiered = _tiered_estimates(plan.estimates, pricing.estimates[0].host_seconds, int(budget))
    return dataclasses.replace(plan, estimates=tiered, tiers=pricing), plan.estimates


def _tiered_estimates(est: Any, host_seconds: float, host_bytes: int) -> Any:
    """``est`` with the host's batch time and DRAM (the row cache's budget) replaced, and the bound,
    bottleneck and latency that follow (as ``sixfold.partitioner.pricing.estimate.estimate_plan`` derives them)."""
    per_device = [dataclasses.replace(d, batch_seconds=host_seconds, memory_bytes=min(d.memory_bytes, host_bytes))
                  if d.device == "host" else dataclasses.replace(d) for d in est.per_device]
    names = list(dict.fromkeys(p for d in per_device for p in d.partitions))
    rates = {name: sum(est.batch_rows / d.batch_seconds for d in per_device
                       if name in d.partitions and d.batch_seconds > 0) or float("inf") for name in names}
    bottleneck = min(rates, key=rates.get)
    bound = rates[bottleneck]
    for d in per_device:
        replicas = sum(1 for x in per_device if set(x.partitions) == set(d.partitions))
        d.utilisation = min(1.0, bound / replicas * d.batch_seconds / est.batch_rows) if est.batch_rows else 0.0
    latency = sum(max(d.batch_seconds for d in per_device if name in d.partitions) for name in names)
    return dataclasses.replace(est, per_device=per_device, bottleneck=bottleneck, throughput_items_per_s=bound,
                               latency_ms=latency * 1e3)


def _lone_query(served: Any, plan: Any) -> Any:
    """The plan's lone-query latency terms (``sixfold.partitioner.pricing.served_latency``) with this server's
    batching window where a lone query waits it (``all_in_dispatch`` off); None for a plan made before them."""
    from sixfold.partitioner.pricing.served_latency import ServedLatency

    if not plan.estimates.served:
        return None
    lone = ServedLatency.from_dict(plan.estimates.served)
    est = plan.estimates
    host_batch = sum(d.batch_seconds for d in est.per_device if d.device == "host")
    priced = lone.terms(est.batch_rows)["host"]
    rescaled = priced > 0 and host_batch > 0 and abs(host_batch / priced - 1) > 1e-6
    if rescaled:  # tiered or sharded: as the plan says
        lone = dataclasses.replace(lone, host=tuple((r, s * host_batch / priced) for r, s in lone.host))
    pooling = plan.tables.get("pooling") or []
    if pooling and not lone.ids_per_item:
        lone = dataclasses.replace(lone, ids_per_item=float(sum(pooling)))
    from sixfold.partitioner.pricing.host_stage_fit import load_host_stage, measured_lone_host
    host_fit = load_host_stage()
    if host_fit is not None and not rescaled and lone.ids_per_item and pooling:  # measured here, per id and bag
        lone = measured_lone_host(lone, host_fit, lone.ids_per_item, float(len(pooling)))
    emulated = _emulated_cards(getattr(served, "runtime", None))
    if emulated is not None:  # cards emulated on this host's cores: priced at the speed they reach here
        from sixfold.partitioner.pricing.emulated_card import emulated_lone_query
        from sixfold.partitioner.pricing.loaded_stages import served_stage_timing, timed_lone_host
        from sixfold.partitioner.pricing.served_latency import PRICE_ROWS
        timing = served_stage_timing(served.name, plan, served.runtime, emulated[0], PRICE_ROWS)
        if timing is not None:  # the loaded partitions as they ran here (cached by plan and machine)
            emulated = (dataclasses.replace(emulated[0], timing=timing), emulated[1])
            if not rescaled:
                lone = timed_lone_host(lone, timing)
        lone = emulated_lone_query(lone, *emulated)
    config = getattr(getattr(served, "batcher", None), "config", None)
    if config is not None and not config.all_in_dispatch:
        lone = dataclasses.replace(lone, window_s=config.max_queue_delay_microseconds / 1e6,
                                   no_wait_rows=config.no_wait_rows or 0)
    return lone


def _emulated_cards(runtime: Any) -> Any:
    """(``EmulatedCards``, the dense partition's FLOPs per item) when ``runtime``'s cards are simcards with one
    stage each (emulated on this host's cores, calibrated here once); None otherwise (real cards, cpu lanes)."""
    from sixfold.backends.builtin.simcard import SimCardExecutable

    cards = list(getattr(runtime, "cards", None) or [])
    if not cards or not all(isinstance(c, SimCardExecutable) for c in cards) or cards[0].artifact.flops_per_item <= 0:
        return None
    from sixfold.backends.emulation_calibrate import auto_emulation
    from sixfold.partitioner.pricing.emulated_card import EmulatedCards
    split = getattr(runtime, "card_split", None)
    return (EmulatedCards(auto_emulation(), len(cards), runtime.min_split_rows, split is None or split.splittable),
            float(cards[0].artifact.flops_per_item))


def _tiered_note(plan: Any, resident: Any) -> str:
    if resident is None:
        return ""
    tier = plan.tiers.estimates[0]
    return (f"priced with its table memory ({tier.budget_bytes / 2**20:,.1f} MiB: {tier.hit_rate:.1%} of lookups "
            f"from the row cache, {tier.reads_per_batch:,.0f} disk reads per batch); with every row in DRAM it "
            f"would be {resident.throughput_items_per_s:,.0f} items/s, {resident.latency_ms:.2f} ms")


def _plan_fields(plan: Any, resident: Any) -> dict[str, Any]:
    """The plan as a structure for a JSON log line: what runs where and the estimates (``plan.json`` holds all)."""
    est = plan.estimates
    fields: dict[str, Any] = {
        "model": plan.model, "strategy": plan.strategy, "batch_rows": est.batch_rows, "bottleneck": est.bottleneck,
        "throughput_items_per_s": round(est.throughput_items_per_s, 1), "latency_ms": round(est.latency_ms, 3),
        "devices": [{"device": d.device, "spec": plan.device(d.device).spec.name, "partitions": d.partitions,
                     "memory_bytes": d.memory_bytes, "memory_capacity": d.memory_capacity,
                     "batch_ms": round(d.batch_seconds * 1e3, 4), "transfer_ms": round(d.transfer_seconds * 1e3, 4),
                     "utilisation": round(d.utilisation, 4)} for d in est.per_device],
        "partitions": [{"name": p.name, "kind": p.kind, "format": p.format, "nodes": len(p.nodes),
                        "param_bytes": p.param_bytes, "flops_per_item": p.flops_per_item,
                        "bytes_per_item": p.bytes_per_item, "inputs": [i.name for i in p.inputs],
                        "outputs": [o.name for o in p.outputs]} for p in plan.partitions],
    }
    if plan.shards:
        fields["table_shards"] = len(plan.shards)
    if plan.tiers is not None:
        fields["tiers"] = plan.tiers.to_dict()
    if resident is not None:
        fields["resident"] = {"bottleneck": resident.bottleneck,
                              "throughput_items_per_s": round(resident.throughput_items_per_s, 1),
                              "latency_ms": round(resident.latency_ms, 3)}
    return fields


async def _serve(args: argparse.Namespace, out: _Output, backend_options: dict[str, Any]) -> int:
    from sixfold.server.loading.loader import load_builtin, load_from_repository
    from sixfold.server.loading.model_control import ModelControl
    from sixfold.server.loading.repository import ModelRepository
    from sixfold.backends.spec_catalog import load_spec

    # what a repository version's plan must agree with (None: not given; sixfold.server.loading.card_flags)
    given_cards = args.cards
    given_spec = load_spec(args.card_spec).name if args.card_spec is not None else None
    layout = _resolve_layout(args, out)
    if args.cards is None:
        args.cards = 6
    if args.card_spec is None:
        args.card_spec = _default_card_spec(args.backend)
    quiet = False
    metrics = ServerMetrics()
    batching = BatchingConfig(max_batch_rows=args.max_batch_rows,
                              max_queue_delay_microseconds=args.max_queue_delay_us,
                              max_queue_size=args.max_queue_size,
                              default_timeout_microseconds=args.default_timeout_us,
                              max_queue_work_ms=args.max_queue_work_ms, max_queue_bytes=args.max_queue_bytes_mb << 20,
                              deadline_work_share=args.deadline_work_share,
                              preferred_batch_rows=tuple(args.preferred_batch_rows),
                              no_wait_rows=args.no_wait_rows, all_in_dispatch=not args.no_all_in_dispatch,
                              max_inflight_batches=args.max_inflight_batches,
                              priority_levels=args.priority_levels,
                              default_priority_level=args.default_priority_level or args.priority_levels)
    config = ServerConfig(host=args.host, grpc_port=args.grpc_port,
                          http_port=None if args.http_port < 0 else args.http_port,
                          metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                          max_message_bytes=args.max_message_mb << 20, tls_cert=args.tls_cert, tls_key=args.tls_key,
                          control_token=args.control_token or None, metrics_token=args.metrics_token or None,
                          drain_seconds=args.drain_seconds, warmup=not args.no_warmup,
                          shared_memory=not args.no_shared_memory, engine_folder=args.as_engine,
                          limits=_limits(args))
    served_models = []
    if args.model:
        with out.status(f"partitioning {args.model} onto {args.cards} {args.backend} cards + host...", "loading",
                        model=args.model):
            served = await asyncio.to_thread(
                load_builtin, args.model, max_rows=args.max_rows, seed=args.seed, cards=args.cards,
                backend=args.backend, card_spec=args.card_spec, host_spec=args.host_spec, metrics=metrics,
                batching=batching,
                table_precision=args.table_precision, backend_options=backend_options,
                max_card_rows=args.max_card_batch_rows or None, sparse_on_cards=args.sparse_on_cards,
                dense_precision=args.dense_precision, host_dense_max_rows=args.host_dense_max_rows,
                min_split_rows=args.min_split_rows, card_timeout_multiple=args.card_timeout_multiple,
                card_timeout_floor_s=args.card_timeout_floor_ms / 1e3, allow_nonfinite=args.allow_nonfinite,
                table_memory=args.table_memory, cache_policy=args.table_cache_policy,
                host_chunk_rows=args.host_chunk_rows, warm_from=args.warm_from,
                card_scheduling=args.card_scheduling, cache_dir=args.cache_dir,
                lanes_on_host=layout is not None and layout.on_host)
        if not quiet:
            out.plan(served)
            if getattr(served, "split_decision", None) is not None:
                out.say(f"  {served.split_decision.describe()}", "split", model=served.name)
        served_models.append(served)
    core = InferenceCore(served_models)
    if args.model_repository:
        repository = ModelRepository(args.model_repository)

        def load(repo: ModelRepository, name: str, version: str):
            return load_from_repository(repo, name, version, backend=args.backend, metrics=metrics,
                                        cards=given_cards, card_spec=given_spec,
                                        batching=batching, backend_options=backend_options,
                                        max_card_rows=args.max_card_batch_rows or None,
                                        host_dense_max_rows=args.host_dense_max_rows,
                                        min_split_rows=args.min_split_rows,
                                        card_timeout_multiple=args.card_timeout_multiple,
                                        card_timeout_floor_s=args.card_timeout_floor_ms / 1e3,
                                        allow_nonfinite=args.allow_nonfinite, table_memory=args.table_memory,
                                        cache_policy=args.table_cache_policy,
                                        host_chunk_rows=args.host_chunk_rows, warm_from=args.warm_from,
                                        card_scheduling=args.card_scheduling, cache_dir=args.cache_dir)

        control = core.control = ModelControl(core, repository, load, explicit=args.model_control_mode == "explicit",
                                              warmup=not args.no_warmup)
        names = repository.names()
        if args.model_control_mode == "explicit" and "*" not in args.load_model:
            unknown = sorted(set(args.load_model) - set(names))
            if unknown:
                raise UsageError(f"--load-model {unknown}: not in {args.model_repository} (it has {names})")
            names = [n for n in names if n in args.load_model]
        for name in names:
            with out.status(f"loading {name} from {args.model_repository}...", "loading", model=name):
                await control.load(name)
            if not quiet:
                out.plan(core.model(name))
    if not core.versions and args.model_control_mode != "explicit":
        raise UsageError(f"--model-repository {args.model_repository}: no model folders in it "
                         "(REPO/NAME/VERSION/plan.json, as sixfold-partition --out writes)")
    server = SixfoldServer(core, config, metrics)
    port = await server.start()
    watcher = None
    if args.watch_deltas:
        from sixfold.server.deltas.delta_log import DeltaWatcher
        watcher = DeltaWatcher(core, args.watch_deltas)
        watcher.start()
    scheme = "https" if config.tls_cert else "http"
    metrics_at = f"{scheme}://{args.host}:{server.metrics_port}/metrics" if server.metrics_port is not None else "off"
    lanes = "cpu lanes" if layout is not None and layout.on_host else f"{args.backend} cards"
    serving = ", ".join(f"{m.name} (version {m.version}, {len(m.runtime.cards)} {lanes})"
                        for m in core.all_versions())
    rest_at = f"{scheme}://{args.host}:{server.http_port}/v2" if server.http_port is not None else "off"
    out.say(f"sixfold-serve: serving {serving or 'no model yet'} on {args.host}:{port} (gRPC); "
            f"REST {rest_at}; metrics {metrics_at}", "serving", grpc=f"{args.host}:{port}", rest=rest_at,
            metrics=metrics_at, models=[{"name": m.name, "version": m.version, "cards": len(m.runtime.cards)}
                                        for m in core.all_versions()])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # the first signal starts the drain; a second one ends its grace at once
        if stop.is_set():
            server.end_drain()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # before READY: a caller may signal as soon as it reads it
        loop.add_signal_handler(sig, on_signal)
    if args.as_engine is not None:  # the supervisor gives its loopback ports to the front ends
        out.protocol_line(worker_ports_line(port, server.http_port, server.metrics_port))
    # NOTE: with --log-format json, READY is a JSON object whose message is the same text
    # (sixfold.server.workers.process.ready_address reads both)
    out.say(f"{READY_PREFIX}{args.host}:{port}", "ready", grpc=f"{args.host}:{port}",
            http=None if server.http_port is None else f"{args.host}:{server.http_port}",
            metrics=None if server.metrics_port is None else f"{args.host}:{server.metrics_port}")
    await stop.wait()
    if args.drain_seconds > 0:
        out.say(f"sixfold-serve: draining (not ready; still serving for {args.drain_seconds:g} s)...", "draining",
                drain_seconds=args.drain_seconds)
    else:
        out.say("sixfold-serve: shutting down (answering queued requests)...", "stopping")
    if watcher is not None:
        await watcher.stop()
    await server.stop()
    out.say("sixfold-serve: stopped", "stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    parser.json_errors = _wants_json(argv)
    args = parser.parse_args(argv)
    if args.as_engine is not None:
        follow_supervisor()
    keep_freed_memory()  # first: it binds only threads that have not allocated yet (sixfold.server.memory.allocator)
    capture = configure_logging(args.log_level, args.log_format)
    try:
        return _main(args, argv, _Output(args.log_format))
    except _Supervise as become:
        if not as_program:  # main(argv) called from Python: supervise here, do not replace the caller's process
            args.as_supervisor = True
            return _main(args, argv, _Output(args.log_format))
        if capture is not None:
            capture.close()
            capture = None
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(sys.executable, become.argv)  # same pid: signals and the orchestrator still reach the server
        raise AssertionError("unreachable")
    finally:
        if capture is not None:
            capture.close()


class _Supervise(Exception):
    """``--workers N`` checked: this process becomes a lean supervisor (``--as-supervisor``) by exec, same pid.

    The checks loaded the backends (torch among them, ~180 MiB); a supervisor that only starts and watches
    processes should not hold that for the server's life. The tokens go to the environment, not the argv.
    """

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        super().__init__("becoming the --workers supervisor")
        for key, value in _token_env(args).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        # NOTE: as ``python .../sixfold-serve`` when started so: a container's health probe finds the server by
        # that name in the process list (docker/healthcheck.py)
        program = [sys.argv[0]] if Path(sys.argv[0]).name == "sixfold-serve" else ["-m", "sixfold.server.cli"]
        self.argv = [sys.executable, *program, *_without_tokens(argv), "--as-supervisor"]


def _main(args: argparse.Namespace, argv: list[str], out: _Output) -> int:
    if args.list_backends:
        from sixfold.backends.registry import describe
        print(describe())
        return 0
    if args.list_specs:
        from sixfold.backends.spec_catalog import describe_specs
        print(describe_specs())
        return 0
    if not args.model and not args.model_repository:
        out.error("give --model NAME or --model-repository REPO (or --list-backends); see sixfold-serve --help")
        return 2
    if args.workers < 1:
        out.error(f"--workers must be >= 1, got {args.workers}")
        return 2
    if args.cache_max_bytes is not None:  # read where cache entries are written (derived_cache); workers inherit it
        from sixfold.backends.host.derived_cache import CACHE_MAX_ENV
        os.environ[CACHE_MAX_ENV] = str(args.cache_max_bytes)
    try:
        for warning in _resolve_tokens(args):
            out.warning(warning)
        if not args.as_supervisor:
            backend_options = _check_before_loading(args)
    except (UsageError, OSError) as exc:
        out.error(error_text(exc))
        return 2
    if args.workers > 1 and args.as_engine is None and not args.as_supervisor:
        raise _Supervise(args, argv)
    if args.as_supervisor:  # checked by this process before its exec (_Supervise)
        from dataclasses import asdict

        from sixfold.server.workers.supervisor import serve_workers
        front_end = {"max_message_bytes": args.max_message_mb << 20, "drain_seconds": args.drain_seconds,
                     "arena_bytes": (args.max_queue_bytes_mb << 20) or (4 << 30), "limits": asdict(_limits(args))}
        children = [arg for arg in _without_tokens(argv) if arg != "--as-supervisor"]
        return serve_workers(children, args.workers, env=_token_env(args), host=args.host,
                             grpc_port=args.grpc_port, http_port=args.http_port, metrics_port=args.metrics_port,
                             tls_cert=args.tls_cert, tls_key=args.tls_key, metrics_token=args.metrics_token or None,
                             front_end=front_end, print_line=out.supervisor_line)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it
        run = asyncio.run
    try:
        return run(_serve(args, out, backend_options))
    except ServingError as exc:
        out.error(exc.message)
        return 2
    except (KeyError, ValueError, MemoryError, OSError, BackendError) as exc:
        out.error(error_text(exc))
        return 2

if __name__ == "__main__":
    sys.exit(main())
