"""bench/latency_bounded.py's report: what its figures mean and how they print.

From the runs ``latency_bounded.run_model`` measured: per model the median run's figures, ratios
between servers (as intervals: see ``bench.harness.sweep``), the split of server / ideal into own
speed and scheduling (``own_speed_split``), and the BENCHMARKS.md section with its tables. Kept apart
from the command so that each file reads in one sitting; the constants here are shared by both.
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

import numpy as np

from bench.harness.report import md_row, md_rule
from bench.harness.sweep import FEW_QUERIES, fmt_qps, fmt_ratio, interval, median_ratio, ratio, safe_div
from sixfold.loadgen.ideal import ideal_max_qps
from sixfold.models.requests import MLPERF_QUANTILES, MLPerfQuerySizes

SECTION = "latency-bounded"
COMMAND = ".venv/bin/python bench/latency_bounded.py"
MEAN_QUERY_ITEMS = float(np.mean(MLPERF_QUANTILES))  # 270 items
LARGEST_QUERY = max(MLPERF_QUANTILES)  # 700 items: 1 of the 20 quantiles, so the p99 query
IDEAL_QUERIES = 50_000  # simulated arrivals per ideal-server search
FLOOR_QPS = 1.0  # below this a step holds a handful of queries: its p99 means nothing
SERVERS = ("sixfold", "sixfold-cpu", "sixfold-shm", "sixfold-nobatch", "sixfold-before", "fifo", "mlserver", "triton", "triton-2inst",
           "triton-batch")
TRITONS = ("triton", "triton-2inst", "triton-batch")  # bench.harness.peers.TRITON_CONFIGS
BEST_TRITON = "triton-best"  # per run and bound, the Triton configuration that served the most
THIS_TREE = ("sixfold", "sixfold-cpu", "sixfold-shm", "sixfold-nobatch")  # the servers that run this checkout's code
TAKES_IDS_DTYPE = (*THIS_TREE, "fifo")  # --ids-dtype reaches these; the others get INT64 ids
LABEL = {"offline": "offline (in-process torch, best batch)",
         "ideal": "ideal server (simulated: every query at offline's best speed, FIFO, no overhead)",
         "sixfold": "sixfold (default batching)",
         "sixfold-cpu": "sixfold on the cpu layout (`--backend cpu`: dense on one lane per usable core)",
         "sixfold-shm": "sixfold (default batching), inputs in system shared memory (`--client shm`)",
         "sixfold-nobatch": "sixfold, no batching", "mlserver": "MLServer, adaptive batching",
         "fifo": "FIFO server, measured (`bench/fifo_server.py`: the ideal's policy run here, offline torch, "
                 "one query at a time, over gRPC)",
         "sixfold-before": "sixfold at --baseline-tree (default batching)",
         "triton": "Triton 2.51 Python backend, 1 instance, no batching",
         "triton-2inst": "Triton 2.51 Python backend, 2 instances, no batching",
         "triton-batch": "Triton 2.51 Python backend, 1 instance, dynamic batching of whole requests"}


def _bound(entry: dict[str, Any] | None, bound: float) -> dict[str, Any] | None:
    """A server's search result at ``bound`` (None: skipped or not measured)."""
    if entry is None or "skipped" in entry:
        return None
    return entry.get("bounds", {}).get(bound)


