"""Where a query's time goes at MLPerf sizes: per-request stage times of a real sixfold-serve under load.

Starts ``sixfold-serve`` (through this file's ``--traced-serve`` mode: the server's own ``main``,
with its servicer and model wrapped to stamp each request, nothing else changed), drives it with
``loadgen`` (open-loop Poisson, MLPerf query sizes, the model's own table rows) at each ``--qps``,
and prints p50/p99 of each stage, per request:

    decode     protobuf -> arrays (``decode_inputs``)
    validate   shape/dtype/id range checks and enqueue (``ServedModel.infer`` up to the batcher)
    queue      in the batcher's queue until its batch starts
    host       the batch's host (embedding) stage
    host_wait  the part of it spent waiting for the host stage's worker, busy with earlier batches
    card       the batch's card stage (split over cards, or on the host for small batches)
    card_wait  the part of it spent waiting for cards held by earlier batches (--card-scheduling fifo)
    finish     batch done -> the request's coroutine resumes (outputs split, futures resolved)
    encode     arrays -> protobuf
    wire       the client's latency (from the scheduled send) less the server's (decode..encode):
               gRPC transport both ways, the client's encode/decode and send lag

    .venv/bin/python bench/latency_breakdown.py --model dlrm-mlperf --qps 5,15,25 --duration 15
    .venv/bin/python bench/latency_breakdown.py --model rm2 --qps 5,10 -- --max-batch-rows 1
    .venv/bin/python bench/latency_breakdown.py --model rm2 --qps 24 --client shm   # ids by shared memory

With ``--timeline PNG`` it also draws, for the last rate, every request within ``--window-ms`` of
the slowest one (after the warmup): one bar per request, coloured by stage, so a burst shows as the
queries that overlapped and the stage that stretched (with ``--rounds``/``--tree``, one file per run:
``PNG`` gets ``-N`` before its suffix). ``--trace-json`` keeps the raw per-request stamps.

    .venv/bin/python bench/latency_breakdown.py --model rm2 --qps 16 --duration 15 --timeline runs/rm2-16qps.png

Arguments after ``--`` go to ``sixfold-serve``. The machine is whatever it is: say its load with
the figures (printed at start and end).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

STAGES = ("decode", "validate", "queue", "host", "host_wait", "card", "card_wait", "finish", "encode")
"""``host_wait`` is the part of ``host`` spent waiting for the host stage's worker (behind other batches);
``card_wait`` the part of ``card`` spent waiting for cards (``--card-scheduling fifo``)."""


def traced_serve(argv: list[str], out: str) -> int:
    """Run sixfold-serve's main with per-request stamps; write them to ``out`` (JSON) on SIGUSR1."""
    tree = os.environ.get("SIXFOLD_BREAKDOWN_TREE")
    if tree:  # serve another tree's code (a before/after comparison)
        sys.path.insert(0, tree)
    from sixfold.server.model import served as model_mod
    from sixfold.server.transport import grpc_servicer as servicer_mod
    from sixfold.server.cli import main

    records: list[tuple] = []
    orig_decode = servicer_mod.decode_inputs
    orig_encode = servicer_mod.encode_response
    cls = model_mod.ServedModel
    orig_infer = cls.infer
    current: dict[int, dict[str, float]] = {}

    def decode(request, *a, **k):  # noqa: ANN001, ANN002, ANN003
        t0 = time.perf_counter()
        inputs = orig_decode(request, *a, **k)
        t1 = time.perf_counter()
        current[id(inputs)] = {"t0": t0, "decoded": t1}
        return inputs

    from sixfold.server.scheduling.batcher import DynamicBatcher

    orig_enqueue = DynamicBatcher.enqueue

    def enqueue(self, inputs, *a, **k):  # noqa: ANN001, ANN002, ANN003
        stamp = current.get(id(inputs))
        queued = time.perf_counter()
        item = orig_enqueue(self, inputs, *a, **k)
        if stamp is not None:
            stamp["queued"], stamp["item"] = queued, item
        return item

    async def infer(self, inputs, requested, timeout_s=None, priority=0):  # noqa: ANN001
        try:
            outputs = await orig_infer(self, inputs, requested, timeout_s, priority)
        finally:
            stamp = current.pop(id(inputs), None)
        done = time.perf_counter()
        item = None if stamp is None else stamp.pop("item", None)
        if item is not None and item.info is not None:
            info = item.info
            stamp.update(done=done, queue_s=info.queue_s, host_s=info.timings.get("host_s", 0.0),
                         card_s=info.timings.get("card_s", 0.0), rows=item.rows, batch_rows=info.rows,
                         batch_requests=info.requests, on_host=info.timings.get("dense_on_host", 0.0),
                         host_wait_s=info.timings.get("host_wait_s", 0.0),
                         card_wait_s=info.timings.get("card_wait_s", 0.0))
            last[0] = stamp
        return outputs

    last: list[Any] = [None]

    def encode(*a, **k):  # noqa: ANN002, ANN003
        reply = orig_encode(*a, **k)
        if last[0] is not None:
            s = last[0]
            last[0] = None
            s["encoded"] = time.perf_counter()
            records.append(tuple(s.get(k, 0.0) for k in ("t0", "decoded", "queued", "queue_s", "host_s", "card_s",
                                                         "done", "encoded", "rows", "batch_rows", "batch_requests",
                                                         "on_host", "host_wait_s", "card_wait_s")))
        return reply

    servicer_mod.decode_inputs = decode
    servicer_mod.encode_response = encode
    cls.infer = infer
    DynamicBatcher.enqueue = enqueue

    def dump(*_: Any) -> None:
        with open(out, "w") as f:
            json.dump(records, f)
        os._exit(0)

    signal.signal(signal.SIGUSR1, lambda *_: dump())
    return main(argv)


