"""Spread one open-loop run over several processes when one generator cannot keep its schedule.

Each child prepares its own query pool at 1/N of the rate (its own seed), the
parent starts them all at the same instant, and their records are merged into
one report. The sum of N independent Poisson processes at rate q/N is a Poisson
process at rate q, so the merged schedule is the one asked for. Times come
from the system-wide monotonic clock, so the children's records line up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing as mp
import time
from typing import Any

import numpy as np
from rich.console import Console

from sixfold.loadgen.clock import MonotonicClock
from sixfold.loadgen.config import LoadConfig
from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.report import Report
from sixfold.loadgen.runner import Target, drive, plan_run, summarize

__all__ = ["run_load_processes", "split_config", "merge_records"]

_SPREADABLE = ("poisson", "constant", "bursty", "diurnal")


def split_config(config: LoadConfig, processes: int, index: int) -> LoadConfig:
    """Child ``index``'s share: 1/N of the rate and of the request bound, its own seed."""
    per = None if config.max_requests is None else math.ceil(config.max_requests / processes)
    return dataclasses.replace(config, qps=config.qps / processes, seed=config.seed + 7919 * (index + 1),
                               max_requests=per, record_path=None)


def _check(config: LoadConfig, processes: int) -> None:
    if processes < 1:
        raise ValueError(f"--processes must be >= 1, got {processes}")
    kind = config.arrival.split(":", 1)[0].strip().lower()
    if config.concurrency is not None or config.replay_path or config.record_path or kind not in _SPREADABLE:
        raise ValueError(f"--processes spreads open-loop runs with {', '.join(_SPREADABLE)} arrivals; "
                         "not closed loop, --replay, --record or trace arrivals")


async def _child_async(config: LoadConfig, conn: Any) -> dict[str, Any]:
    async with Target(config) as target:
        assert target.transport is not None and target.shape is not None
        schedule = plan_run(config, target.shape, target.transport.prepare)
        conn.send("ready")
        start_at = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        record, started_at, _ = await drive(config, schedule, target.transport, clock=MonotonicClock())
        n = len(record)
        return {"t0": record.t0, "due": record.due[:n], "items": record.items[:n], "sent": record.sent[:n],
                "done": record.done[:n], "status": record.status[:n], "reasons": record.reasons,
                "target": target.describe(schedule), "started_at": started_at}


def _child(config: LoadConfig, conn: Any) -> None:
    try:
        conn.send(("ok", asyncio.run(_child_async(config, conn))))
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def merge_records(parts: list[dict[str, Any]]) -> RunRecord:
    """One record of every child's requests, on the earliest child's time origin, in due order."""
    t0 = min(p["t0"] for p in parts)
    shift = [p["t0"] - t0 for p in parts]
    due = np.concatenate([p["due"] + s for p, s in zip(parts, shift)])
    order = np.argsort(due, kind="stable")
    record = RunRecord(due[order], np.concatenate([p["items"] for p in parts])[order])
    record.t0 = t0
    record.sent = np.concatenate([p["sent"] + s for p, s in zip(parts, shift)])[order]
    record.done = np.concatenate([p["done"] + s for p, s in zip(parts, shift)])[order]
    record.status = np.concatenate([p["status"] for p in parts])[order]
    where = np.empty_like(order)
    where[order] = np.arange(order.size)
    base = np.cumsum([0] + [len(p["due"]) for p in parts])
    record.reasons = {int(where[b + i]): r for p, b in zip(parts, base) for i, r in p["reasons"].items()}
    record.sent_count = int(np.isfinite(record.sent).sum())
    finished = np.flatnonzero(np.isfinite(record.done))
    record.order[:finished.size] = finished[np.argsort(record.done[finished], kind="stable")]
    record.finished = int(finished.size)
    record.errors = len(record.reasons)
    return record


def run_load_processes(config: LoadConfig, processes: int, *, console: Console | None = None,
                       start_timeout_s: float = 120.0) -> Report:
    """Run ``config`` from ``processes`` generator processes started together; one merged Report."""
    _check(config, processes)
    ctx = mp.get_context("spawn")
    pipes, children = [], []
    for i in range(processes):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(split_config(config, processes, i), child), daemon=True)
        proc.start()
        pipes.append(parent)
        children.append(proc)
    try:
        for pipe in pipes:
            if not pipe.poll(start_timeout_s):
                raise TimeoutError(f"a generator process was not ready within {start_timeout_s:.0f}s")
            message = pipe.recv()
            if message != "ready":
                raise RuntimeError(f"a generator process failed: {message[1]}")
        if console is not None:
            console.print(f"{processes} generator processes ready; each sends {config.qps / processes:g} q/s",
                          markup=False, highlight=False)
        start_at = time.monotonic() + 0.2
        wall = time.perf_counter()
        for pipe in pipes:
            pipe.send(start_at)
        parts = []
        deadline = config.warmup_s + config.duration_s + config.drain_timeout_s + 60
        for pipe in pipes:
            if not pipe.poll(deadline):
                raise TimeoutError("a generator process did not finish in time")
            status, payload = pipe.recv()
            if status != "ok":
                raise RuntimeError(f"a generator process failed: {payload}")
            parts.append(payload)
    finally:
        for proc in children:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    record = merge_records(parts)
    report = summarize(record, config, {**parts[0]["target"], "processes": processes},
                       started_at=min(p["started_at"] for p in parts), wall_s=time.perf_counter() - wall)
    report.config["processes"] = processes
    return report
