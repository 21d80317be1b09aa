"""``--find-max-qps``: the highest offered load whose p99 latency stays under a target.

Like MLPerf's Server scenario and perf_analyzer's binary search, each step is a
short, bounded open-loop run (same arrival process and query sizes as a
normal run) over one connection to the server:

1. Sweep: start at ``min_qps`` and double until a step fails or ``max_qps``
   is reached (the last step is clamped to ``max_qps``). If the very first step
   fails, halve instead until a step passes or the rate would drop below
   ``floor_qps`` (the last step is clamped to it): a slow server still gets an
   answer rather than "none".
2. Binary search between the highest passing and the lowest failing rate,
   until they are within ``tolerance`` of each other or ``max_steps`` steps ran.

A step passes when its p99 (from scheduled time, so queueing counts) is at most
``p99_ms``, at most ``max_error_rate`` of its requests failed, and the server
answered at least 90% of the scheduled rate. The answer is the highest passing
rate (None when even ``floor_qps`` fails). Each step uses a new seed so that steps
are independent draws; after a failing step the server gets ``settle_s`` to
empty its queues before the next step starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from sixfold.loadgen.clock import Clock, MonotonicClock
from sixfold.loadgen.config import LoadConfig
from sixfold.loadgen.report import Report, endpoint_note
from sixfold.loadgen.runner import ClientFactory, Target, drive, plan_run, resolve_config, summarize

__all__ = ["SweepConfig", "find_max_qps", "find_max_qps_async", "step_passes", "print_sweep", "answer_line"]


@dataclass(frozen=True)
class SweepConfig:
    """How to search; see the module docstring for the algorithm."""

    p99_ms: float
    """Latency target: a step passes only if its p99 is at most this."""
    min_qps: float = 10.0
    """The first step's rate."""
    max_qps: float = 10_000.0
    floor_qps: float = 0.25
    """The lowest rate tried when the first step fails."""
    step_duration_s: float = 10.0
    """Measured window of each step (the run's ``warmup_s`` comes before it)."""
    tolerance: float = 0.05
    """Stop the binary search when (fail - pass) <= tolerance x pass."""
    max_steps: int = 16
    max_error_rate: float = 0.0
    settle_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("p99_ms", "min_qps", "max_qps", "floor_qps", "step_duration_s", "tolerance"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if self.min_qps > self.max_qps:
            raise ValueError(f"min_qps {self.min_qps:g} is above max_qps {self.max_qps:g}")
        if self.floor_qps > self.min_qps:
            raise ValueError(f"floor_qps {self.floor_qps:g} is above min_qps {self.min_qps:g}")
        if self.max_steps < 1 or not 0 <= self.max_error_rate < 1 or self.settle_s < 0:
            raise ValueError("max_steps must be >= 1, 0 <= max_error_rate < 1, settle_s >= 0")


def step_passes(report: Report, sweep: SweepConfig) -> bool:
    """Does this step's report meet the target? (p99, error rate, server kept up)."""
    p99, req = report.latency_ms["p99"], report.requests
    if p99 is None or p99 > sweep.p99_ms:
        return False
    if req["errors"] > sweep.max_error_rate * max(1, req["sent"]):
        return False
    return report.achieved_qps >= 0.9 * report.scheduled_qps


def _row(report: Report, phase: str, passed: bool) -> dict[str, Any]:
    return {"qps": round(float(report.offered_qps), 3), "phase": phase,
            "achieved_qps": float(report.achieved_qps), "scheduled_qps": float(report.scheduled_qps),
            "p50_ms": report.latency_ms["p50"], "p99_ms": report.latency_ms["p99"],
            "errors": int(report.requests["errors"]), "sent": int(report.requests["sent"]),
            "send_lag_p99_ms": report.send_lag_ms["p99"], "pass": bool(passed)}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def print_sweep(report: Report, console: Console) -> None:
    """The step table and the answer."""
    slo = report.slo or {}
    table = Table(title=Text(f"find-max-qps  {report.target.get('model', '')} @ {report.target.get('url', '')}"
                             f"{endpoint_note(report.target)}  "
                             f"(p99 <= {slo.get('p99_ms', 0):g} ms)"), header_style="bold")
    for name in ("step", "phase", "qps", "achieved", "sent", "p50 ms", "p99 ms", "errors", "result"):
        table.add_column(name, justify="left" if name in ("phase", "result") else "right")
    for k, row in enumerate(report.sweep or []):
        table.add_row(str(k + 1), row["phase"], f"{row['qps']:,.1f}", _fmt(row["achieved_qps"]), str(row["sent"]),
                      _fmt(row["p50_ms"]), _fmt(row["p99_ms"]), str(row["errors"]),
                      Text("pass", style="green") if row["pass"] else Text("FAIL", style="red"))
    console.print(table)
    few = [k + 1 for k, row in enumerate(report.sweep or []) if row["sent"] < 100]
    if few:  # NOTE: with under 100 samples, "p99" is the slowest request or close to it
        console.print(f"steps {', '.join(map(str, few))} sent under 100 requests: their p99 is about their max; "
                      "a longer --step-duration gives a steadier answer", markup=False, highlight=False)
    console.print(Text(answer_line(report), style="bold"))


def answer_line(report: Report) -> str:
    """``max QPS with p99 <= 60 ms: 123.4`` (or ``none (even 0.25 q/s fails)``): the search's answer."""
    slo = report.slo or {}
    best = report.max_qps_under_slo
    return (f"max QPS with p99 <= {slo.get('p99_ms', 0):g} ms: "
            + (f"{best:,.1f}" if best is not None
               else f"none (even {slo.get('floor_qps', slo.get('min_qps', 0)):g} q/s fails)"))


async def find_max_qps_async(config: LoadConfig, sweep: SweepConfig, *, console: Console | None = None,
                             clock: Clock | None = None, client_factory: ClientFactory | None = None) -> Report:
    """Search as the module docstring says; returns the best passing step's Report (else the last
    step's) with ``sweep``, ``max_qps_under_slo`` and ``slo`` filled in."""
    if config.concurrency is not None or config.replay_path is not None:
        raise ValueError("--find-max-qps searches open-loop rates: it cannot be combined with "
                         "--concurrency or --replay")
    clock = clock or MonotonicClock()
    config = resolve_config(config)
    rows: list[dict[str, Any]] = []
    best: Report | None = None
    last: Report | None = None
    async with Target(config, client_factory) as target:
        assert target.transport is not None and target.shape is not None

        async def step(qps: float, phase: str) -> bool:
            nonlocal best, last
            step_config = dataclasses.replace(config, qps=qps, duration_s=sweep.step_duration_s,
                                              seed=config.seed + len(rows), record_path=None)
            schedule = plan_run(step_config, target.shape, target.transport.prepare)
            if console is not None:
                console.print(f"step {len(rows) + 1} ({phase}): {qps:,.1f} q/s for "
                              f"{step_config.warmup_s + sweep.step_duration_s:g} s", markup=False, highlight=False)
            record, started_at, wall_s = await drive(step_config, schedule, target.transport, clock=clock,
                                                     console=console)
            report = summarize(record, step_config, target.describe(schedule), started_at=started_at,
                               wall_s=wall_s)
            passed = step_passes(report, sweep)
            rows.append(_row(report, phase, passed))
            last = report
            if passed and (best is None or qps > best.offered_qps):
                best = report
            if console is not None:
                r = rows[-1]
                console.print(f"  -> achieved {_fmt(r['achieved_qps'])} q/s, p50 {_fmt(r['p50_ms'])} ms, "
                              f"p99 {_fmt(r['p99_ms'])} ms, errors {r['errors']}: "
                              f"{'pass' if passed else 'FAIL'}", markup=False, highlight=False)
            if not passed and sweep.settle_s:
                await asyncio.sleep(sweep.settle_s)
            return passed

        low: float | None = None
        high: float | None = None
        qps = sweep.min_qps
        while len(rows) < sweep.max_steps:
            if not await step(qps, "sweep"):
                high = qps
                break
            low = qps
            if qps >= sweep.max_qps:
                break
            qps = min(qps * 2, sweep.max_qps)
        while low is None and high is not None and high > sweep.floor_qps and len(rows) < sweep.max_steps:
            qps = max(high / 2, sweep.floor_qps)
            if await step(qps, "down"):
                low = qps
            else:
                high = qps
        while (low is not None and high is not None and high - low > sweep.tolerance * low
               and len(rows) < sweep.max_steps):
            mid = (low + high) / 2
            if await step(mid, "search"):
                low = mid
            else:
                high = mid
    report = best or last
    assert report is not None
    report = dataclasses.replace(report, sweep=rows, max_qps_under_slo=low,
                                 slo={"p99_ms": sweep.p99_ms, "min_qps": sweep.min_qps, "max_qps": sweep.max_qps,
                                      "floor_qps": sweep.floor_qps,
                                      "step_duration_s": sweep.step_duration_s, "tolerance": sweep.tolerance,
                                      "max_error_rate": sweep.max_error_rate})
    return report


def find_max_qps(config: LoadConfig, sweep: SweepConfig, *, console: Console | None = None) -> Report:
    """Blocking ``find_max_qps_async`` on a fresh event loop."""
    return asyncio.run(find_max_qps_async(config, sweep, console=console))
