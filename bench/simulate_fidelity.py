"""Does sixfold-simulate predict real serving? Simulated vs measured p50/p99 at rates with no simulation lag.

Real serving: ``sixfold-serve --model M --cards C --card-spec <slow card>`` (simcard) in its own
process, driven open loop by ``sixfold.loadgen.run_load`` (Poisson, MLPerf query sizes) at each rate. The
card spec is slow on purpose (``SLOW_CARD``: ~20 us an item for rm1's dense part, ~10x what ONNX
Runtime takes here), so the simulated cards never wait for the host to compute their outputs:
the server's ``sixfold_simcard_lag_seconds`` is checked and reported per rate.

Simulated: ``sixfold-simulate``'s engine on the same platform, traffic model and scheduling
defaults, two ways:

* **cost model**: host and host-dense stages priced by the host spec (``--host-spec``, default this
  VM's calibration), the front end by its default 60 us a request;
* **calibrated**: the host stage and host-dense stage priced by lines fitted to their measured
  times on this host (the server's own executables, in this process, before the run), and the
  front end (transport, decode, validation: what the stages leave out) by a line through what lone
  queries of 100, 200, 400 and 700 items take on the idle server beyond the simulated stages.

The machine is shared: the load average is reported with each figure. Goal: simulated p50 and
p99 within 15% of measured.

    .venv/bin/python bench/simulate_fidelity.py [--rates 15,30,45] [--duration 15] [--quick] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from sixfold import models  # noqa: E402
from bench.harness.commands import command  # noqa: E402
from bench.harness.process import free_port  # noqa: E402
from bench.harness.report import machine_line, publish  # noqa: E402
from sixfold.server.workers.process import ReadyProcess  # noqa: E402

SECTION = "simulate-fidelity"
COMMAND = ".venv/bin/python bench/simulate_fidelity.py"
GOAL = 0.15
PROBE_SIZES = (100, 200, 400, 700)
"""Lone-query sizes probed on the idle server: the MLPerf mix's range (host-dense is off: all use the cards)."""
SLOW_CARD = {
    "name": "slow-card", "kind": "card", "description": "a deliberately slow card: simcard never lags on 2 cores",
    "memory_bytes": 4 << 30, "peak_flops": {"fp32": 2e9, "fp16": 2e9, "int8": 2e9},
    "memory_bandwidth": 1e10, "link_bandwidth": 1e9, "link_latency_s": 50e-6, "efficiency": 0.5,
}


def load_average() -> float:
    return os.getloadavg()[0]


def measure_stages(model: str, max_rows: int, cards: int, card_spec: str, host_spec: str,
                   sizes: list[int], runs: int) -> dict[str, Any]:
    """Median seconds of the host stage, host-dense stage and request validation per batch size, this host."""
    from sixfold.backends import registry
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.partitioner.partitioned import DENSE_PARTITION
    from sixfold.server.memory.allocator import keep_freed_memory
    from sixfold.server.loading.loader import load_host_stage
    from sixfold.server.model.validation import InputSpec, validate_request

    keep_freed_memory()
    import torch
    torch.set_num_threads(1)  # as the server runs here (OMP_NUM_THREADS=1)
    _, partitioned = partition_builtin(model, max_rows=max_rows, cards=cards, card_spec=card_spec,
                                       host_spec=host_spec)
    plan = partitioned.plan
    host = load_host_stage(partitioned, plan.device("host").spec)
    ort = registry.get_backend("onnxruntime")
    dense = ort.load(partitioned.artifact_for(DENSE_PARTITION, ort), plan.device("host").spec)
    gen = models.RequestGenerator.for_config(models.get_config(model, max_rows=max_rows), seed=5)
    specs = [InputSpec(t.name, t.datatype, t.shape) for t in plan.inputs]
    out: dict[str, Any] = {"rows": sizes, "host": [], "host_dense": [], "validate": []}
    for rows in sizes:
        requests = [gen.make(rows) for _ in range(runs)]
        times: dict[str, list[float]] = {"host": [], "host_dense": [], "validate": []}
        for request in requests:
            t0 = time.perf_counter()
            validate_request(dict(request), specs, plan.tables.get("rows"))
            t1 = time.perf_counter()
            pooled = host.run({n: request[n] for n in host.input_names})
            t2 = time.perf_counter()
            dense.run({n: {**request, **pooled}[n] for n in dense.input_names})
            t3 = time.perf_counter()
            times["validate"].append(t1 - t0)
            times["host"].append(t2 - t1)
            times["host_dense"].append(t3 - t2)
        for key, values in times.items():
            out[key].append(statistics.median(values[1:] or values))
    host.close()
    dense.close()
    return out


