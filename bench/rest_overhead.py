"""KServe v2 REST vs gRPC on one sixfold-serve process: the same model, requests and clients.

One ``sixfold-serve`` serves both transports. For each concurrency and query
size, closed-loop asyncio clients (tritonclient.grpc.aio and
tritonclient.http.aio: "rest" with binary tensors, tritonclient's default;
"rest-json" with JSON tensors both ways) send
requests for a fixed time; the transports take turns within every round, and the
figures are medians over rounds. Server CPU per request is the server process's
user + system time (``/proc/PID/stat``) over the requests answered.

    .venv/bin/python bench/rest_overhead.py            # ~2 minutes
    .venv/bin/python bench/rest_overhead.py --rounds 1 --seconds 1 --concurrency 1 --items 1   # smoke

It prints a markdown section; paste it into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as tga
import tritonclient.http.aio as tha

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sixfold import models  # noqa: E402
from bench.harness.commands import command  # noqa: E402
from bench.harness.report import machine_line  # noqa: E402
from sixfold.server.workers.process import ReadyProcess  # noqa: E402

MODEL = "rm2"
_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}
_TICK = os.sysconf("SC_CLK_TCK")


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class Run:
    rate: list[float] = field(default_factory=list)
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def _inputs(module, request: dict[str, np.ndarray], binary: bool = True) -> list:
    inputs = []
    for name, array in request.items():
        item = module.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
        item.set_data_from_numpy(array, **({} if binary else {"binary_data": False}))
        inputs.append(item)
    return inputs


async def closed_loop(call, pool: list, concurrency: int, seconds: float) -> list[float]:
    """``concurrency`` workers, each sending its next request when the last one answers."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + seconds

    async def worker(k: int) -> None:
        i = k
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            await call(pool[i % len(pool)])
            latencies.append(time.perf_counter() - t0)
            i += concurrency
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return latencies


async def bench(grpc_url: str, http_url: str, pid: int, args: argparse.Namespace) -> dict:
    gen = models.RequestGenerator.for_config(models.get_config(MODEL, max_rows=args.max_rows), seed=7)
    grpc_client = tga.InferenceServerClient(grpc_url)
    http_client = tha.InferenceServerClient(http_url, conn_limit=max(args.concurrency) * 2)
    outputs = {"grpc": [tga.InferRequestedOutput("scores")], "rest": [tha.InferRequestedOutput("scores")],
               "rest-json": [tha.InferRequestedOutput("scores", binary_data=False)]}
    calls = {t: (lambda inputs, t=t: (grpc_client if t == "grpc" else http_client).infer(MODEL, inputs,
                                                                                           outputs=outputs[t]))
             for t in outputs}
    results: dict = {}
    try:
        for items in args.items:
            requests = [gen.make(items) for _ in range(16)]
            pools = {"grpc": [_inputs(tga, r) for r in requests], "rest": [_inputs(tha, r) for r in requests],
                     "rest-json": [_inputs(tha, r, binary=False) for r in requests]}
            for transport in calls:  # warm up connections and the server's first batches
                await closed_loop(calls[transport], pools[transport], max(args.concurrency), 0.5)
            for concurrency in args.concurrency:
                runs = {t: Run() for t in calls}
                for r in range(args.rounds):
                    order = list(calls)[r % 3:] + list(calls)[:r % 3]  # each transport goes first once
                    for transport in order:
                        cpu0 = server_cpu_s(pid)
                        t0 = time.perf_counter()
                        lat = await closed_loop(calls[transport], pools[transport], concurrency, args.seconds)
                        elapsed, cpu = time.perf_counter() - t0, server_cpu_s(pid) - cpu0
                        run = runs[transport]
                        run.rate.append(len(lat) / elapsed)
                        run.p50.append(float(np.percentile(lat, 50)) * 1e3)
                        run.p99.append(float(np.percentile(lat, 99)) * 1e3)
                        run.cpu.append(cpu / len(lat) * 1e3)
                results[(concurrency, items)] = runs
                print(f"  done: concurrency {concurrency}, {items} items", file=sys.stderr)
    finally:
        await grpc_client.close()
        await http_client.close()
    return results


def table(results: dict) -> str:
    med = statistics.median
    lines = ["| concurrency | items | transport | infer/s | p50 ms | p99 ms | server CPU ms/req |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    for (concurrency, items), runs in sorted(results.items()):
        for transport, run in runs.items():
            lines.append(f"| {concurrency} | {items} | {transport} | {med(run.rate):.0f} | {med(run.p50):.2f} | "
                         f"{med(run.p99):.2f} | {med(run.cpu):.2f} |")
        g = runs["grpc"]
        for name, r in (("REST/gRPC", runs["rest"]), ("REST JSON/gRPC", runs["rest-json"])):
            lines.append(f"| {concurrency} | {items} | **{name}** | {med(r.rate) / med(g.rate):.2f} | "
                         f"{med(r.p50) / med(g.p50):.2f} | {med(r.p99) / med(g.p99):.2f} | "
                         f"{med(r.cpu) / med(g.cpu):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--items", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per setting (medians over them)")
    p.add_argument("--seconds", type=float, default=3.0, help="length of one measured run")
    p.add_argument("--max-rows", type=int, default=20000, help="rows per embedding table of the served rm2")
    args = p.parse_args(argv)
    cmd = [*command("sixfold-serve"), "--model", MODEL, "--max-rows", str(args.max_rows),
           "--grpc-port", "0", "--http-port", "0", "--metrics-port", "-1", "--log-level", "WARNING"]
    load_before = os.getloadavg()
    server = ReadyProcess(cmd, timeout_s=300)
    try:
        found = re.search(r"REST http://([\d.]+:\d+)/v2", server.output)
        if not server.url or not found:
            print(server.output, file=sys.stderr)
            return 1
        started = time.perf_counter()
        results = asyncio.run(bench(server.url, found.group(1), server.pid, args))
        took = time.perf_counter() - started
    finally:
        server.stop()
    loads = " / ".join(" ".join(f"{x:.2f}" for x in load) for load in (load_before, os.getloadavg()))
    print(f"\n## KServe v2 REST vs gRPC\n\n{machine_line()}; load average (1/5/15 min) before / after: "
          f"{loads}; {took:.0f} s of measuring.\n"
          f"`{' '.join(['bench/rest_overhead.py', *(argv if argv is not None else sys.argv[1:])])}`: "
          f"{MODEL} (max-rows {args.max_rows}, 6 simcards) served once by sixfold-serve; closed-loop "
          f"tritonclient aio clients in the bench process (rest: binary tensors both ways, tritonclient's "
          f"default; rest-json: JSON tensors both ways), {args.rounds} alternating rounds of "
          f"{args.seconds:.0f} s per setting; medians over rounds.\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