def _median_entry(entries: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """The run whose max QPS at ``bound`` is the median (its figures stay consistent with each other)."""
    real = [e for e in entries if "skipped" not in e]
    if not real:
        return entries[0]
    real.sort(key=lambda e: (interval(_bound(e, bound)) or (0.0, 0.0))[1])
    return real[(len(real) - 1) // 2]


RATIOS = (("sixfold", BEST_TRITON), ("sixfold", "sixfold-cpu"), ("sixfold", "sixfold-nobatch"), ("sixfold", "mlserver"), ("sixfold", "offline"),
          ("sixfold", "ideal"), ("mlserver", "offline"), ("sixfold-nobatch", "offline"),
          ("sixfold-before", "ideal"), ("sixfold", "sixfold-before"), ("sixfold-shm", "ideal"),
          ("sixfold-shm", "sixfold"), ("fifo", "ideal"), ("sixfold", "fifo"), ("sixfold-shm", "fifo"))


def _cards_flag(args: Any) -> str:
    """`` --cards N`` when the bench gave sixfold a card count, else nothing (sixfold-serve's own layout)."""
    return "" if args.cards is None else f" --cards {args.cards}"


def best_triton(run: dict[str, Any], bound: float) -> tuple[float, float] | None:
    """The interval of the Triton configuration of ``run`` that served the most at ``bound`` (None: none ran)."""
    found = [i for i in (interval(_bound(run["servers"].get(name), bound)) for name in TRITONS) if i is not None]
    return max(found, key=lambda i: (i[1], i[0])) if found else None


def ideal_qps(offline: dict[str, Any], bound: float) -> float:
    """The ideal server's max q/s at ``bound``: offline's best speed for every query, FIFO, no overhead."""
    return ideal_max_qps(offline["best_items_per_s"], MLPerfQuerySizes(), bound, queries=IDEAL_QUERIES).max_qps


def summarize(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, runs in results.items():
        offline = {"max_qps": statistics.median(r["offline"]["qps"] for r in runs),
                   "items_per_s": statistics.median(r["offline"]["best_items_per_s"] for r in runs),
                   "best_batch": sorted({r["offline"]["best_batch"] for r in runs})}
        entries = {name: [r["servers"][name] for r in runs if name in r["servers"]] for name in SERVERS}
        ratios: dict[float, dict[str, Any]] = {}
        ideal: dict[float, float] = {}
        ideal_by_run: dict[float, list[float]] = {}
        for bound in args.p99_ms:
            ratios[bound] = {}
            per_run_ideal = ideal_by_run[bound] = [ideal_qps(r["offline"], bound) for r in runs]
            ideal[bound] = statistics.median(per_run_ideal)
            for num, den in RATIOS:
                values = []
                for r, ideal_run in zip(runs, per_run_ideal):
                    a = interval(_bound(r["servers"].get(num), bound))
                    if den == BEST_TRITON:
                        b: tuple[float, float] | None = best_triton(r, bound)
                    elif den == "offline":
                        b = (r["offline"]["qps"],) * 2
                    elif den == "ideal":
                        b = (ideal_run, ideal_run)
                    else:
                        b = interval(_bound(r["servers"].get(den), bound))
                    values.append(ratio(a, b))
                ratios[bound][f"{num}/{den}"] = median_ratio(values)
        offline["ideal_qps"] = ideal
        first = args.p99_ms[0]
        out[model] = {"offline": offline, "ratios": ratios, "orders": [r["order"] for r in runs],
                      "servers": {n: _median_entry(e, first) for n, e in entries.items() if e},
                      "own_speed": own_speed_split(runs, args, ideal_by_run)}
    return out


def own_speed_split(runs: list[dict[str, Any]], args: argparse.Namespace,
                    ideal_by_run: dict[float, list[float]]) -> dict[str, Any]:
    """Per server, medians over runs: best closed-loop items/s, that / offline's, the ideal server at that
    speed (q/s per bound), the server's q/s / that ideal (an interval), and CPU per query by thread group.
    ``ideal_by_run``: the ideal server's q/s per bound, one per run (``summarize`` has them)."""
    out: dict[str, Any] = {}
    for name in SERVERS:
        measured = [(i, r["servers"][name]) for i, r in enumerate(runs)
                    if r["servers"].get(name, {}).get("saturation", {}).get("steps")]
        if not measured:
            continue
        best = [e["saturation"]["best"] for _, e in measured]
        entry: dict[str, Any] = {
            "items_per_s": statistics.median(b["items_per_s"] for b in best),
            "of_offline": statistics.median(b["items_per_s"] / runs[i]["offline"]["best_items_per_s"]
                                            for (i, _), b in zip(measured, best)),
            "concurrency": sorted({b["concurrency"] for b in best}),
            "ideal_qps": {}, "of_ideal_own": {}, "of_ideal": {}}
        for bound in args.p99_ms:
            own = [ideal_max_qps(b["items_per_s"], MLPerfQuerySizes(), bound, queries=IDEAL_QUERIES).max_qps
                   for b in best]
            entry["ideal_qps"][bound] = statistics.median(own)
            entry["of_ideal_own"][bound] = median_ratio([ratio(interval(_bound(e, bound)), (o, o))
                                                          for (_, e), o in zip(measured, own)])
            entry["of_ideal"][bound] = statistics.median(safe_div(o, ideal_by_run[bound][i])
                                                         for (i, _), o in zip(measured, own))
        groups: dict[str, list[float]] = {}
        for b in best:
            for g, v in b["cpu_ms_per_query"].items():
                groups.setdefault(g, []).append(v)
        entry["cpu_ms_per_query"] = {g: statistics.median(v + [0.0] * (len(best) - len(v)))
                                     for g, v in groups.items()}
        out[name] = entry
    return out


def _answers(entry: dict[str, Any]) -> str:
    a = entry["answers"]
    if a["ok"]:
        return f"match (max diff {a['max_abs_diff']:.0e})"
    return "**WRONG**: " + "; ".join(a["errors"] or [f"max diff {a['max_abs_diff']:.2g}"])


def format_tables(summary: dict[str, Any], args: argparse.Namespace) -> str:
    bounds = args.p99_ms
    head = " | ".join(f"max q/s at p99 <= {b:g} ms (p50 / p99 ms there)" for b in bounds)
    lines = [f"| model | server | idle ms (median of {args.idle_repeats}), {int(MEAN_QUERY_ITEMS)} / {LARGEST_QUERY} "
             f"items | {head} "
             f"| answers vs offline model |", md_rule(4 + len(bounds))]
    for model, s in summary.items():
        off = s["offline"]
        lines.append(md_row(model, f"{LABEL['offline']}: {off['items_per_s']:,.0f} items/s at batch "
                            f"{', '.join(map(str, off['best_batch']))}", "",
                            *(f"{off['max_qps']:.2f} (no latency bound)" for _ in bounds), ""))
        lines.append(md_row(model, LABEL["ideal"], f"{LARGEST_QUERY / off['items_per_s'] * 1e3:.0f} (its service time)",
                            *(f"{off['ideal_qps'][b]:.2f}" for b in bounds), ""))
        for name in SERVERS:
            e = s["servers"].get(name)
            if e is None:
                continue
            if "skipped" in e:
                lines.append(f"| {model} | {LABEL[name]} | {e['skipped']} |" + " |" * len(bounds) + "  |")
                continue
            idle = (f"{e['idle_ms'][int(MEAN_QUERY_ITEMS)]:.0f} / {e['idle_ms'][LARGEST_QUERY]:.0f} "
                    f"(fastest {e['idle_ms_min'][LARGEST_QUERY]:.0f})")
            cells = []
            for b in bounds:
                r = e["bounds"][b]
                if r.get("infeasible"):
                    cells.append(f"0 (a lone {LARGEST_QUERY}-item query > {b:g} ms)")
                elif r["p99_ms"] is not None:
                    few = "†" if r["queries"] < FEW_QUERIES else ""
                    cells.append(f"{fmt_qps(r)}{few} ({r['p50_ms']:.0f} / {r['p99_ms']:.0f}; {r['queries']} queries; "
                                 f"{len(r['steps'])} steps)")
                else:
                    cells.append(f"{fmt_qps(r)} ({len(r['steps'])} steps)")
            lines.append(md_row(model, LABEL[name], idle, *cells, _answers(e)))
    lines += ["", "| model | p99 bound | sixfold / best Triton (goal >= 1.5) | sixfold / no batching | sixfold / MLServer (goal >= 3) "
              "| sixfold / offline (goal >= 0.7) | sixfold / ideal server | MLServer / offline "
              "| no batching / offline | baseline tree / ideal server | sixfold / baseline tree "
              "| sixfold over shm / ideal server | sixfold over shm / over gRPC bytes "
              "| FIFO server measured / ideal (simulated) | sixfold / FIFO measured | sixfold over shm / FIFO measured |",
              md_rule(2 + len(RATIOS))]
    for model, s in summary.items():
        for b in bounds:
            r = s["ratios"][b]
            lines.append(md_row(model, f"{b:g} ms", *(fmt_ratio(r[f"{n}/{d}"]) for n, d in RATIOS)))
    split = [(m, n, e) for m, s in summary.items() for n, e in s.get("own_speed", {}).items()]
    if split:
        first = bounds[0]
        lines += ["", f"Where the gap to the ideal server goes (p99 <= {first:g} ms): sixfold / ideal = "
                  "(ideal at the server's own speed / ideal) x (server / ideal at its own speed).", "",
                  "| model | server | own speed: best closed-loop items/s (outstanding) | / offline's best "
                  "| ideal at own speed, q/s | = x of the ideal | server / ideal at own speed "
                  "| CPU per query there, core-ms by threads |", md_rule(8)]
        for model, name, e in split:
            cpu = ", ".join(f"{g} {v:.1f}" for g, v in e["cpu_ms_per_query"].items() if v >= 0.05)
            total = sum(e["cpu_ms_per_query"].values())
            outstanding = ", ".join(map(str, e["concurrency"]))
            lines.append(md_row(model, LABEL[name], f"{e['items_per_s']:,.0f} ({outstanding})",
                                f"{e['of_offline']:.2f}", f"{e['ideal_qps'][first]:.2f}", f"{e['of_ideal'][first]:.2f}",
                                fmt_ratio(e["of_ideal_own"][first]), f"{total:.1f}: {cpu}"))
    return "\n".join(lines)


def _goal(summary: dict[str, Any], bound: float, key: str, goal: float) -> str:
    parts = []
    for model, s in summary.items():
        r = s["ratios"][bound][key]
        if r is None:
            parts.append(f"{model}: not measured")
        elif r["both_zero"]:
            parts.append(f"{model}: **not met** (neither meets the bound at any rate)")
        elif r["low"] >= goal:
            parts.append(f"{model} {fmt_ratio(r)}: met")
        elif r["high"] < goal:
            parts.append(f"{model} {fmt_ratio(r)}: **not met**")
        else:
            parts.append(f"{model} {fmt_ratio(r)}: **not shown** (a figure from too few queries)")
    return "; ".join(parts)


def format_section(summary: dict[str, Any], results: dict[str, Any], args: argparse.Namespace, argv: list[str],
                   wall: float, machine: str) -> str:
    cmd = (COMMAND + " " + " ".join(argv)).strip()
    orders = "; ".join(f"{m}: " + " | ".join(" → ".join(o) for o in s["orders"]) for m, s in summary.items())
    ml_notes = []
    for model, runs in results.items():
        e = next((r["servers"]["mlserver"] for r in runs if "answers_usual_order" in r["servers"].get("mlserver", {})),
                 None)
        if e is not None:
            a = e["answers_usual_order"]
            ml_notes.append(f"{model}: " + ("answered" if a["ok"] else "failed, " + "; ".join(a["errors"][:1])))
    first = args.p99_ms[0]
    text = [
        f"## Latency-bounded throughput (p99 <= {first:g} ms, MLPerf DLRM query sizes)",
        "",
        f"Command: `{cmd}` ({wall / 60:.1f} min; {machine}).",
        f"Models: {', '.join(summary)}, every table capped at {args.max_rows:,} rows, seed 0. Traffic: "
        f"`sixfold.loadgen.find_max_qps_async` in the bench process: open-loop Poisson, query sizes `mlperf` "
        f"(100..700 items, mean {MEAN_QUERY_ITEMS:.0f}), the same seeds for every server; each step "
        f"{args.warmup:g} s warmup + {args.step:g} s measured, starting at 1/4 of the server's closed-loop rate "
        f"at 2 outstanding queries ({args.warmup_run:g} s, also its warmup), doubling (halving to {FLOOR_QPS:g} q/s "
        f"if the first step fails), then bisection to {args.tolerance:.0%}, at most "
        f"{args.max_steps} steps; a step passes with p99 (from scheduled send) within the bound, no errors, "
        f">= 90% of the rate answered. A bound below a server's idle {LARGEST_QUERY}-item latency (the p99 "
        f"query size; the fastest of {args.idle_repeats}) is not searched: no rate can meet it. "
        f"{args.runs} run(s); figures are the median run's, ratios medians of per-run ratios.",
        f"Run order (one server alive at a time): {orders}. sixfold: `sixfold-serve{_cards_flag(args)}{(' --workers ' + str(args.workers)) if args.workers > 1 else ''}{''.join(' ' + a for a in args.serve_arg)}` "
        f"({'its own layout for this host' if args.cards is None else 'simcard'}; sixfold-cpu: "
        f"`--backend cpu`), default batching (1024 rows, 2 ms window) and host-dense fallback at its default "
        f"(auto-tuned); no batching: `--max-batch-rows 1 --max-queue-delay-us 0`, same fallback default. "
        f"MLServer: `bench/mlserver/serve.py --max-batch-size {args.mlserver_batch_size} --max-batch-time "
        f"{args.mlserver_batch_time:g}` (adaptive batching; the runtime runs torch on 1 thread). Triton: "
        f"`bench/triton_peer/serve.py` in `.venv-triton` (`make triton-venv`: tritonserver 2.51 from the nvidia-pytriton "
        f"0.7.0 wheel, whose only backend is Python: the same torch model on 1 thread per instance, "
        f"OMP_WAIT_POLICY=PASSIVE); its dynamic batching takes whole requests, sent with a leading batch "
        f"dimension of 1 (`sixfold-loadgen --batch-dim`), because its batcher needs every input to share the "
        f"first dimension. Triton's faster paths (its ONNX Runtime and libtorch backends) are not in the wheel, "
        f"so these rows are Triton's Python backend, not Triton at its best. FIFO measured: "
        f"`bench/fifo_server.py{''.join(' ' + a for a in args.fifo_arg)}` (the offline model on {os.cpu_count()} "
        f"threads behind a bare grpc.aio server, "
        f"one query at a time in arrival order). Offline: the "
        f"unpartitioned torch model in this process, `inference_mode`, {os.cpu_count()} threads, batches of "
        f"{', '.join(map(str, args.offline_batches))} items (median time per batch"
        + ("; measured before and after the servers, the better kept" if args.offline_again else "")
        + f"); its q/s = best items/s / {MEAN_QUERY_ITEMS:.0f}.",
        "Same tensors for every server; MLServer gets them ids first, dense last: its adaptive batching splits "
        "a batched reply by the last input's first dimension, so in loadgen's usual order (ids last) every "
        "reply fails" + (f" (checked here: {'; '.join(ml_notes)})." if ml_notes else ".")
        + " sixfold gets the usual order (it takes inputs in any order).",
        "",
        format_tables(summary, args),
        "",
        f"† the passing step held fewer than {FEW_QUERIES} queries: its p99 is about its maximum, and with 5% of "
        f"the mix at {LARGEST_QUERY} items it may hold none of the largest, so it counts as \"at most\" this "
        "rate (ratios then show ≤ / ≥). "
        f"Answers match when every score is within {args.answer_tolerance:g} of the offline model's. "
        "Cells: max q/s (p50 / p99 ms of the best passing step; its measured queries; search steps run).",
        "",
        "Goals: sixfold / best Triton configuration >= 1.5: " + "; ".join(
            f"at {b:g} ms {_goal(summary, b, 'sixfold/' + BEST_TRITON, 1.5)}" for b in args.p99_ms) + ". "
        f"At p99 <= {first:g} ms: sixfold / MLServer >= 3: {_goal(summary, first, 'sixfold/mlserver', 3.0)}. "
        f"sixfold / offline >= 0.7: {_goal(summary, first, 'sixfold/offline', 0.7)}.",
        "",
        f"The ideal server (`sixfold.loadgen.ideal.ideal_max_qps`, {IDEAL_QUERIES:,} simulated Poisson arrivals of the "
        "same query mix) runs every query alone at offline's best items/s, back to back: no server on this "
        "machine does better with a FIFO queue. What it reaches at a bound, as a fraction of offline, is the "
        "most any server can: " + "; ".join(
            f"{m} " + ", ".join(f"{s['offline']['ideal_qps'][b] / s['offline']['max_qps']:.2f} at {b:g} ms"
                                for b in args.p99_ms) for m, s in summary.items()) + ".",
    ]
    return "\n".join(text) + "\n"