def lag_seconds(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sixfold_simcard_lag_seconds{"))


def measure_serving(args: argparse.Namespace, spec_path: str) -> list[dict[str, Any]]:
    from sixfold.loadgen import LoadConfig, run_load

    metrics_port = free_port()
    cmd = [*command("sixfold-serve"), "--model", args.model, "--max-rows",
           str(args.max_rows), "--cards", str(args.cards), "--card-spec", spec_path, "--host-spec", args.host_spec,
           "--grpc-port", "0", "--http-port", "-1", "--metrics-port", str(metrics_port), "--log-level", "WARNING",
           "--host-dense-max-rows", str(args.host_dense_max_rows)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    server = ReadyProcess(cmd, timeout_s=300, env=env)
    try:
        if not server.url:
            raise RuntimeError(f"sixfold-serve did not start:\n{server.output[-2000:]}")
        probes = {}
        for items in PROBE_SIZES:  # idle latency, one query at a time: what the front end adds to the stages
            report = run_load(LoadConfig(url=server.url, model=args.model, qps=0, concurrency=1,
                                         duration_s=args.probe_s, warmup_s=0.5, seed=args.seed,
                                         query_size=f"fixed:{items}"))
            probes[items] = report.latency_ms["p50"] / 1e3
        args.probes = probes
        out = []
        for rate in args.rates:
            lag0 = lag_seconds(metrics_port)
            load0 = load_average()
            report = run_load(LoadConfig(url=server.url, model=args.model, qps=rate, duration_s=args.duration,
                                         warmup_s=args.warmup, seed=args.seed, query_size=args.query_size))
            out.append({"rate": rate, "p50": report.latency_ms["p50"], "p99": report.latency_ms["p99"],
                        "ok": report.requests["ok"], "errors": report.requests["errors"],
                        "lag_s": lag_seconds(metrics_port) - lag0, "load": (load0 + load_average()) / 2})
            print(f"measured {rate} q/s: p50 {out[-1]['p50']} p99 {out[-1]['p99']} lag {out[-1]['lag_s']:.4f} s",
                  file=sys.stderr)
        return out
    finally:
        server.stop()


def simulate_rates(args: argparse.Namespace, spec_path: str, stages: dict[str, Any] | None) -> list[dict[str, Any]]:
    from sixfold.simulate import ServingSettings, build_platform, lone_query_ms, parse_traffic, run_at

    settings = ServingSettings(host_dense_max_rows=args.host_dense_max_rows)
    from sixfold.simulate.platform import fit_stage

    platform = build_platform(args.model, cards=args.cards, card_spec=spec_path, host_spec=args.host_spec,
                              max_rows=args.max_rows)
    if stages is not None:
        rows = stages["rows"]
        platform.host = fit_stage(platform.host, rows, stages["host"])
        if platform.host_dense is not None:
            platform.host_dense = fit_stage(platform.host_dense, rows, stages["host_dense"])
        # The front end: what an idle query takes on the real server beyond the simulated stages
        # (transport, decode, validation), as a line over its items.
        platform.per_request_s, platform.per_item_s = 0.0, 0.0
        sizes = sorted(args.probes)
        residual = [args.probes[n] - lone_query_ms(platform, n, settings) / 1e3 for n in sizes]
        per_item, fixed = np.polyfit(np.asarray(sizes, float), np.asarray(residual), 1)
        platform.per_request_s, platform.per_item_s = max(0.0, float(fixed)), max(0.0, float(per_item))
        args.frontend = (platform.per_request_s, platform.per_item_s)
    traffic = parse_traffic("poisson", args.query_size)
    out = []
    for rate in args.rates:
        r = run_at(platform, traffic, rate, duration_s=args.sim_duration, warmup_s=2.0, settings=settings,
                   seed=args.seed)
        out.append({"rate": rate, "p50": r.latency_ms["p50"], "p99": r.latency_ms["p99"], "errors": r.errors,
                    "wall_s": r.wall_s, "utilisation": r.utilisation})
    return out


def _ratio(sim: float | None, real: float | None) -> str:
    if not sim or not real:
        return "-"
    r = sim / real
    return f"{r:.2f}{'' if abs(r - 1) <= GOAL else ' ✗'}"


def render(args: argparse.Namespace, measured: list[dict], model_sim: list[dict], stage_sim: list[dict],
           stages: dict[str, Any], elapsed: float, load: tuple[float, float]) -> str:
    lines = [
        "## Simulator fidelity (sixfold-simulate vs real serving)",
        "",
        f"Command: `{COMMAND} {' '.join(args.argv)}` ({elapsed:.0f} s; "
        f"{machine_line(f'load average {load[0]:.1f} at start, {load[1]:.1f} at end')}).",
        f"Platform: `sixfold-serve --model {args.model} --max-rows {args.max_rows} --cards {args.cards} --card-spec "
        f"slow-card.json --host-spec host.json` with OMP_NUM_THREADS=1 --host-dense-max-rows "
        f"{args.host_dense_max_rows} (simcard; the slow card takes ~90 us an item, ~50x ONNX Runtime's real time "
        f"here, so the cards rarely lag: see the lag column), default scheduling otherwise; host.json: "
        f"{args.host_label}. Traffic: `sixfold.loadgen.run_load`, Poisson, "
        f"`{args.query_size}` sizes, {args.warmup:g} s warm-up + {args.duration:g} s measured per rate, seed {args.seed}. "
        f"Simulation: the same platform, traffic model and defaults, {args.sim_duration:g} virtual s per rate after 2 s "
        f"warm-up, priced (a) by the cost model on host.json (front end 60 us a request), (b) "
        f"calibrated: the host and host-dense stages by lines through their times measured in this process just "
        f"before (medians of {args.runs} runs at {', '.join(map(str, stages['rows']))} items), and the front end "
        f"by a line through what lone queries of {', '.join(map(str, PROBE_SIZES))} items took on the idle server "
        f"beyond the simulated stages ({args.frontend[0] * 1e3:.2f} ms + {args.frontend[1] * 1e6:.2f} us an item). "
        f"Ratio = simulated / measured; ✗ marks one outside {GOAL:.0%}.",
        "",
        "| q/s | measured p50 / p99 ms | sim, cost model p50 / p99 ms | ratio p50 / p99 | sim, calibrated "
        "p50 / p99 ms | ratio p50 / p99 | card lag in run (s) | load avg |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, a, b in zip(measured, model_sim, stage_sim):
        lines.append(
            f"| {m['rate']:g} | {m['p50']:.2f} / {m['p99']:.2f} | {a['p50']:.2f} / {a['p99']:.2f} | "
            f"{_ratio(a['p50'], m['p50'])} / {_ratio(a['p99'], m['p99'])} | {b['p50']:.2f} / {b['p99']:.2f} | "
            f"{_ratio(b['p50'], m['p50'])} / {_ratio(b['p99'], m['p99'])} | {m['lag_s']:.3f} | {m['load']:.1f} |")
    host_ms = ", ".join(f"{r}: {h * 1e3:.2f}" for r, h in zip(stages["rows"], stages["host"]))
    dense_ms = ", ".join(f"{r}: {h * 1e3:.2f}" for r, h in zip(stages["rows"], stages["host_dense"]))
    val_ms = ", ".join(f"{r}: {h * 1e3:.2f}" for r, h in zip(stages["rows"], stages["validate"]))
    probe_ms = ", ".join(f"{n}: {t * 1e3:.2f}" for n, t in sorted(args.probes.items()))
    lines += ["", f"Measured stage times (items: ms): host stage {host_ms}; host dense {dense_ms}; "
                  f"validation {val_ms}; lone queries on the idle server (p50) {probe_ms}."]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="rm1")
    p.add_argument("--cards", type=int, default=2)
    p.add_argument("--max-rows", type=int, default=50_000)
    p.add_argument("--host-spec", default="calibrate",
                   help="host spec for the server and the cost-model simulation (default: calibrate this host now)")
    p.add_argument("--calibrate-s", type=float, default=10.0)
    p.add_argument("--rates", default="15,30,45")
    p.add_argument("--host-dense-max-rows", type=int, default=0,
                   help="sixfold-serve's flag, for the server and the simulation (default 0: every batch on a card)")
    p.add_argument("--query-size", default="mlperf")
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--sim-duration", type=float, default=60.0)
    p.add_argument("--runs", type=int, default=9)
    p.add_argument("--probe-s", type=float, default=4.0, help="seconds of lone queries per probed size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="one short rate: a smoke run")
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    args.argv = sys.argv[1:]
    if args.quick:
        args.rates, args.duration, args.sim_duration, args.runs, args.probe_s = "20", 4.0, 10.0, 3, 2.0
    args.rates = [float(r) for r in args.rates.split(",")]
    started, load0 = time.perf_counter(), load_average()
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = str(Path(tmp) / "slow-card.json")
        Path(spec_path).write_text(json.dumps(SLOW_CARD))
        if args.host_spec == "calibrate":  # this host now, 1 thread, as the server runs here
            from sixfold.backends.host.calibrate import calibrate_host
            host_path = Path(tmp) / "host.json"
            host_path.write_text(json.dumps(calibrate_host(args.calibrate_s, threads=1).to_dict()))
            args.host_spec, args.host_label = str(host_path), f"this host calibrated with 1 thread ({args.calibrate_s:g} s)"
        else:
            args.host_label = args.host_spec
        stages = measure_stages(args.model, args.max_rows, args.cards, spec_path, args.host_spec,
                                [32, 128, 300, 700], args.runs)
        measured = measure_serving(args, spec_path)
        model_sim = simulate_rates(args, spec_path, None)
        stage_sim = simulate_rates(args, spec_path, stages)
    elapsed = time.perf_counter() - started
    text = render(args, measured, model_sim, stage_sim, stages, elapsed, (load0, load_average()))
    publish(SECTION, text, write=not args.no_write)
    if args.json:
        Path(args.json).write_text(json.dumps({"measured": measured, "cost_model": model_sim,
                                               "measured_stages": stage_sim, "stages": stages}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
