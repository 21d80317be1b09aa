"""Latency-bounded throughput: the highest QPS whose p99 <= 60 ms, MLPerf DLRM query sizes.

For each model (dlrm-mlperf and rm2, every table capped at ``--max-rows``), one run measures, one
after another (one server alive at a time, so none shares the 2 cores with another):

  offline          in this process, no server: the unpartitioned torch model (``models.build``) on
                   requests from ``models.RequestGenerator`` at batch sizes 64..2048 items,
                   ``torch.inference_mode()``, torch threads = all cores; the best items/s (measured
                   before and after the servers, the better kept: the machine is shared), turned
                   into queries/s by dividing by the mean MLPerf query size (270 items). The limit of
                   this machine: what a user would do offline (the zoo models have no faster path:
                   no compiled or fused variant; eager torch is how they are meant to run).
  sixfold          ``sixfold-serve --model M --max-rows R`` in its own process, at its defaults: the
                   layout it picks for this host (docs/serving.md, "CPU host"), dynamic batching (1024
                   rows, 2 ms window), host-dense fallback tuned from measured latencies
  sixfold-cpu      the same on the cpu layout (``--backend cpu``: dense on one lane per usable core),
                   for the comparison with the default's emulated cards
  sixfold-nobatch  the same with ``--max-batch-rows 1 --max-queue-delay-us 0``: every request is its
                   own batch (a query larger than 1 row runs alone, no window); host-dense fallback
                   at its default too, and up to cards + 1 batches in flight as in ``sixfold``
  ideal            no server, simulated (``sixfold.loadgen.ideal.ideal_max_qps``): every query at offline's
                   best items/s, one after another in arrival order, no overhead. Queueing alone
                   keeps it below offline's q/s under a latency bound: it is the most any server can
                   reach here, and ``sixfold / ideal`` what sixfold leaves on the table
  fifo             the ideal's policy run for real (``bench/fifo_server.py``): the offline torch model
                   on all cores behind a bare grpc.aio server, one query at a time in arrival order, no
                   batching; it gets ``--ids-dtype`` as sixfold does. ``fifo / ideal`` is what this
                   machine (transport, the client on the same cores, jitter, per-query speed below the
                   best batch's) costs that policy; ``sixfold / fifo`` compares sixfold with it
  mlserver         Seldon MLServer 1.7 (``bench/mlserver/serve.py`` in ``.venv-mlserver``) serving
                   the same torch model (same name, rows and seed) with adaptive batching
                   (``--mlserver-batch-size`` requests, ``--mlserver-batch-time`` s); its runtime
                   (``bench/mlserver/runtime.py``) runs torch on 1 thread
  triton           NVIDIA Triton 2.51 (``bench/triton_peer/serve.py`` in ``.venv-triton``: the tritonserver of
                   the nvidia-pytriton 0.7.0 wheel, whose only backend is Python) serving the same torch
                   model on 1 thread per instance, ``OMP_WAIT_POLICY=PASSIVE``: 1 instance
  triton-2inst     the same with 2 instances (2 stub processes, a model copy each)
  triton-batch     1 instance with Triton's dynamic batcher; it batches whole requests only (its batcher
                   needs every input to share the first dimension, which rows and ids do not), so each
                   request goes with a leading batch dimension of 1 (``sixfold-loadgen --batch-dim``).
                   Triton's ONNX Runtime and libtorch backends are not in that wheel: these rows are
                   Triton's Python backend, not Triton at its fastest

Per server: a few concurrent queries whose scores are checked against the offline model
(``answers``); idle latency (one query at a time, median and min of 5) at 270 items (the mean MLPerf
query) and 700 (the largest, 5% of the mix, so the p99 query); 2 s of closed-loop warmup; then,
per latency bound (``--p99-ms``, default 60 and 250), ``sixfold.loadgen.find_max_qps_async`` (the
``--find-max-qps`` search of ``sixfold-loadgen``, run in this process): open-loop Poisson
arrivals, query sizes ``mlperf`` (100..700 items, MLPerf DLRM's 20-quantile table), the model's
own table rows, pooling and id skew, the same seeds for every server. Each step is a
``--warmup`` + ``--step`` s run; the search starts at 1/4 of the rate the server reached with 2
queries outstanding (the warmup), doubles (up to 4x offline), halves down to 1 q/s if the first
step fails, then bisects, at most ``--max-steps`` steps. At these rates a step holds some 10-150
queries, so its p99 is near its maximum: strict, and the same for every server; a passing step
with fewer than 40 queries is marked (†) and counts only as "at most" that rate for the goals.
After the searches, the server's own speed (``--saturation``: closed loops of MLPerf-sized queries
at 4, 8 and 16 outstanding, the best items/s kept) with the CPU each group of its threads used per
query there (``bench/_thread_cpu.py``: cards, host stage, event loop, the rest), and the ideal
server *at that speed*, which splits ``server / ideal`` into what the server loses to its speed
and what it loses to scheduling.
A bound below the server's fastest idle 700-item latency is not searched: every one of the
largest queries (5% of all) misses it with no queueing at all, so no rate meets it (reported
as 0). 60 ms is the requirement's bound; 250 ms is a second, looser one that shows how the
servers rank when 60 ms is out of reach on 2 cores.

Input order on the wire: the same tensors go to every server, but not in the same order (a KServe
v2 server takes inputs by name). sixfold gets loadgen's usual order (dense_features,
sparse_lengths, sparse_indices): its runtime reads a batch's item count from the first input
(``server/execution/runtime.py`` ``PlanRuntime.run``), so ids first would miscount items. MLServer gets
sparse_indices, sparse_lengths, dense_features: its adaptive batching splits a batched reply by
the *last* input's first dimension (``mlserver/batching/requests.py``
``BatchedRequests._merge_request_inputs`` overwrites ``_minibatch_sizes`` per input), which for
``sparse_indices`` is the id count, so with the ids last every reply fails to encode
(``struct.error: pack expected N items``). The bench checks both orders against MLServer.

    .venv/bin/python bench/latency_bounded.py                  # ~6-8 min on 2 cores; writes BENCHMARKS.md
    .venv/bin/python bench/latency_bounded.py --quick --no-write   # smoke run, ~1 min, dlrm-mlperf only
    .venv/bin/python bench/latency_bounded.py --models rm2 --skip-mlserver --runs 3 --p99-ms 60
    .venv/bin/python bench/latency_bounded.py --models dlrm-mlperf --skip-mlserver --skip-shm --runs 3 --p99-ms 60 \
        --serve-arg=--dense-precision --serve-arg=int8 --fifo-arg=--dense-precision --fifo-arg=int8 \
        --answer-tolerance 5e-3                                     # both sides at int8

``make mlserver-venv`` builds ``.venv-mlserver`` (mlserver 1.7 + torch CPU) once, ``make triton-venv``
``.venv-triton``; without them the MLServer and Triton rows say why they are missing and the rest is
reported. ``--triton triton,triton-batch`` picks Triton configurations, ``--skip-triton`` leaves them out. With ``--runs N`` the servers run
in a rotated order each run (offline first); figures are the median run's, ratios medians of
per-run ratios.

The servers, their start and stop, single queries on the wire, the rate search and the section
writing are ``bench/harness/``'s (shared with the other benches); the summary and the tables are
``bench/_latency_bounded_report.py``'s; this file measures.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sixfold import models  # noqa: E402
from bench._latency_bounded_report import (  # noqa: E402
    FLOOR_QPS, LABEL, LARGEST_QUERY, MEAN_QUERY_ITEMS, SECTION, SERVERS, TAKES_IDS_DTYPE, TRITONS, format_section,
    summarize)
from bench._thread_cpu import cpu_by_group, group_pids, thread_cpu  # noqa: E402
from bench.harness.peers import (  # noqa: E402
    fifo_server, mlserver_missing, mlserver_server, mlserver_version, sixfold_server, triton_missing, triton_server,
    triton_version)
from bench.harness.process import ServerProc  # noqa: E402
from bench.harness.report import machine_line, publish, write_json  # noqa: E402
from bench.harness.sweep import fmt_qps, mlperf_load, search_max_qps  # noqa: E402
from bench.harness.wire import DENSE_LAST, USUAL_ORDER, check_answers, idle_latency, inputs_in_order  # noqa: E402
from sixfold.loadgen import run_load_async  # noqa: E402
from sixfold.loadgen.config import IDS_DTYPES  # noqa: E402

CHANNELS_PER_WORKER = 8
WIRE_ORDER = {"sixfold": USUAL_ORDER, "sixfold-cpu": USUAL_ORDER, "sixfold-shm": USUAL_ORDER, "sixfold-nobatch": USUAL_ORDER, "sixfold-before": USUAL_ORDER,
              "fifo": USUAL_ORDER, "mlserver": DENSE_LAST, **{name: USUAL_ORDER for name in TRITONS}}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Traffic


def _ids(args: argparse.Namespace, name: str) -> str:
    """How a server gets its ids: --ids-dtype for this tree's sixfold servers and the FIFO server, int64 for
    the others."""
    return args.ids_dtype if name in TAKES_IDS_DTYPE else "int64"


def _client(name: str) -> str:
    """The loadgen transport a server is driven with: the shm variant sends tensors by region."""
    return "shm" if name == "sixfold-shm" else "raw"


def _batch_dim(name: str) -> bool:
    """Triton's dynamic batching takes each request as one batch element (``sixfold.loadgen.batch_dim``)."""
    return name == "triton-batch"


