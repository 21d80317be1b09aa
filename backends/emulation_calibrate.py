"""How fast an emulated card computes on this host: measured once on a small real ONNX graph, cached.

An emulated card (``simcard``) answers at the later of its spec's modelled time and the real time its
functional backend takes: one single-thread ONNX Runtime session per card (shared by the cards that load
the same partition), all on the host's own cores. On a host with fewer usable cores than cards that real
time is what a client waits for, and the spec (an m2-card's) says nothing about it. This module measures it:

Every measuring thread runs as nice as simcard's card workers (``DEFAULT_WORKER_NICE``): on a host busy with
other work they get the share the cards get.

- ``alone``: seconds of one single-thread session on an MLP (``spec_calibrate.mlp_partition``, the shape of a
  recommendation model's top MLP) at a few batch sizes, one call at a time: a per-call cost plus FLOP/s
  that grow with the batch (small GEMMs are slow);
- ``call_overhead_s``: what a call through simcard itself adds (its worker thread's hand-off), on one row;
- ``sharing``: with ``k`` cards computing at once (``k`` threads on the one shared session, as simcard runs
  them), how much longer each call takes than alone, ``k`` = 1 .. ``MAX_SHARING``: on 2 usable cores about
  ``k / 2`` from 3 on.

``sixfold.partitioner.pricing.emulated_card`` prices a dense partition with it. The figures are cached beside
``--host-spec auto``'s (``emulated-card-<machine>.json``); delete the file to measure again.
"""

from __future__ import annotations

from sixfold.backends.host.native import write_json_atomic
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["EmulationCalibration", "calibrate_emulation", "emulation_file", "load_emulation", "auto_emulation",
           "CALIBRATE_ROWS", "MAX_SHARING"]

CALIBRATE_ROWS: tuple[int, ...] = (1, 16, 64, 128, 256, 512)
"""Batch sizes the lone session is timed at; a part of a split batch is 64-512 rows, a small batch 1-64."""
MAX_SHARING = 6
"""Cards computing at once that the sharing factor is measured for (sixfold-serve emulates six by default)."""
SHARING_ROWS = 128
"""Rows per call while measuring sharing: the size of a part of a split MLPerf query (700 items over 6 cards)."""
WIDTH, LAYERS = 512, 3
TRIES = 3
"""Each sharing figure is the fastest of this many tries (the host may be busy with other work)."""


@dataclass(frozen=True)
class EmulationCalibration:
    """One host's emulated-card speed: lone calls at ``rows`` took ``seconds``; ``sharing[k-1]``: slowdown at k."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    flops_per_item: float
    """FLOPs per row of the graph the seconds were measured on."""
    sharing: tuple[float, ...]
    """Wall time of one call with ``k`` calls running at once over its time alone, k = 1, 2, ...: 1.0 first."""
    usable_cores: int
    source: str = field(default="")
    """Where and when it was measured (machine, load average)."""
    call_overhead_s: float = 0.0
    """What a call through simcard adds to the session's own time (the hand-off to its worker thread and back)."""

    @property
    def effective_cores(self) -> float:
        """The cores the cards' threads share, fitted from ``sharing``: the median of ``k / sharing[k-1]``
        over k >= 2, between 1 and ``usable_cores``. One figure, so one noisy k (a busy host) cannot bend it."""
        fits = [k / s for k, s in enumerate(self.sharing, start=1) if k >= 2 and s > 0]
        if not fits:
            return float(self.usable_cores)
        return min(float(self.usable_cores), max(1.0, statistics.median(fits)))

    def sharing_factor(self, k: int) -> float:
        """Slowdown of each of ``k`` cards computing at once: ``max(1, k / effective_cores)`` (time-sharing)."""
        return max(1.0, k / self.effective_cores) if k > 1 else 1.0

    @property
    def seconds_per_row(self) -> float:
        """The calibration graph's time per row: the median of the slopes from the smallest size to each other
        (a call is linear in its rows here; the median keeps one size slowed by another process out)."""
        r0, s0 = self.rows[0], self.seconds[0]
        return max(0.0, statistics.median((s - s0) / (r - r0) for r, s in zip(self.rows[1:], self.seconds[1:])))

    def alone_seconds(self, flops_per_item: float, rows: int) -> float:
        """One card's call on ``rows`` items of a partition of ``flops_per_item``, alone: the calibration graph's
        time at the smallest size plus ``seconds_per_row`` for each row more, scaled by the FLOPs ratio, plus
        simcard's own hand-off."""
        at = self.seconds[0] + self.seconds_per_row * max(0, rows - self.rows[0])
        return at * flops_per_item / self.flops_per_item + self.call_overhead_s

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "EmulationCalibration":
        cal = cls(tuple(int(r) for r in data["rows"]), tuple(float(s) for s in data["seconds"]),
                  float(data["flops_per_item"]), tuple(float(s) for s in data["sharing"]),
                  int(data["usable_cores"]), str(data.get("source", "")), float(data.get("call_overhead_s", 0.0)))
        if len(cal.rows) != len(cal.seconds) or len(cal.rows) < 2 or not cal.sharing or cal.flops_per_item <= 0:
            raise ValueError("emulation calibration: needs >= 2 (rows, seconds) points, sharing factors and FLOPs")
        return cal


