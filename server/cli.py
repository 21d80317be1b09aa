"""sixfold-serve: serve a recommendation model on host + N cards over KServe v2 gRPC and REST until stopped."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from rich.console import Console

from sixfold import models
from sixfold.backends.api import BackendError

from sixfold.server.memory.allocator import keep_freed_memory
from sixfold.server.app import ServerConfig, SixfoldServer
from sixfold.server.scheduling.batcher import (DEFAULT_NO_WAIT_ROWS, DEFAULT_QUEUE_BYTES, DEFAULT_QUEUE_WORK_MS, DEFAULT_TIMEOUT_US,
                      BatchingConfig)
from sixfold.server.core import InferenceCore
from sixfold.server.errors import ServingError
from sixfold.server.observability.logs import configure_logging
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.workers.process import READY_PREFIX
from sixfold.server.execution.runtime import CARD_SCHEDULING, DEFAULT_CARD_SCHEDULING, DEFAULT_MIN_SPLIT_ROWS
from sixfold.server.workers.siblings import WorkerSet
from sixfold.server.workers.supervisor import follow_supervisor, worker_ports_line

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sixfold-serve", description=__doc__)
    p.add_argument("--model", help=f"built-in model to serve: {', '.join(models.names())}")
    p.add_argument("--model-repository", metavar="REPO",
                   help="serve the models in REPO (REPO/NAME/VERSION/plan.json, written by sixfold-partition --out)")
    p.add_argument("--model-control-mode", choices=["none", "explicit"], default="none",
                   help="none: load every repository model at start; explicit: clients load and unload models "
                        "(RepositoryModelLoad/Unload), and only --load-model ones load at start")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="with --model-control-mode explicit: load NAME at start ('*' for all; repeatable)")
    p.add_argument("--control-token", default=os.environ.get("SIXFOLD_CONTROL_TOKEN"),
                   help="bearer token model-control RPCs must carry (default: $SIXFOLD_CONTROL_TOKEN; unset: none)")
    p.add_argument("--insecure-model-control", action="store_true",
                   help="allow --model-control-mode explicit without --control-token (any client may then load "
                        "and unload models); without it such a server refuses to start")
    p.add_argument("--max-rows", type=int, default=None, help="cap every embedding table at R rows")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--cards", type=int, default=6, help="accelerator cards (default 6)")
    p.add_argument("--backend", default="simcard", help="card backend (see --list-backends; default simcard)")
    p.add_argument("--backend-option", action="append", default=[], metavar="KEY=VALUE",
                   help="option for the card backend, value read as JSON when it parses (repeatable)")
    p.add_argument("--backend-options-file", metavar="JSON",
                   help="backend options as a JSON object, e.g. backends/specs/faults/flaky.json for simcard")
    p.add_argument("--card-spec", default=None,
                   help="device spec name or JSON file for the cards (default: the first device the backend "
                        "reports, else m2-card; see --list-specs)")
    p.add_argument("--host-spec", default="host-cpu",
                   help="device spec name or JSON file for the host (e.g. one written by "
                        "'sixfold-partition calibrate'); prices the host stage in the printed plan")
    p.add_argument("--table-precision", default="fp32", choices=["fp32", "fp16", "int8", "int4"],
                   help="embedding tables row-wise precision on the host (default fp32)")
    p.add_argument("--dense-precision", default="fp32", choices=["fp32", "fp16", "int8"],
                   help="precision of the dense partition on the cards (built-in models; default fp32; "
                        "int8: dynamic quantization, ONNX Runtime cards)")
    p.add_argument("--sparse-on-cards", choices=["table", "row", "column", "auto"],
                   help="place embedding tables on the cards as table-, row- or column-wise shards "
                        "(built-in models; default: all tables on the host)")
    p.add_argument("--table-memory", type=_table_memory, default=None, metavar="BYTES",
                   help="keep embedding tables on disk behind a DRAM row cache of this size (512MiB, 4GiB, or a "
                        "share of the table bytes such as 10%%; default: every row resident). A model's "
                        "config.pbtxt may set its own (sixfold.table_memory)")
    p.add_argument("--table-cache-policy", choices=["tinylfu", "clock"], default="tinylfu",
                   help="row cache admission: tinylfu (a row enters on its fourth miss; default) or clock (every miss)")
    p.add_argument("--warm-from", metavar="RECORDING",
                   help="before serving, fill the row cache of models with a table memory from the queries of "
                        "this sixfold-loadgen --record file (docs/tiered-tables.md); a model's config.pbtxt may set "
                        "its own (sixfold.warm_from)")
    p.add_argument("--watch-deltas", metavar="DIR",
                   help="apply table-delta folders that appear in DIR, in sequence order, to the repository "
                        "models they name (docs/deltas.md); a bad one is logged and skipped")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes sharing the ports and the cards, each with its own event loop "
                        "(default 1; see docs/workers.md)")
    p.add_argument("--as-worker", default=None, help=argparse.SUPPRESS)  # FOLDER:INDEX:COUNT, set by --workers
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (0: pick a free one)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="KServe v2 REST port (default 8000, as Triton; 0: pick a free one; -1: off)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus port (-1: off)")
    p.add_argument("--tls-cert", help="PEM certificate chain: serve gRPC and REST over TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument("--metrics-token", default=os.environ.get("SIXFOLD_METRICS_TOKEN"),
                   help="bearer token a /metrics scrape must carry (default: $SIXFOLD_METRICS_TOKEN; unset: none); "
                        "with --tls-cert, /metrics is served over HTTPS either way")
    p.add_argument("--no-warmup", action="store_true",
                   help="serve each model without first running synthetic batches of 1..max-batch-rows rows through it "
                        "(by default they run before READY, so the first requests do not pay one-time costs)")
    p.add_argument("--no-shared-memory", action="store_true",
                   help="refuse Triton's system shared memory extension (on by default: co-located clients may "
                        "register /dev/shm segments and send tensors by region instead of over the socket)")
    p.add_argument("--drain-seconds", type=float, default=5.0,
                   help="on SIGTERM, report not ready and keep serving this long before refusing new requests, "
                        "so load balancers notice first (default 5; 0: refuse at once; a second SIGTERM ends it)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="score dense features that are NaN or infinite (default: refused with INVALID_ARGUMENT "
                        "naming the input and the first bad position)")
    p.add_argument("--max-message-mb", type=int, default=64, help="largest request/response in MiB (default 64)")
    p.add_argument("--max-batch-rows", type=int, default=1024, help="items per batch at most")
    p.add_argument("--max-card-batch-rows", type=int, default=256,
                   help="a card takes at most this many items per batch; a larger batch is split across cards, "
                        "which run its parts at once (default 256; 0: never split)")
    p.add_argument("--card-timeout-multiple", type=float, default=10.0,
                   help="a card is hung when a batch takes this many times its expected time (cost model; "
                        "default 10; 0: the floor alone); see docs/reliability.md")
    p.add_argument("--card-timeout-floor-ms", type=int, default=500,
                   help="shortest hang deadline of a card batch, milliseconds (default 500)")
    p.add_argument("--min-split-rows", type=int, default=DEFAULT_MIN_SPLIT_ROWS,
                   help="a batch of at least twice this many items is also split over cards (which: "
                        f"--card-scheduling), in equal parts of at least this many (default {DEFAULT_MIN_SPLIT_ROWS}; "
                        "0: only split batches over --max-card-batch-rows)")
    p.add_argument("--card-scheduling", choices=CARD_SCHEDULING, default=DEFAULT_CARD_SCHEDULING,
                   help="fifo: batches get the cards in arrival order, each split over as many as it can use "
                        "(waiting for them); greedy: split over the cards idle when it arrives, else whole on "
                        f"the least-loaded card (default {DEFAULT_CARD_SCHEDULING}); see docs/scheduling.md")
    p.add_argument("--max-queue-delay-us", type=int, default=2000, help="batching window (microseconds)")
    p.add_argument("--no-all-in-dispatch", action="store_true",
                   help="let every batch wait out the batching window (Triton's semantics); by default a batch "
                        "leaves once every request the clients keep outstanding is queued or running")
    p.add_argument("--max-queue-size", type=int, default=256,
                   help="requests waiting at most; more get RESOURCE_EXHAUSTED at once (0: unbounded)")
    p.add_argument("--max-queue-work-ms", type=float, default=DEFAULT_QUEUE_WORK_MS,
                   help="refuse a request (RESOURCE_EXHAUSTED) when the queued work ahead of it (its own not "
                        f"counted) would take longer than this to serve (default {DEFAULT_QUEUE_WORK_MS:g}: a 60 ms p99 SLA's queue budget; 0: off)")
    p.add_argument("--max-queue-bytes-mb", type=int, default=DEFAULT_QUEUE_BYTES >> 20,
                   help=f"MiB of inputs queued requests may hold (default {DEFAULT_QUEUE_BYTES >> 20}; 0: unbounded)")
    p.add_argument("--default-timeout-us", type=int, default=DEFAULT_TIMEOUT_US,
                   help="drop a request still queued after this long with DEADLINE_EXCEEDED "
                        f"(default {DEFAULT_TIMEOUT_US}; 0: only client deadlines)")
    p.add_argument("--preferred-batch-rows", type=int, action="append", default=[], metavar="ROWS",
                   help="dispatch a batch as soon as it reaches ROWS items (repeatable; Triton's preferred_batch_size)")
    p.add_argument("--host-chunk-rows", type=int, default=0, metavar="ROWS",
                   help="run the host stage of a batch of at least 2 x ROWS items in chunks of about ROWS, each "
                        "chunk's card stage overlapping the next chunk's host stage (default 0: whole batches)")
    p.add_argument("--no-wait-rows", type=int, default=DEFAULT_NO_WAIT_ROWS, metavar="ROWS",
                   help="a batch of at least ROWS items leaves at once, without waiting out the batching window "
                        f"(default {DEFAULT_NO_WAIT_ROWS}: a batch that fills a card; 0: every batch waits)")
    p.add_argument("--max-inflight-batches", type=int, default=0,
                   help="batches running at once per model (0: cards + 1)")
    p.add_argument("--priority-levels", type=int, default=0,
                   help="request priority levels (1 = highest; 0: priorities off)")
    p.add_argument("--default-priority-level", type=int, default=0,
                   help="level of a request that gives no priority (default: the lowest, --priority-levels)")
    p.add_argument("--host-dense-max-rows", type=int, default=-1,
                   help="batches of at most this many items run their dense part on the host CPU "
                        "(-1: tuned automatically from measured latencies; 0: never)")
    p.add_argument("--list-backends", action="store_true", help="show discovered backends and exit")
    p.add_argument("--list-specs", action="store_true",
                   help="show every named device spec (sixfold's, vendor packages', backends' devices()) and exit")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: one JSON object per line (for log collectors)")
    return p


def _worker_set(text: str | None) -> WorkerSet | None:
    if text is None:
        return None
    folder, index, count = text.rsplit(":", 2)
    return WorkerSet(Path(folder), int(index), int(count))


def _table_memory(text: str) -> int | float:
    from sixfold.backends.host.table_store import parse_table_memory
    try:
        value = parse_table_memory(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value is None:
        raise argparse.ArgumentTypeError("give a size such as 4GiB or a share such as 10%")
    return value


def _default_card_spec(backend: str) -> str:
    """The first device the backend reports on this machine (a vendor's own card), else m2-card."""
    from sixfold.backends.registry import get_backend

    try:
        devices = get_backend(backend).devices()
    except Exception:  # noqa: BLE001 - an unusable backend is reported when the model loads
        devices = []
    return devices[0].name if devices else "m2-card"


async def _serve(args: argparse.Namespace, console: Console) -> int:
    from sixfold.partitioner.report.explain import print_plan

    from sixfold.server.loading.loader import load_builtin, load_from_repository
    from sixfold.server.loading.model_control import ModelControl
    from sixfold.server.loading.repository import ModelRepository
    from sixfold.backends.options import load_options_file, parse_option

    if args.model_control_mode == "explicit" and not args.control_token and not args.insecure_model_control:
        raise ValueError("--model-control-mode explicit lets clients load and unload models: give --control-token "
                         "(or $SIXFOLD_CONTROL_TOKEN), or --insecure-model-control to allow it without a token")
    if args.drain_seconds < 0:
        raise ValueError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    if args.card_spec is None:
        args.card_spec = _default_card_spec(args.backend)
    backend_options = load_options_file(args.backend_options_file) if args.backend_options_file else {}
    backend_options.update(parse_option(text) for text in args.backend_option)
    workers = _worker_set(args.as_worker)
    if workers is not None and args.backend == "simcard":  # the workers' copies of a card are one card
        backend_options.setdefault("shared_timelines", str(workers.timelines))
    quiet = workers is not None and workers.index > 0  # worker 0 explains the plan for all
    metrics = ServerMetrics()
    batching = BatchingConfig(max_batch_rows=args.max_batch_rows,
                              max_queue_delay_microseconds=args.max_queue_delay_us,
                              max_queue_size=args.max_queue_size,
                              default_timeout_microseconds=args.default_timeout_us,
                              max_queue_work_ms=args.max_queue_work_ms, max_queue_bytes=args.max_queue_bytes_mb << 20,
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
                          shared_memory=not args.no_shared_memory, workers=workers)
    served_models = []
    if args.model:
        with console.status(f"partitioning {args.model} onto {args.cards} {args.backend} cards + host..."):
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
                card_scheduling=args.card_scheduling)
        if not quiet:
            print_plan(served.plan, console)
        served_models.append(served)
    core = InferenceCore(served_models)
    if args.model_repository:
        repository = ModelRepository(args.model_repository)

        def load(repo: ModelRepository, name: str, version: str):
            return load_from_repository(repo, name, version, backend=args.backend, metrics=metrics,
                                        batching=batching, backend_options=backend_options,
                                        max_card_rows=args.max_card_batch_rows or None,
                                        host_dense_max_rows=args.host_dense_max_rows,
                                        min_split_rows=args.min_split_rows,
                                        card_timeout_multiple=args.card_timeout_multiple,
                                        card_timeout_floor_s=args.card_timeout_floor_ms / 1e3,
                                        allow_nonfinite=args.allow_nonfinite, table_memory=args.table_memory,
                                        cache_policy=args.table_cache_policy,
                                        host_chunk_rows=args.host_chunk_rows, warm_from=args.warm_from,
                                        card_scheduling=args.card_scheduling)

        control = core.control = ModelControl(core, repository, load, explicit=args.model_control_mode == "explicit",
                                              warmup=not args.no_warmup)
        names = repository.names()
        if args.model_control_mode == "explicit" and "*" not in args.load_model:
            unknown = sorted(set(args.load_model) - set(names))
            if unknown:
                raise ValueError(f"--load-model {unknown}: not in {args.model_repository} (it has {names})")
            names = [n for n in names if n in args.load_model]
        for name in names:
            with console.status(f"loading {name} from {args.model_repository}..."):
                await control.load(name)
            if not quiet:
                print_plan(core.model(name).plan, console)
    if not core.versions and args.model_control_mode != "explicit":
        raise ValueError(f"no model to serve: {args.model_repository} has no model folders")
    if args.watch_deltas and not args.model_repository:
        raise ValueError("--watch-deltas needs --model-repository (deltas are persisted in the version folders)")
    server = SixfoldServer(core, config, metrics)
    port = await server.start()
    watcher = None
    if args.watch_deltas:
        from sixfold.server.deltas.delta_log import DeltaWatcher
        watcher = DeltaWatcher(core, args.watch_deltas)
        watcher.start()
    scheme = "https" if config.tls_cert else "http"
    metrics_at = f"{scheme}://{args.host}:{server.metrics_port}/metrics" if server.metrics_port is not None else "off"
    serving = ", ".join(f"{m.name} (version {m.version}, {len(m.runtime.cards)} {args.backend} cards)"
                        for m in core.all_versions())
    rest_at = f"{scheme}://{args.host}:{server.http_port}/v2" if server.http_port is not None else "off"
    console.print(f"sixfold-serve: serving {serving or 'no model yet'} on {args.host}:{port} (gRPC); "
                  f"REST {rest_at}; metrics {metrics_at}", soft_wrap=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:  # the first signal starts the drain; a second one ends its grace at once
        if stop.is_set():
            server.end_drain()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # before READY: a caller may signal as soon as it reads it
        loop.add_signal_handler(sig, on_signal)
    if workers is not None:  # the supervisor starts the other workers on the ports this one bound
        console.print(worker_ports_line(port, server.http_port, server.metrics_port), highlight=False)
    console.print(f"{READY_PREFIX}{args.host}:{port}", highlight=False)
    await stop.wait()
    if args.drain_seconds > 0:
        console.print(f"sixfold-serve: draining (not ready; still serving for {args.drain_seconds:g} s)...")
    else:
        console.print("sixfold-serve: shutting down (answering queued requests)...")
    if watcher is not None:
        await watcher.stop()
    await server.stop()
    console.print("sixfold-serve: stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.as_worker is not None:
        follow_supervisor()
    keep_freed_memory()  # first: it binds only threads that have not allocated yet (sixfold.server.memory.allocator)
    configure_logging(args.log_level, args.log_format)
    console = Console(stderr=False, highlight=False, width=None if sys.stdout.isatty() else 120)
    if args.list_backends:
        from sixfold.backends.registry import describe
        print(describe())
        return 0
    if args.list_specs:
        from sixfold.backends.spec_catalog import describe_specs
        print(describe_specs())
        return 0
    if not args.model and not args.model_repository:
        print("sixfold-serve: give --model NAME or --model-repository REPO (or --list-backends)", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"sixfold-serve: --workers must be >= 1, got {args.workers}", file=sys.stderr)
        return 2
    if args.workers > 1 and args.watch_deltas:
        print("sixfold-serve: --watch-deltas needs --workers 1 (each worker holds its own tables, and one delta "
              "log is kept per version)", file=sys.stderr)
        return 2
    if args.workers > 1 and args.as_worker is None:
        from sixfold.server.workers.supervisor import serve_workers
        return serve_workers(argv if argv is not None else sys.argv[1:], args.workers, host=args.host,
                             grpc_port=args.grpc_port, http_port=args.http_port, metrics_port=args.metrics_port,
                             tls_cert=args.tls_cert, tls_key=args.tls_key, metrics_token=args.metrics_token or None,
                             print_line=lambda text: print(text, flush=True))
    try:
        import uvloop
        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep serving without it
        run = asyncio.run
    try:
        return run(_serve(args, console))
    except ServingError as exc:
        print(f"sixfold-serve: {exc.message}", file=sys.stderr)
        return 2
    except (KeyError, ValueError, MemoryError, FileNotFoundError, OSError, BackendError) as exc:
        print(f"sixfold-serve: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