def _channels(args: argparse.Namespace, client: str) -> int:
    """Connections loadgen spreads a sixfold server's traffic over: several per worker (SO_REUSEPORT
    hashes each connection to one worker), one for a single process (as before the option)."""
    return CHANNELS_PER_WORKER * args.workers if args.workers > 1 and client in ("raw", "shm") else 1


async def search(url: str, model: str, cfg: models.ModelConfig, args: argparse.Namespace, bound: float, *,
                 lo: float, hi: float, seed: int, console: Any, client: str = "raw", ids_dtype: str = "int64",
                 batch_dim: bool = False) -> dict[str, Any]:
    """The find-max-qps search for one bound: the answer and its best step's figures."""
    config = mlperf_load(url, model, cfg, qps=lo, duration_s=args.step, warmup_s=args.warmup, seed=seed,
                         drain_timeout_s=10.0, client=client, channels=_channels(args, client), ids_dtype=ids_dtype,
                         batch_dim=batch_dim)
    return await search_max_qps(config, p99_ms=bound, lo=lo, hi=hi, floor=min(FLOOR_QPS, lo), step_s=args.step,
                                tolerance=args.tolerance, max_steps=args.max_steps, settle_s=2.0, console=console)


# ---------------------------------------------------------------------------------------------
# Offline limit