def _session(seed: int = 0):  # noqa: ANN202 - an onnxruntime.InferenceSession
    import onnxruntime as ort

    from sixfold.backends.spec_calibrate import mlp_partition

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as simcard's functional backend: one thread per card
    options.inter_op_num_threads = 1
    return ort.InferenceSession(mlp_partition(width=WIDTH, layers=LAYERS, seed=seed).payload, options,
                                providers=["CPUExecutionProvider"])


def _as_card_thread() -> None:
    """Run the calling thread as nice as simcard runs its card workers: on a busy host they get the same share."""
    from sixfold.backends.builtin.simcard import DEFAULT_WORKER_NICE
    from sixfold.backends.os_threads import lower_this_thread
    lower_this_thread(DEFAULT_WORKER_NICE)


def _in_card_thread(fn):  # noqa: ANN001, ANN202
    """``fn()`` on a thread of its own, as nice as a card worker."""
    out: list = []

    def run() -> None:
        _as_card_thread()
        out.append(fn())

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=600)
    if not out:
        raise RuntimeError("emulation calibration: a measuring thread did not finish in 600 s")
    return out[0]


def _lone_seconds(session, rows: int, budget_s: float) -> float:  # noqa: ANN001
    feed = {"x": np.random.default_rng(rows).standard_normal((rows, WIDTH)).astype(np.float32)}
    session.run(None, feed)  # warm-up
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 200 and (len(times) < 5 or time.perf_counter() < deadline):
        t0 = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return statistics.quantiles(times, n=4)[0]  # the lower quartile: other processes only ever slow a call


def _shared_seconds(session, k: int, calls: int) -> float:  # noqa: ANN001
    """Wall time per call while ``k`` threads each make ``calls`` calls on ``session`` back to back."""
    feed = {"x": np.random.default_rng(k).standard_normal((SHARING_ROWS, WIDTH)).astype(np.float32)}
    start = threading.Barrier(k + 1)
    session.run(None, feed)  # warm-up

    def worker() -> None:
        _as_card_thread()
        start.wait()
        for _ in range(calls):
            session.run(None, feed)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(k)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join(timeout=600)
    return (time.perf_counter() - t0) / calls