TIMELINE_COLOURS = {"decode": "#9467bd", "validate": "#8c564b", "queue": "#c7c7c7",
                    "host wait": "#aec7e8", "host": "#1f77b4", "card wait": "#ffbb78", "card": "#ff7f0e",
                    "finish": "#2ca02c",
                    "encode": "#17becf"}


def plot_timeline(records: list[list[float]], path: str | Path, *, warmup_s: float, window_ms: float,
                  title: str) -> dict[str, float]:
    """Draw the requests within ``window_ms`` of the slowest one (arrived after ``warmup_s``); returns that one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = np.asarray(records, dtype=float)
    origin = r[0, 0]
    steady = np.flatnonzero(r[:, 0] - origin >= warmup_s)
    pick = steady if len(steady) else np.arange(len(r))
    slowest = int(pick[np.argmax(r[pick, 7] - r[pick, 0])])
    centre = r[slowest, 0]
    near = [i for i in range(len(r)) if abs(r[i, 0] - centre) * 1e3 <= window_ms]
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(near) + 1.6))
    for row, i in enumerate(near):
        t0, decoded, queued, queue_s, host_s, card_s, done, encoded = r[i, :8]
        wait = r[i, 12] if r.shape[1] > 12 else 0.0
        card_wait = r[i, 13] if r.shape[1] > 13 else 0.0
        start = queued + queue_s
        cards = start + host_s
        spans = {"decode": (t0, decoded), "validate": (decoded, queued), "queue": (queued, start),
                 "host wait": (start, start + wait), "host": (start + wait, cards),
                 "card wait": (cards, cards + card_wait), "card": (cards + card_wait, cards + card_s),
                 "finish": (start + host_s + card_s, done), "encode": (done, encoded)}
        for stage, (a, b) in spans.items():
            if b > a:
                ax.barh(row, (b - a) * 1e3, left=(a - centre) * 1e3, color=TIMELINE_COLOURS[stage],
                        edgecolor="black" if i == slowest else "none", linewidth=0.6)
        ax.text((encoded - centre) * 1e3 + 1, row, f"{(encoded - t0) * 1e3:.0f} ms", va="center", fontsize=7)
    ax.set_yticks(range(len(near)), [f"{int(r[i, 8])} items (batch {int(r[i, 9])})" for i in near], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the slowest request's arrival at the server")
    ax.set_title(title, fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in TIMELINE_COLOURS.values()]
    ax.legend(handles, list(TIMELINE_COLOURS), ncol=len(handles), fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.12 - 0.6 / max(1, len(near))), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"at_s": float(centre - origin), "server_ms": float((r[slowest, 7] - r[slowest, 0]) * 1e3),
            "items": float(r[slowest, 8]), "requests_drawn": float(len(near))}


def breakdown(records: list[list[float]]) -> dict[str, Any]:
    r = np.asarray(records, dtype=float)
    if not len(r):
        return {}
    t0, decoded, queued, queue_s, host_s, card_s, done, encoded, rows = (r[:, i] for i in range(9))
    batch_start = queued + queue_s  # NOTE: queue_s counts from the batcher's clock at enqueue
    host_wait = r[:, 12] if r.shape[1] > 12 else np.zeros(len(r))
    card_wait = r[:, 13] if r.shape[1] > 13 else np.zeros(len(r))  # waiting for cards (--card-scheduling fifo)
    stages = {"decode": decoded - t0, "validate": queued - decoded, "queue": queue_s, "host": host_s,
              "host_wait": host_wait, "card": card_s, "card_wait": card_wait,
              "finish": done - batch_start - host_s - card_s, "encode": encoded - done, "server": encoded - t0}
    out: dict[str, Any] = {"requests": len(r), "rows_mean": float(rows.mean()),
                           "batch_rows_mean": float(r[:, 9].mean()), "batch_requests_mean": float(r[:, 10].mean()),
                           "dense_on_host_share": float(r[:, 11].mean())}
    for name, v in stages.items():
        out[name] = {"p50": float(np.percentile(v, 50) * 1e3), "p99": float(np.percentile(v, 99) * 1e3),
                     "mean": float(v.mean() * 1e3)}
    big = rows >= 600
    if big.any():
        out["700_items"] = {name: float(np.median(v[big]) * 1e3) for name, v in stages.items()}
    # the slowest 1% of requests by server time: their mean stage times
    k = max(1, len(r) // 100)
    worst = np.argsort(stages["server"])[-k:]
    out["slowest_1pct_mean"] = {name: float(v[worst].mean() * 1e3) for name, v in stages.items()}
    out["slowest_1pct_rows"] = float(rows[worst].mean())
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "--traced-serve":
        return traced_serve(argv[2:], argv[1])
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dlrm-mlperf")
    p.add_argument("--max-rows", type=int, default=50_000)
    p.add_argument("--cards", type=int, default=6)
    p.add_argument("--qps", default="15")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--client", choices=("raw", "shm"), default="raw",
                   help="loadgen's transport: raw gRPC bytes (default) or tensors in system shared memory")
    p.add_argument("--ids-dtype", choices=("int64", "int32"), default="int64",
                   help="sparse_indices on the wire (default int64; int32: half the bytes, every --tree must take them)")
    p.add_argument("--tree", action="append", default=[], metavar="DIR",
                   help="also serve the code in DIR (e.g. `git archive COMMIT | tar -x -C DIR`); repeatable; "
                        "'.' is this tree. With --rounds, the trees alternate at each rate, order rotated per round")
    p.add_argument("--rounds", type=int, default=1, help="repeat every (rate, tree) this many times")
    p.add_argument("--timeline", metavar="PNG", help="draw the requests around the slowest one of each run here")
    p.add_argument("--window-ms", type=float, default=250.0, help="--timeline: requests this close to the slowest")
    p.add_argument("--trace-json", metavar="FILE", help="keep every request's raw stamps (all runs) here")
    args = p.parse_args(argv)

    from sixfold import models
    from bench.harness.sweep import mlperf_load
    from sixfold.loadgen import run_load_async

    cfg = models.get_config(args.model, max_rows=args.max_rows)
    results = []
    traces: list[dict[str, Any]] = []
    trees = args.tree or ["."]
    runs = []
    for qps in [float(q) for q in args.qps.split(",")]:
        for r in range(args.rounds):
            k = r % len(trees)
            runs += [(qps, tree) for tree in trees[k:] + trees[:k]]
    for qps, tree in runs:
        trace = f"/tmp/sixfold-breakdown-{os.getpid()}.json"
        env = {**os.environ}
        if tree != ".":
            env["SIXFOLD_BREAKDOWN_TREE"] = str(Path(tree).resolve())
        serve = [sys.executable, __file__, "--traced-serve", trace, "--model", args.model, "--max-rows",
                 str(args.max_rows), "--cards", str(args.cards), "--host", "127.0.0.1", "--grpc-port", "0",
                 "--metrics-port", "-1", "--http-port", "-1", "--drain-seconds", "0", *extra]
        log_path = Path(trace).with_suffix(".log")
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(serve, stdout=log_file, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
        url = ""
        while not url and proc.poll() is None:
            time.sleep(0.2)
            for line in log_path.read_text().splitlines():
                if line.startswith("READY grpc="):
                    url = line.split("=", 1)[1].strip()
        if not url:
            raise SystemExit(f"server did not start: {proc.poll()}")
        load_before = os.getloadavg()[0]
        config = mlperf_load(url, args.model, cfg, qps=qps, duration_s=args.duration, warmup_s=args.warmup,
                             seed=args.seed, drain_timeout_s=10.0, client=args.client, ids_dtype=args.ids_dtype)
        report = asyncio.run(run_load_async(config))
        load_after = os.getloadavg()[0]
        proc.send_signal(signal.SIGUSR1)
        proc.wait(30)
        with open(trace) as f:
            records = json.load(f)
        os.unlink(trace)
        server_log = log_path.read_text().splitlines()
        os.unlink(log_path)
        problems = [line for line in server_log if "ERROR" in line or "WARNING" in line]
        if problems:
            print(f"server log: {len(problems)} warnings/errors, e.g. " + " | ".join(problems[:3]))
        b = breakdown(records)
        traces.append({"qps": qps, "tree": tree, "records": records})
        if args.timeline:
            png = Path(args.timeline)
            if len(runs) > 1:
                png = png.with_name(f"{png.stem}-{len(traces)}{png.suffix}")
            png.parent.mkdir(parents=True, exist_ok=True)
            b["timeline"] = plot_timeline(records, png, warmup_s=args.warmup, window_ms=args.window_ms,
                                          title=f"{args.model} at {qps:g} q/s, tree {tree}: requests around the "
                                                f"slowest (after {args.warmup:g} s warmup)")
            print(f"timeline: {png} (slowest {b['timeline']['server_ms']:.0f} ms at {b['timeline']['at_s']:.1f} s)")
        client = report.latency_ms
        row = {"qps": qps, "tree": tree, "load": [round(load_before, 2), round(load_after, 2)],
               "client_p50_ms": client["p50"], "client_p99_ms": client["p99"],
               "ok": report.requests["ok"], "errors": report.requests["errors"],
               "errors_by_reason": report.errors_by_reason, **b}
        results.append(row)
        print(f"{args.model} [{tree}] {qps:g} q/s (load {load_before:.1f} -> {load_after:.1f}): "
              f"client p50 {client['p50']} p99 {client['p99']} ms; {report.requests['ok']} ok, "
              f"{report.requests['errors']} errors {dict(report.errors_by_reason)}; "
              f"batches mean {b.get('batch_rows_mean', 0):.0f} rows / {b.get('batch_requests_mean', 0):.2f} requests")
        for name in (*STAGES, "server"):
            s = b.get(name)
            if s:
                print(f"  {name:9s} p50 {s['p50']:7.2f}  p99 {s['p99']:7.2f}  mean {s['mean']:7.2f} ms"
                      f"   700-item median {b.get('700_items', {}).get(name, float('nan')):7.2f}"
                      f"   slowest 1% mean {b['slowest_1pct_mean'][name]:7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.trace_json:
        Path(args.trace_json).write_text(json.dumps(traces))
    return 0


if __name__ == "__main__":
    sys.exit(main())
