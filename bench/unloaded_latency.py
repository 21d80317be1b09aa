"""A lone query on an idle server: what the start-up plan and the simulator predict vs what is served.

Serves ``--model`` (each of a comma list) with ``sixfold-serve`` in a layout (default: what sixfold-serve
picks here, six emulated cards on a host with no accelerator, priced at the speed they reach here;
``--backend cpu`` for the cpu layout), sends lone queries of each ``--sizes`` (sequential, one in flight, ``--n`` each, median) and
prints, per size: the served client latency, ``sixfold-simulate run`` with the same flags at a rate low
enough that every query is alone (``--query-size fixed:N``), the start-up plan's unloaded latency (the
JSON plan line, at each size through ``sixfold.partitioner.pricing.served_latency``), and their ratios.
The server runs in ``bench/latency_breakdown.py``'s traced mode, so the served time is also split into
stages (decode, validate, queue, host, card, finish, encode, wire): where a gap is, by name.

    .venv/bin/python bench/unloaded_latency.py --model dlrm-mlperf --n 15
    .venv/bin/python bench/unloaded_latency.py --model rm2 --backend simcard --cards 6

The machine is whatever it is: its load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = (1, 16, 100, 270, 700)
STAGES = ("decode", "validate", "queue", "host", "card", "finish", "encode")


def _layout_flags(backend: str, cards: int | None) -> tuple[list[str], list[str]]:
    """The same layout as sixfold-serve flags and as sixfold-simulate flags."""
    serve = ["--backend", backend] + (["--cards", str(cards)] if cards else [])
    if backend == "cpu" and not cards:  # NOTE: auto resolves to emulated cards, as the simulator's default
        return serve, ["--cpu-host"]
    if backend == "cpu":
        return serve, ["--cpu-host", "--cards", str(cards)]
    return serve, (["--cards", str(cards)] if cards else [])


class Server:
    """``sixfold-serve`` in latency_breakdown's traced mode, its JSON plan line read; stopped by ``stop``."""

    def __init__(self, model: str, max_rows: int, layout: list[str], timeout_s: float = 300.0) -> None:
        self.trace = Path(tempfile.mkdtemp(prefix="sixfold-unloaded-")) / "trace.json"
        self.log = self.trace.with_suffix(".log")
        cmd = [sys.executable, str(ROOT / "bench" / "latency_breakdown.py"), "--traced-serve", str(self.trace),
               "--model", model, "--max-rows", str(max_rows), *layout, "--host", "127.0.0.1", "--grpc-port", "0",
               "--metrics-port", "-1", "--http-port", "-1", "--drain-seconds", "0", "--log-format", "json"]
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        self.url, self.plan = "", None
        deadline = time.monotonic() + timeout_s
        while not self.url and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            for line in self.log.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == "plan":
                    self.plan = entry.get("plan")
                elif entry.get("event") == "ready":
                    self.url = entry["grpc"]
        if not self.url:
            tail = self.log.read_text()[-2000:]
            self.stop()
            raise RuntimeError(f"sixfold-serve did not start ({self.proc.poll()}): {tail}")

    def records(self) -> list[list[float]]:
        """Stop the server (SIGUSR1: it writes its per-request stamps and exits) and return the stamps."""
        self.proc.send_signal(signal.SIGUSR1)
        self.proc.wait(30)
        return json.loads(self.trace.read_text())

    def stop(self) -> None:
        """Stop the server if it still runs, and remove its trace folder."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.trace.parent, ignore_errors=True)


def serve_lone(url: str, model: str, max_rows: int, sizes: list[int], n: int, warmup: int = 3) -> dict[int, list[float]]:
    """Client latency (s) of ``n`` lone queries per size, one at a time, after ``warmup`` unmeasured ones."""
    import tritonclient.grpc as grpcclient

    from sixfold import models
    from sixfold.server.protocol.codec import datatype_of

    cfg = models.get_config(model, max_rows=max_rows)
    gen = models.RequestGenerator.for_config(cfg, seed=0)
    client = grpcclient.InferenceServerClient(url)
    out: dict[int, list[float]] = {}
    try:
        for size in sizes:
            times = []
            for i in range(warmup + n):
                arrays = gen.make(size)
                inputs = []
                for name, array in arrays.items():
                    inp = grpcclient.InferInput(name, list(array.shape), datatype_of(array))
                    inp.set_data_from_numpy(array)
                    inputs.append(inp)
                t0 = time.perf_counter()
                client.infer(model, inputs)
                if i >= warmup:
                    times.append(time.perf_counter() - t0)
            out[size] = times
    finally:
        client.close()
    return out


def stage_medians(records: list[list[float]], warmup: int, n: int, sizes: list[int]) -> dict[int, dict[str, float]]:
    """Median stage times (ms) per size, from the traced server's stamps (in send order)."""
    from bench.latency_breakdown import breakdown

    out = {}
    for k, size in enumerate(sizes):
        chunk = records[k * (warmup + n) + warmup:(k + 1) * (warmup + n)]
        b = breakdown(chunk)
        out[size] = {s: b[s]["p50"] for s in (*STAGES, "server")} if b else {}
    return out