def _simcard_overhead(session, calls: int = 30) -> float:  # noqa: ANN001
    """Lower quartile of (a 1-row call through a simcard whose spec is instant) less (the session's own call):
    what the emulation's plumbing adds. Run on a loop of its own in a thread: the caller may be inside one."""
    import asyncio
    import dataclasses

    from sixfold.backends.api import CardRef
    from sixfold.backends.builtin.simcard import SimCardBackend
    from sixfold.backends.spec_calibrate import mlp_partition
    from sixfold.backends.spec_catalog import load_spec

    base = load_spec("m2-card")
    card = CardRef(0, "m2-card")
    instant = dataclasses.replace(base, name=card.device_name, link_latency_s=0.0, link_bandwidth=1e15,
                                  memory_bandwidth=1e15, peak_flops={k: 1e18 for k in base.peak_flops})
    feed = {"x": np.random.default_rng(1).standard_normal((1, WIDTH)).astype(np.float32)}
    out: list[float] = []

    def measure() -> None:
        exe = SimCardBackend().load(mlp_partition(width=WIDTH, layers=LAYERS).for_card(card), instant)

        async def calls_through() -> list[float]:
            await exe.infer(feed)
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                await exe.infer(feed)
                times.append(time.perf_counter() - t0)
            return times

        try:
            through = asyncio.run(calls_through())
        finally:
            exe.close()
        own = []
        for _ in range(calls):
            t0 = time.perf_counter()
            session.run(None, feed)
            own.append(time.perf_counter() - t0)
        out.append(max(0.0, statistics.quantiles(through, n=4)[0] - statistics.quantiles(own, n=4)[0]))

    worker = threading.Thread(target=measure, daemon=True)
    worker.start()
    worker.join(timeout=120)
    return out[0] if out else 0.0


def calibrate_emulation(seconds_budget: float = 4.0, *, rows: Sequence[int] = CALIBRATE_ROWS,
                        max_sharing: int = MAX_SHARING) -> EmulationCalibration:
    """Measure this host's emulated-card speed in about ``seconds_budget`` seconds (half lone, half sharing)."""
    if seconds_budget <= 0 or max_sharing < 1 or len(set(rows)) < 2 or min(rows) < 1:
        raise ValueError(f"calibrate_emulation: seconds_budget > 0, max_sharing >= 1 and >= 2 distinct rows >= 1 "
                         f"needed, got {seconds_budget}, {max_sharing}, {list(rows)}")
    from sixfold.backends.host.calibrate import machine_key
    from sixfold.backends.host.usable_cores import usable_cores

    session = _session()
    rows = tuple(sorted(set(rows)))
    lone = tuple(_in_card_thread(lambda r=r: _lone_seconds(session, r, seconds_budget / 2 / len(rows))) for r in rows)
    base = min(_shared_seconds(session, 1, 5) for _ in range(TRIES))
    # calls per try so that all k fit the other half of the budget: k x calls x base x (k / cores) per try
    cores = usable_cores().count
    work = TRIES * sum(k * max(1.0, k / cores) for k in range(2, max_sharing + 1))
    calls = max(5, min(50, int(seconds_budget / 2 / (work * base))))
    # the fastest of TRIES tries: another process's burst only ever slows one down
    sharing = [1.0] + [max(1.0, min(_shared_seconds(session, k, calls) for _ in range(TRIES)) / base)
                       for k in range(2, max_sharing + 1)]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    return EmulationCalibration(rows, lone, 2.0 * WIDTH * WIDTH * LAYERS, tuple(sharing), cores,
                                f"measured {time.strftime('%Y-%m-%d')} on {machine_key()}, load average {load:.1f}",
                                _simcard_overhead(session))


def emulation_file() -> Path:
    """This machine's cached calibration (beside ``--host-spec auto``'s cache)."""
    from sixfold.backends.host.calibrate import cache_dir, machine_key
    return cache_dir() / f"emulated-card-{machine_key()}.json"


def load_emulation(path: Path | None = None) -> EmulationCalibration | None:
    """The cached calibration, or None when there is none (or it is damaged)."""
    try:
        return EmulationCalibration.from_dict(json.loads((path or emulation_file()).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def auto_emulation(seconds_budget: float | None = None, path: Path | None = None) -> EmulationCalibration:
    """The cached calibration; measured first (saying so on stderr) when there is none. Atomic write."""
    path = path or emulation_file()
    found = load_emulation(path)
    if found is not None:
        return found
    budget = seconds_budget or float(os.environ.get("SIXFOLD_CALIBRATE_SECONDS", "4"))
    print(f"sixfold: measuring this host's emulated-card speed once ({budget:g} s); cached in {path}", file=sys.stderr)
    cal = calibrate_emulation(budget)
    write_json_atomic(path, cal.to_dict())
    return cal
