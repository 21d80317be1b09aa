"""Card faults benchmark: every card hangs under open-loop load; how many requests go unanswered?

Three runs against a server in its own process (rm1 on 6 simcards by default), each
``--duration`` seconds of Poisson arrivals at ``--qps``, every request with a client
deadline of ``--deadline-s``:

  healthy        no faults, default card health: the largest observed / expected card
                 time (how far a healthy card is from its hang deadline) and any false fault
  before         every card hangs on every batch (so does a restarted one), with the old
                 behaviour: a fixed 30 s timeout, no hedging, no host fallback
  after          the same faults with the defaults: deadline max(0.5 s, 10 x expected),
                 hedge at a quarter of it, the host's dense fallback when no card can answer
  before-cyclic  ``backends/specs/faults/hang.json`` on every card (20 batches, then it never
  after-cyclic   answers; a restarted card the same): cards come and go

Per run: requests unanswered by their deadline (the goal is 0), p50/p99 latency of the
answered ones (from the scheduled send time), the errors clients saw, and the server's
failure and card-fault counters by reason.

    .venv/bin/python bench/card_faults.py                    # ~1.5 min; writes its BENCHMARKS.md section
    .venv/bin/python bench/card_faults.py --duration 10 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness.report import machine_line, publish  # noqa: E402

__all__ = ["MODES", "RunResult", "run_mode"]

HANG = {"hang": True}
CYCLIC = {"crash_after": 20, "hang": True}  # backends/specs/faults/hang.json
OLD = {"card_timeout_multiple": 0.0, "card_timeout_floor_s": 30.0, "hedge_fraction": 0.0, "dense_fallback": False}
MODES: dict[str, dict[str, Any]] = {
    "healthy": {"faults": None, "runtime": {}},
    "before": {"faults": HANG, "runtime": OLD},
    "after": {"faults": HANG, "runtime": {}},
    "before-cyclic": {"faults": CYCLIC, "runtime": OLD},
    "after-cyclic": {"faults": CYCLIC, "runtime": {}},
}
"""Each run's simcard faults and the PlanRuntime card-health settings it overrides."""


def _serve_child(model: str, cards: int, faults: dict | None, runtime: dict[str, Any], conn: Any) -> None:
    """In a child process: serve ``model`` on simcards; report the runtime's card-health counters at the end."""
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.server.app import BackgroundServer, ServerConfig
    from sixfold.server.scheduling.batcher import BatchingConfig
    from sixfold.server.core import InferenceCore
    from sixfold.server.loading.loader import load_partitioned
    from sixfold.server.observability.metrics import ServerMetrics

    _, partitioned = partition_builtin(model, max_rows=2000, seed=3, cards=cards)
    metrics = ServerMetrics()
    served = load_partitioned(partitioned, backend="simcard", metrics=metrics, batching=BatchingConfig(),
                              backend_options={"faults": faults} if faults else None,
                              card_timeout_multiple=runtime.pop("card_timeout_multiple", 10.0),
                              card_timeout_floor_s=runtime.pop("card_timeout_floor_s", 0.5))
    for name, value in runtime.items():  # settings the loader does not take (hedging, the fallback)
        if name == "hedge_fraction":
            from dataclasses import replace
            served.runtime.deadlines = replace(served.runtime.deadlines, hedge_fraction=value)
        else:
            setattr(served.runtime, name, value)
    background = BackgroundServer(InferenceCore([served]), ServerConfig(grpc_port=0, metrics_port=None),
                                  metrics).start()
    conn.send(background.url)
    try:
        conn.recv()  # "stop"
    except EOFError:
        return
    rt = served.runtime
    m = metrics.for_model(served.name, served.version)
    faults_by_kind: dict[str, int] = {}
    for (_, kind), n in rt.fault_counts.items():
        faults_by_kind[kind] = faults_by_kind.get(kind, 0) + n
    conn.send({"failures": dict(m.failures), "card_faults": faults_by_kind, "hedges": rt.hedges,
               "hedge_wins": rt.hedge_wins, "host_fallbacks": rt.host_fallbacks,
               "slowest_card_ratio": rt.slowest_card_ratio, "slowest_card_s": rt.slowest_card_s, "batches": m.batches,
               "floor_s": rt.deadlines.floor_s, "multiple": rt.deadlines.multiple})
    os._exit(0)  # NOTE: hung simulated cards may hold threads; the parent has what it needs


@dataclass
class RunResult:
    mode: str
    sent: int = 0
    ok: int = 0
    unanswered: int = 0
    """Requests with no answer (result or error) by their deadline."""
    errors: dict[str, int] = field(default_factory=dict)
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)