def path_medians(records: list[list[float]], served: dict[int, list[float]], warmup: int,
                 sizes: list[int]) -> dict[int, float]:
    """Per size, the median over requests of each one's client latency less its own host and dense stage times
    (seconds): the serving path, taken request by request so a stage slowed by another process is not counted."""
    out = {}
    n = len(next(iter(served.values()))) if served else 0
    for k, size in enumerate(sizes):
        chunk = records[k * (warmup + n) + warmup:(k + 1) * (warmup + n)]
        if len(chunk) == len(served[size]):
            out[size] = statistics.median(t - r[4] - r[5] for t, r in zip(served[size], chunk))
    return out


def simulate_lone(model: str, max_rows: int, layout: list[str], size: int, duration_s: float = 30.0) -> float:
    """sixfold-simulate's p50 (ms) for ``size``-item queries at 1 q/s: each query alone."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        cmd = [sys.executable, "-m", "sixfold.simulate", "run", "--model", model, "--max-rows", str(max_rows),
               *layout, "--query-size", f"fixed:{size}", "--qps", "1", "--arrival", "constant",
               "--duration", str(duration_s), "--json", str(out), "--quiet"]
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, timeout=300)
        payload = json.loads(out.read_text())
        return float(payload["results"][0]["runs"][0]["latency_ms"]["p50"])


def plan_latency_ms(plan: dict[str, Any] | None, size: int) -> float | None:
    """The plan line's unloaded latency for a ``size``-item lone query (its ``served_latency`` terms)."""
    if not plan:
        return None
    served = plan.get("served_latency")
    if not served:
        return plan["latency_ms"] if size == plan["batch_rows"] else None
    from sixfold.partitioner.pricing.served_latency import ServedLatency
    return ServedLatency.from_dict(served).seconds(size) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dlrm-mlperf,rm2", help="comma-separated built-in models")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--backend", default="auto", help="sixfold-serve --backend (auto: what it picks here)")
    p.add_argument("--cards", type=int, default=None)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--n", type=int, default=15, help="lone queries per size (the median is reported)")
    p.add_argument("--no-simulate", action="store_true", help="skip sixfold-simulate (the plan and served only)")
    p.add_argument("--calibrate", action="store_true",
                   help="fit this host's serving path (client latency less the server's host and dense stages) "
                        "and its host stage's cost per id, measure the emulated cards' speed again, drop the "
                        "served partitions' load-time timings (each server times its own again), and write "
                        "them where the start-up plan and sixfold-simulate read them")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n {args.n}: give at least 1")
    sizes = [int(s) for s in args.sizes.split(",")]
    from sixfold import models
    serve_flags, sim_flags = _layout_flags(args.backend, args.cards)
    results = []
    path_points: list[tuple[int, float, float]] = []  # (items, serving-path seconds, ids per item)
    host_points: list[tuple[float, float, float, float]] = []  # (items, ids an item, bags an item, host seconds)
    print(f"load average {os.getloadavg()[0]:.2f} at start; {os.cpu_count()} cpus")
    if args.calibrate:  # the emulated cards' speed too, measured now (the first server measures it again)
        from sixfold.backends.emulation_calibrate import emulation_file
        emulation_file().unlink(missing_ok=True)
        from sixfold.partitioner.pricing.loaded_stages import stage_timing_file
        for timed in stage_timing_file("*").parent.glob(stage_timing_file("*").name):
            timed.unlink(missing_ok=True)  # each server times its loaded partitions again at start
    for model in args.model.split(","):
        server = Server(model, args.max_rows, serve_flags)
        try:
            served = serve_lone(server.url, model, args.max_rows, sizes, args.n)
            records = server.records()
            stages = stage_medians(records, 3, args.n, sizes)
            paths = path_medians(records, served, 3, sizes)
        finally:
            server.stop()
        plan = server.plan
        print(f"\n{model} ({' '.join(serve_flags)}): plan says {plan['latency_ms']:.2f} ms for {plan['batch_rows']} "
              f"items")
        print(f"{'items':>6} {'served':>8} {'plan':>8} {'ratio':>6} {'sim':>8} {'ratio':>6}   stages (median ms)")
        for size in sizes:
            got = statistics.median(served[size]) * 1e3
            planned = plan_latency_ms(plan, size)
            sim = None if args.no_simulate else simulate_lone(model, args.max_rows, sim_flags, size)
            row = {"model": model, "items": size, "served_ms": got, "plan_ms": planned, "sim_ms": sim,
                   "plan_ratio": planned / got if planned else None, "sim_ratio": sim / got if sim else None,
                   "stages_ms": stages[size]}
            results.append(row)
            config = models.get_config(model)
            if size in paths:
                path_points.append((size, paths[size], float(sum(config.pooling))))
            if stages[size].get("host"):
                host_points.append((size, float(sum(config.pooling)), float(len(config.pooling)),
                                    stages[size]["host"] / 1e3))
            fmt = lambda v: f"{v:8.2f}" if v is not None else f"{'-':>8}"  # noqa: E731
            ratio = lambda v: f"{v:6.2f}" if v is not None else f"{'-':>6}"  # noqa: E731
            st = " ".join(f"{k} {v:.2f}" for k, v in stages[size].items() if k != "server")
            print(f"{size:>6} {got:8.2f} {fmt(planned)} {ratio(row['plan_ratio'])} {fmt(sim)} "
                  f"{ratio(row['sim_ratio'])}   {st}")
    load = os.getloadavg()[0]
    print(f"\nload average {load:.2f} at end")
    if args.calibrate:
        from sixfold.partitioner.pricing.served_latency import fit_serving_path, save_serving_path
        fit = fit_serving_path([p[0] for p in path_points], [p[1] for p in path_points],
                               f"calibrated {time.strftime('%Y-%m-%d')} by bench/unloaded_latency.py "
                               f"({args.model}, load average {load:.1f})", [p[2] for p in path_points])
        print(f"serving path: {fit.fixed_s * 1e3:.3f} ms + {fit.per_item_s * 1e6:.2f} us/item + "
              f"{fit.per_id_s * 1e9:.2f} ns/id -> {save_serving_path(fit)}")
        from sixfold.partitioner.pricing.host_stage_fit import fit_host_stage, save_host_stage
        host = fit_host_stage(*[[p[k] for p in host_points] for k in range(4)],
                              f"calibrated {time.strftime('%Y-%m-%d')} by bench/unloaded_latency.py ({args.model}, "
                              f"load average {load:.1f})")
        print(f"host stage: {host.fixed_s * 1e3:.3f} ms + {host.per_bag_s * 1e9:.2f} ns/bag + "
              f"{host.per_id_s * 1e9:.2f} ns/id -> {save_host_stage(host)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"argv": sys.argv[1:], "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
