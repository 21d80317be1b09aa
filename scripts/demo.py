"""make demo: partition a model onto 6 simulated cards + host, serve it, replay traffic, report.

Starts `sixfold-serve` on a free loopback port, drives it open-loop with
`sixfold-loadgen` (Poisson arrivals, MLPerf query sizes, power-law ids), prints
the latency/throughput report, and always shuts the server down. The host is priced by
this machine's own calibration (`--host-spec auto`: measured once, then cached; `make serve`
prices it the same way, both from the Makefile's HOST_SPEC), and the summary puts what the
plan estimated and what `sixfold-simulate` predicts for the same traffic beside what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from sixfold.server.workers.process import ReadyProcess

BIN = Path(sys.executable).parent


def _start_server(args: argparse.Namespace) -> ReadyProcess:
    cmd = [str(BIN / "sixfold-serve"), "--model", args.model, "--max-rows", str(args.max_rows),
           "--cards", str(args.cards), "--grpc-port", "0", "--metrics-port", str(args.metrics_port),
           "--http-port", "-1", "--drain-seconds", "0", "--log-level", "WARNING", "--host-spec", args.host_spec]
    print(f"$ {' '.join(cmd[1:])}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "110"}
    server = ReadyProcess(cmd, env=env, timeout_s=args.start_timeout,
                          echo=lambda line: print(f"  [server] {line}", end="", flush=True))
    if not server.url:
        server.kill()
        raise SystemExit(f"demo: the server did not become ready within {args.start_timeout:.0f}s")
    return server


def _predict(args: argparse.Namespace) -> tuple[str, str]:
    """The plan's estimate and the simulator's prediction for this run's platform and traffic."""
    from sixfold.simulate import ServingSettings, build_platform, parse_traffic, run_at

    platform = build_platform(args.model, cards=args.cards, card_spec="m2-card", host_spec=args.host_spec,
                              max_rows=args.max_rows)
    est = platform.plan.estimates
    plan = (f"plan estimate (host {platform.host_spec.name}): {est.latency_ms:.1f} ms per idle "
            f"{est.batch_rows}-item batch, at most {est.throughput_items_per_s:,.0f} items/s")
    r = run_at(platform, parse_traffic("poisson", args.query_size), args.qps, duration_s=max(60.0, args.duration),
               warmup_s=1.0, settings=ServingSettings(), seed=1)
    lat = r.latency_ms
    simulated = (f"sixfold-simulate, same platform and traffic: p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, "
                 f"p99 {lat['p99']:.1f} ms; {r.items_per_s:,.0f} items/s (stage costs only: no gRPC transport)")
    return plan, simulated


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="rm2")
    p.add_argument("--max-rows", type=int, default=50_000)
    p.add_argument("--cards", type=int, default=6)
    p.add_argument("--qps", type=float, default=6.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--query-size", default="mlperf")
    p.add_argument("--metrics-port", type=int, default=-1)
    p.add_argument("--start-timeout", type=float, default=240.0)
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--host-spec", default="auto",
                   help="host spec (default auto: this machine, calibrated on first use and cached)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    plan, simulated = _predict(args)  # NOTE: first: it calibrates the host once, and the server reads the cache
    server = _start_server(args)
    url = server.url
    try:
        print(f"\nserver ready at {url} after {time.monotonic() - started:.0f}s; replaying "
              f"{args.duration:.0f}s of Poisson traffic at {args.qps} queries/s ({args.query_size} query sizes)\n",
              flush=True)
        report = out / "report.json"
        cmd = [str(BIN / "sixfold-loadgen"), "--url", url, "--model", args.model, "--qps", str(args.qps),
               "--duration", str(args.duration), "--arrival", "poisson", "--query-size", args.query_size,
               "--report", str(report)]
        print(f"$ {' '.join(cmd[1:])}", flush=True)
        code = subprocess.call(cmd)
        if code != 0:
            print(f"demo: load generator exited with {code}")
            return code
        r = json.loads(report.read_text())
        lat = r["latency_ms"]
        print(f"\ndemo summary ({args.model}, {args.cards} simulated cards + host): "
              f"p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, p99 {lat['p99']:.1f} ms; "
              f"{r['achieved_qps']:.2f} queries/s, {r.get('items_per_s', 0):,.0f} items/s; "
              f"{r['requests']['ok']}/{r['requests']['sent']} ok, {r['requests']['errors']} errors. "
              f"Report: {report}")
        print(f"  {plan}\n  {simulated}\n  measured: p50 {lat['p50']:.1f} ms, p90 {lat['p90']:.1f} ms, "
              f"p99 {lat['p99']:.1f} ms; {r.get('items_per_s', 0):,.0f} items/s")
        return 0 if r["requests"]["errors"] == 0 else 1
    finally:
        code = server.stop(grace_s=30)
        print(f"server stopped (exit {code}); demo took {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    sys.exit(main())