Queries = list[dict[str, np.ndarray]]


def measure_offline(name: str, cfg: models.ModelConfig, max_rows: int, batches: list[int], min_s: float,
                    check_sizes: tuple[int, ...]) -> tuple[dict[str, Any], Queries, list[np.ndarray]]:
    """Best items/s of the unpartitioned model over ``batches``, and reference answers for the check."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model = models.build(name, max_rows=max_rows, seed=0)
    gen = models.RequestGenerator.for_config(cfg, seed=7)
    per_batch = {}
    with torch.inference_mode():
        for b in batches:
            reqs = [[torch.from_numpy(r[k]) for k in USUAL_ORDER] for r in (gen.make(b), gen.make(b))]
            model(*reqs[0])  # warm
            times: list[float] = []
            t_end = time.perf_counter() + min_s
            while len(times) < 3 or time.perf_counter() < t_end:
                t0 = time.perf_counter()
                model(*reqs[len(times) % 2])
                times.append(time.perf_counter() - t0)
            per_batch[b] = b / statistics.median(times)
        check_gen = models.RequestGenerator.for_config(cfg, seed=11)
        queries = [check_gen.make(n) for n in check_sizes]
        expected = [model(*[torch.from_numpy(q[k]) for k in USUAL_ORDER]).numpy().copy() for q in queries]
    best = max(per_batch, key=per_batch.__getitem__)
    del model
    return ({"items_per_s": {b: round(v, 1) for b, v in per_batch.items()}, "best_batch": best,
             "best_items_per_s": round(per_batch[best], 1), "qps": per_batch[best] / MEAN_QUERY_ITEMS,
             "threads": torch.get_num_threads()}, queries, expected)


# ---------------------------------------------------------------------------------------------
# One model, one run


def _start(name: str, model: str, args: argparse.Namespace) -> ServerProc:
    if name == "fifo":
        return fifo_server(model, args.max_rows, args.fifo_arg)
    if name == "mlserver":
        return mlserver_server(model, args.max_rows, args.mlserver_batch_size, args.mlserver_batch_time)
    if name in TRITONS:
        return triton_server(name, model, args.max_rows)
    if name == "sixfold-before":
        return sixfold_server(model, args.max_rows, args.cards, batching=True, tree=args.baseline_tree,
                              extra=args.serve_arg)
    if name == "sixfold-cpu":
        return sixfold_server(model, args.max_rows, None, batching=True, workers=args.workers,
                              extra=["--backend", "cpu", *args.serve_arg], name=name)
    return sixfold_server(model, args.max_rows, args.cards, batching=name in ("sixfold", "sixfold-shm"),
                          workers=args.workers, extra=args.serve_arg)


def measure_server(name: str, model: str, run: int, args: argparse.Namespace, cfg: models.ModelConfig,
                   queries: list[dict[str, np.ndarray]], expected: list[np.ndarray], hi: float,
                   console: Any) -> dict[str, Any]:
    tag = f"[{model} run {run + 1}] {name}"
    server = _start(name, model, args)
    t0 = time.perf_counter()
    try:
        try:
            url = server.start(model)
        except RuntimeError as exc:
            log(f"{tag}: {exc}")
            return {"skipped": f"did not start: {' '.join(str(exc).split())[:300]}"}
        log(f"{tag}: serving at {url} ({time.perf_counter() - t0:.0f} s to start)")
        order = WIRE_ORDER[name]
        entry: dict[str, Any] = {"wire_order": list(order),
                                 "answers": asyncio.run(check_answers(url, model, queries, expected, order,
                                                                      _ids(args, name), args.answer_tolerance,
                                                                      batch_dim=_batch_dim(name)))}
        if order != USUAL_ORDER:
            entry["answers_usual_order"] = asyncio.run(check_answers(url, model, queries, expected, USUAL_ORDER,
                                                                     tolerance=args.answer_tolerance))
        log(f"{tag}: answers {entry['answers']}")
        gen = models.RequestGenerator.for_config(cfg, seed=13)
        entry["idle_ms"], entry["idle_ms_min"] = asyncio.run(idle_latency(
            url, model, gen, order, (int(MEAN_QUERY_ITEMS), LARGEST_QUERY), args.idle_repeats,
            client=_client(name), ids_dtype=_ids(args, name), batch_dim=_batch_dim(name)))
        log(f"{tag}: idle latency (ms by items) median {entry['idle_ms']}, min {entry['idle_ms_min']}")
        with inputs_in_order(order):
            warm = asyncio.run(run_load_async(mlperf_load(url, model, cfg, qps=0, duration_s=args.warmup_run,
                                                          concurrency=2, seed=1000 * run + 500,
                                                          client=_client(name), ids_dtype=_ids(args, name),
                                                          channels=_channels(args, _client(name)),
                                                          batch_dim=_batch_dim(name))))
            entry["closed_loop_qps"] = round(float(warm.achieved_qps), 2)
            # The search starts at a quarter of what 2 outstanding queries get: a rate near the answer for
            # the looser bound, whatever the (noisy) offline figure was.
            start = max(FLOOR_QPS, round(entry["closed_loop_qps"] / 4, 2))
            hi = round(max(hi, 4 * entry["closed_loop_qps"], start), 2)
            entry["bounds"] = {}
            for bound in args.p99_ms:
                if entry["idle_ms_min"][LARGEST_QUERY] > bound:
                    entry["bounds"][bound] = {"max_qps": 0.0, "infeasible": True}
                    log(f"{tag}: p99 <= {bound:g} ms: not searched, a {LARGEST_QUERY}-item query alone takes "
                        f"{entry['idle_ms_min'][LARGEST_QUERY]:g} ms at best")
                    continue
                result = asyncio.run(search(url, model, cfg, args, bound, lo=start, hi=hi, seed=1000 * run,
                                            console=console, client=_client(name), ids_dtype=_ids(args, name),
                                            batch_dim=_batch_dim(name)))
                entry["bounds"][bound] = result
                start = max(start, result["max_qps"] or 0.0)  # passes a looser bound too: start there
                log(f"{tag}: p99 <= {bound:g} ms: max {fmt_qps(result)} q/s")
            if args.saturation:  # after the searches: an overload must not change what they measure
                entry["saturation"] = measure_saturation(server, url, model, cfg, run, name, args)
        entry["alive_after"] = server.alive
        entry["server_errors_logged"] = server.errors
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        return entry
    finally:
        server.stop()


def measure_saturation(server: ServerProc, url: str, model: str, cfg: models.ModelConfig, run: int, name: str,
                       args: argparse.Namespace) -> dict[str, Any]:
    """The server's own best speed: closed loops of MLPerf-sized queries at each of ``args.saturation``
    outstanding (after the latency searches), and the CPU its threads used per query there, by stage
    (``bench._thread_cpu``).

    The ideal server at *this* speed (``ideal_max_qps`` of the best items/s) separates what a server
    loses to its speed (CPU per query: serving overhead, simulated cards on the host's cores) from
    what it loses to scheduling (queueing, batching, interference): sixfold / ideal = (ideal at own
    speed / ideal) x (sixfold / ideal at own speed).
    """
    tag = f"[{model} run {run + 1}] {name}"
    assert server.proc is not None  # started: measure_server got its url
    pids = group_pids(server.proc.pid)  # the server's processes (workers, MLServer's children) stay put
    steps = []
    for concurrency in args.saturation:
        before, t0 = thread_cpu(pids), time.perf_counter()
        # No warmup: the server is warm from the searches, and the CPU read here must be the measured
        # window's.
        report = asyncio.run(run_load_async(mlperf_load(
            url, model, cfg, qps=0, duration_s=args.saturation_s, concurrency=concurrency,
            seed=1000 * run + 700 + concurrency, client=_client(name), channels=_channels(args, _client(name)),
            ids_dtype=_ids(args, name), batch_dim=_batch_dim(name))))
        groups = cpu_by_group(before, thread_cpu(pids))
        wall = time.perf_counter() - t0
        answered = max(1, report.requests.get("ok", 0))
        steps.append({"concurrency": concurrency, "items_per_s": round(float(report.items_per_s), 1),
                      "qps": round(float(report.achieved_qps), 2), "p50_ms": report.latency_ms.get("p50"),
                      "errors": report.requests.get("errors", 0), "answered": answered,
                      "cpu_ms_per_query": {g: round(v / answered * 1e3, 2) for g, v in groups.items()},
                      "cores_busy": round(sum(groups.values()) / wall, 2)})
        log(f"{tag}: closed loop at {concurrency} outstanding: {report.items_per_s:,.0f} items/s, "
            f"{sum(groups.values()) / answered * 1e3:.1f} core-ms a query on {steps[-1]['cores_busy']} cores")
    best = max(steps, key=lambda st: st["items_per_s"] if not st["errors"] else 0.0)
    return {"steps": steps, "best": best}


def run_model(model: str, run: int, args: argparse.Namespace, console: Any) -> dict[str, Any]:
    cfg = models.get_config(model, max_rows=args.max_rows)
    log(f"[{model} run {run + 1}] offline: batches {args.offline_batches}")
    offline, queries, expected = measure_offline(model, cfg, args.max_rows, args.offline_batches, args.offline_s,
                                                 args.check_sizes)
    log(f"[{model} run {run + 1}] offline: best {offline['best_items_per_s']:,.0f} items/s at batch "
        f"{offline['best_batch']} = {offline['qps']:.2f} q/s")
    hi = round(offline["qps"] * 4, 2)
    names = [s for s in SERVERS if not ((s == "mlserver" and args.skip_mlserver)
                                        or (s == "sixfold-nobatch" and args.skip_nobatch)
                                        or (s == "sixfold-cpu" and args.skip_cpu)
                                        or (s == "sixfold-shm" and args.skip_shm)
                                        or (s == "fifo" and args.skip_fifo)
                                        or (s == "sixfold-before" and not args.baseline_tree)
                                        or (s in TRITONS and (args.skip_triton or s not in args.triton)))]
    k = run % len(names)
    run_order = names[k:] + names[:k]
    result: dict[str, Any] = {"offline": offline, "order": ["offline", *run_order], "servers": {}}
    for name in run_order:
        missing = mlserver_missing() if name == "mlserver" else triton_missing() if name in TRITONS else None
        if missing:
            result["servers"][name] = {"skipped": missing}
            log(f"[{model} run {run + 1}] {name}: skipped: {missing}")
            continue
        result["servers"][name] = measure_server(name, model, run, args, cfg, queries, expected, hi, console)
    if args.offline_again:
        # The machine is shared and noisy: measure the limit again after the servers, keep the better one.
        again, _, _ = measure_offline(model, cfg, args.max_rows, args.offline_batches, args.offline_s, ())
        log(f"[{model} run {run + 1}] offline again: best {again['best_items_per_s']:,.0f} items/s at batch "
            f"{again['best_batch']}")
        result["order"].append("offline")
        result["offline_runs"] = [offline, again]
        if again["qps"] > offline["qps"]:
            result["offline"] = again
    return result


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=None, help="comma-separated (default dlrm-mlperf,rm2; --quick: dlrm-mlperf)")
    p.add_argument("--max-rows", type=int, default=None, help="rows per table at most (default 50000; --quick 20000)")
    p.add_argument("--cards", type=int, default=None,
                   help="--cards of the sixfold servers (default: none given, sixfold-serve's own layout for this host)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes of each sixfold server (sixfold-serve --workers; default 1: "
                        "on 2 cores more cannot help; on a bigger host, try one per spare core)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more sixfold-serve argument for every sixfold server, e.g. "
                        "--serve-arg=--backend-option --serve-arg=intra_op_threads=2 (repeatable)")
    p.add_argument("--p99-ms", type=_floats, default=None,
                   help="latency bounds, comma-separated; the first one is the goals' (default 60,250; --quick 60)")
    p.add_argument("--runs", type=int, default=1, help="repeat everything, servers in a rotated order (default 1)")
    p.add_argument("--step", type=float, default=None, help="measured seconds per search step (default 5; --quick 2)")
    p.add_argument("--warmup", type=float, default=None,
                   help="warmup seconds before each step (default 1; --quick 0.5)")
    p.add_argument("--max-steps", type=int, default=None, help="search steps per bound at most (default 8; --quick 3)")
    p.add_argument("--tolerance", type=float, default=None, help="bisection stops within this fraction (default 0.15)")
    p.add_argument("--offline-batches", type=_ints, default=None,
                   help="offline batch sizes in items (default 64,128,256,512,1024,2048)")
    p.add_argument("--saturation", type=_ints, default=None,
                   help="closed loops at these many outstanding queries measure each server's own best speed "
                        "and CPU per query by stage, for the ideal server at that speed (default 4,8,16; "
                        "--quick 8; 0: none)")
    p.add_argument("--saturation-s", type=float, default=None,
                   help="measured seconds of each closed loop (default 5; --quick 2)")
    p.add_argument("--skip-mlserver", action="store_true", help="leave MLServer out")
    p.add_argument("--skip-triton", action="store_true", help="leave Triton out")
    p.add_argument("--triton", type=lambda t: tuple(x.strip() for x in t.split(",") if x.strip()),
                   default=TRITONS, help=f"Triton configurations to run (default: {','.join(TRITONS)})")
    p.add_argument("--skip-nobatch", action="store_true", help="leave sixfold without batching out")
    p.add_argument("--skip-cpu", action="store_true",
                   help="leave out sixfold on the cpu layout (--backend cpu)")
    p.add_argument("--fifo-arg", action="append", default=[], metavar="ARG",
                   help="one more bench/fifo_server.py argument, e.g. --fifo-arg=--dense-precision --fifo-arg=int8 "
                        "beside --serve-arg=--dense-precision --serve-arg=int8 (repeatable)")
    p.add_argument("--answer-tolerance", type=float, default=1e-3,
                   help="largest |score - offline score| a server's answers may show (default 1e-3; raise it "
                        "with a reduced precision, e.g. 5e-3 with --serve-arg=--dense-precision --serve-arg=int8)")
    p.add_argument("--skip-fifo", action="store_true",
                   help="leave out the measured FIFO server (bench/fifo_server.py: the ideal's policy run here)")
    p.add_argument("--skip-shm", action="store_true",
                   help="leave out sixfold driven through system shared memory (loadgen --client shm)")
    p.add_argument("--ids-dtype", choices=IDS_DTYPES, default="int64",
                   help="sparse_indices as this tree's sixfold servers get them (default int64; int32: half the "
                        "bytes); --baseline-tree's server and MLServer always get int64")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="also serve with the code in DIR (e.g. `git archive COMMIT | tar -x -C DIR`), first on "
                        "PYTHONPATH with this venv: 'sixfold-before', in the same rotated runs as 'sixfold'")
    p.add_argument("--mlserver-batch-size", type=int, default=8, help="MLServer max_batch_size, requests (default 8)")
    p.add_argument("--mlserver-batch-time", type=float, default=0.004,
                   help="MLServer max_batch_time, seconds (default 0.004)")
    p.add_argument("--quick", action="store_true", help="a smoke run of about 1 minute (dlrm-mlperf, 2 s steps)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    p.add_argument("--json", help="write every figure (all steps of every search) here")
    args = p.parse_args(argv)
    q = args.quick
    args.models = [m for m in (args.models or ("dlrm-mlperf" if q else "dlrm-mlperf,rm2")).split(",") if m]
    args.max_rows = args.max_rows or (20_000 if q else 50_000)
    args.p99_ms = args.p99_ms or ([60.0] if q else [60.0, 250.0])
    args.step = args.step or (2.0 if q else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if q else 1.0)
    args.max_steps = args.max_steps or (3 if q else 8)
    args.tolerance = args.tolerance or (0.5 if q else 0.15)
    args.offline_batches = args.offline_batches or ([256, 1024] if q else [64, 128, 256, 512, 1024, 2048])
    args.offline_s = 0.3 if q else 1.0
    args.warmup_run = 1.0 if q else 2.0
    args.idle_repeats = 3 if q else 5
    args.offline_again = not q
    if args.ids_dtype != "int64":
        for name in TAKES_IDS_DTYPE:
            LABEL[name] += f", {args.ids_dtype.upper()} ids"
    args.check_sizes = (100, 270, 700)
    args.saturation = [c for c in (args.saturation if args.saturation is not None else ([8] if q else [4, 8, 16]))
                       if c > 0]
    args.saturation_s = args.saturation_s or (2.0 if q else 5.0)
    for m in args.models:
        models.get_config(m)  # an unknown name fails here, listing the names that exist

    # SIGTERM runs the finally blocks that stop the servers (SIGKILL is covered by PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    ml = "MLServer not installed" if mlserver_missing() else f"mlserver {mlserver_version()}"
    triton = "Triton not installed" if triton_missing() else triton_version()
    unknown = sorted(set(args.triton) - set(TRITONS))
    if unknown:
        p.error(f"--triton {','.join(unknown)}: unknown configuration; known: {','.join(TRITONS)}")
    load_at_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in args.models}
    for run in range(args.runs):
        for model in args.models:
            results[model].append(run_model(model, run, args, console))
    wall = time.perf_counter() - t0
    machine = machine_line(f"torch {torch.__version__}", ml, triton,
                           f"load average {load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    summary = summarize(results, args)
    text = format_section(summary, results, args, argv, wall, machine)
    publish(SECTION, text, write=not args.no_write)
    if args.json:
        write_json(args.json, {"args": vars(args), "results": results, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