async def _drive(url: str, model: str, qps: float, duration: float, deadline: float, seed: int) -> RunResult:
    import tritonclient.grpc.aio as tca
    from tritonclient.utils import InferenceServerException

    from sixfold import models

    def triton_inputs(request: dict[str, np.ndarray]) -> list:
        inputs = []
        for name, array in request.items():
            item = tca.InferInput(name, list(array.shape), {np.float32: "FP32", np.int32: "INT32",
                                                            np.int64: "INT64"}[array.dtype.type])
            item.set_data_from_numpy(array)
            inputs.append(item)
        return inputs

    rng = np.random.default_rng(seed)
    gen = models.RequestGenerator.for_config(models.get_config(model, max_rows=2000), seed=seed)
    pool = [gen.make(int(n)) for n in rng.integers(1, 65, 64)]
    n = int(qps * duration)
    starts = np.cumsum(rng.exponential(1 / qps, n))
    result = RunResult(mode="")
    latencies: list[float] = []
    async with tca.InferenceServerClient(url) as client:
        t0 = time.perf_counter()

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + starts[i] - time.perf_counter()))
            scheduled = t0 + starts[i]
            try:
                await client.infer(model, triton_inputs(pool[i % len(pool)]), client_timeout=deadline)
                latency = time.perf_counter() - scheduled
                latencies.append(latency)
                result.ok += 1
                result.unanswered += latency > deadline
            except InferenceServerException as exc:
                status = str(exc.status()).removeprefix("StatusCode.")
                result.errors[status] = result.errors.get(status, 0) + 1
                result.unanswered += status == "DEADLINE_EXCEEDED" or time.perf_counter() - scheduled > deadline

        await asyncio.gather(*(one(i) for i in range(n)))
    result.sent = n
    if latencies:
        ms = np.array(latencies) * 1e3
        result.p50_ms, result.p99_ms, result.max_ms = (round(float(v), 1) for v in
                                                       (np.percentile(ms, 50), np.percentile(ms, 99), ms.max()))
    return result


def run_mode(mode: str, *, model: str, cards: int, qps: float, duration: float, deadline: float,
             seed: int = 1) -> RunResult:
    """One run in a fresh server process."""
    import multiprocessing

    spec = MODES[mode]
    spawn = multiprocessing.get_context("spawn")
    conn, child = spawn.Pipe()
    process = spawn.Process(target=_serve_child, args=(model, cards, spec["faults"], dict(spec["runtime"]), child),
                            daemon=True)
    process.start()
    try:
        if not conn.poll(180):
            raise RuntimeError("server process did not start in 180 s")
        url = conn.recv()
        result = asyncio.run(_drive(url, model, qps, duration, deadline, seed))
        result.mode = mode
        conn.send("stop")
        if conn.poll(30):
            result.server = conn.recv()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()
    return result


def _table(results: list[RunResult], args: argparse.Namespace, load: str) -> str:
    lines = [f"`bench/card_faults.py --model {args.model} --cards {args.cards} --qps {args.qps:g} --duration "
             f"{args.duration:g} --deadline-s {args.deadline_s:g}` ({machine_line(f'load average {load}')}): "
             f"`before`/`after`: every card hangs on every batch (restarts too); `-cyclic`: every card runs "
             f"`faults/hang.json` (20 batches, then never answers; restarts too); `before*`: the old fixed "
             f"30 s timeout, no hedging, no host fallback. Latency from the scheduled send time.",
             "",
             "| run | sent | answered | unanswered by the deadline | p50 ms | p99 ms | max ms | client errors "
             "| server failures by reason | card faults by kind | hedges (won) | host fallbacks "
             "| slowest answered card batch: s, observed/expected |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = r.server

        def kv(d: dict) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

        lines.append(f"| {r.mode} | {r.sent} | {r.ok} | {r.unanswered} | {r.p50_ms} | {r.p99_ms} | {r.max_ms} "
                     f"| {kv(r.errors)} | {kv(s.get('failures', {}))} | {kv(s.get('card_faults', {}))} "
                     f"| {s.get('hedges', '?')} ({s.get('hedge_wins', '?')}) | {s.get('host_fallbacks', '?')} "
                     f"| {s.get('slowest_card_s', 0):.3f}, {s.get('slowest_card_ratio', 0):.0f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="rm1")
    p.add_argument("--cards", type=int, default=6)
    p.add_argument("--qps", type=float, default=60.0)
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    p.add_argument("--deadline-s", type=float, default=2.0, help="each request's client deadline")
    p.add_argument("--modes", default="healthy,before,after,after-cyclic")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    results = []
    for mode in args.modes.split(","):
        results.append(run_mode(mode, model=args.model, cards=args.cards, qps=args.qps, duration=args.duration,
                                deadline=args.deadline_s))
        print(results[-1], file=sys.stderr)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    publish("card-faults", _table(results, args, load), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
