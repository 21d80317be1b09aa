"""Does the plan's cost model predict this host for *your* model? Estimate vs measured, stage by stage.

``sixfold-partition --measure`` (any model: built-in, .pt2 or .onnx):

1. calibrate this host (``backends.calibrate.calibrate_host``, one thread) and
   re-plan the same model with that spec as the host *and* as the card (a
   "card" that is ONNX Runtime on this CPU, no link to cross): the estimate;
2. load the partitions on the backends the server uses (the host stage by its
   format: torch, host-embedding or ONNX Runtime; ONNX Runtime with one
   thread for each dense stage; table shards on cards are not measured) and
   time each stage on its own over ``batches`` distinct batches of the plan's
   ``batch_rows`` items from the plan's own traffic (``accuracy.plan_requests``),
   median of ``runs`` runs after a warm-up: the measurement;
3. report estimate, measured and their ratio per stage (a ratio near 1 means
   the plan's bottleneck and throughput bound can be trusted on this host).

Each stage is timed alone, as the device it models sees it (see
bench/estimate_vs_measured.py, the zoo-wide version, for why).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends.spec import DeviceSpec

from .compile import HOST_PARTITION, PartitionedModel

__all__ = ["StageMeasure", "MeasureReport", "measure_plan", "print_measure", "host_as_card"]


@dataclass(frozen=True)
class StageMeasure:
    stage: str
    """Partition name: "sparse" (host), "dense" or a pipeline stage "dense.k"."""
    device: str
    estimate_s: float
    measured_s: float
    best_s: float

    @property
    def ratio(self) -> float:
        return self.measured_s / self.estimate_s if self.estimate_s > 0 else float("inf")


@dataclass(frozen=True)
class MeasureReport:
    model: str
    batch_rows: int
    spec: str
    """The calibrated spec's description."""
    stages: list[StageMeasure]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "batch_rows": self.batch_rows, "spec": self.spec,
                "stages": [{**dataclasses.asdict(s), "ratio": s.ratio} for s in self.stages]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def host_as_card(host: DeviceSpec) -> DeviceSpec:
    """The calibrated host spec standing in for a card: ONNX Runtime on this CPU, no link."""
    return dataclasses.replace(host, name=f"{host.name}-as-card", kind="card", link_bandwidth=0,
                               link_latency_s=0.0)


def _time(run: Callable[[dict], Any], inputs: list[dict], runs: int) -> list[float]:
    for x in inputs:  # warm-up
        run(x)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for x in inputs:
            run(x)
        times.append((time.perf_counter() - t0) / len(inputs))
    return times


def measure_plan(partitioned: PartitionedModel, replan: Callable[[DeviceSpec, DeviceSpec], PartitionedModel], *,
                 spec: DeviceSpec | None = None, calibrate_seconds: float = 3.0, runs: int = 5, batches: int = 5,
                 seed: int = 7) -> MeasureReport:
    """Estimate vs measured per stage of ``partitioned`` on this host (module docstring).

    ``replan(host_spec, card_spec)``: the same model planned for other specs
    (the estimate; it need not compile). ``spec``: this host's spec (default:
    calibrate it now, ``calibrate_seconds``).
    """
    from backends import registry

    from .accuracy import _HOST_BACKENDS, plan_requests

    if min(runs, batches) < 1:
        raise ValueError(f"runs and batches must be >= 1, got {runs} and {batches}")
    if spec is None:
        from backends.calibrate import calibrate_host
        spec = calibrate_host(calibrate_seconds, threads=1, name="host-calibrated-1t")
    estimated = replan(spec, host_as_card(spec)).plan
    est = {}
    for d in estimated.estimates.per_device:
        for name in d.partitions:
            est.setdefault(name, (d.device, d.batch_seconds / max(1, len(d.partitions))))
    plan = partitioned.plan
    rows = estimated.estimates.batch_rows
    make = plan_requests(plan, seed).make
    requests = [make(rows) for _ in range(batches)]
    host_art = partitioned.artifacts[HOST_PARTITION]  # NOTE: as server.loader picks its backend (no shards)
    host = registry.get_backend(_HOST_BACKENDS[host_art.format]).load(host_art, spec)
    ort = registry.get_backend("onnxruntime", intra_op_threads=1, inter_op_threads=1)
    dense = {name: ort.load(partitioned.artifact_for(name, ort), spec) for name in plan.dense_stages()}
    try:
        measured = {HOST_PARTITION: _time(host.run, requests, runs)}
        feeds = [{**r, **host.run(r)} for r in requests]
        for name, exe in dense.items():  # each stage alone, on what the stage before it produced
            measured[name] = _time(exe.run, feeds, runs)
            feeds = [{**f, **exe.run(f)} for f in feeds]
    finally:
        host.close()
        for exe in dense.values():
            exe.close()
    stages = [StageMeasure(stage=name, device=est[name][0], estimate_s=est[name][1],
                           measured_s=statistics.median(times), best_s=min(times))
              for name, times in measured.items() if name in est]
    return MeasureReport(model=plan.model, batch_rows=rows, spec=spec.description, stages=stages)


def print_measure(report: MeasureReport, console: Any) -> None:
    from rich.table import Table

    table = Table(title=f"{report.model}: plan estimate vs measured on this host "
                        f"(batches of {report.batch_rows} items; host and card = this CPU, 1 thread)")
    for column in ("stage", "device", "estimate ms", "measured ms", "best ms", "measured / estimate"):
        table.add_column(column, justify="left" if column in ("stage", "device") else "right")
    for s in report.stages:
        table.add_row(s.stage, s.device, f"{s.estimate_s * 1e3:.3f}", f"{s.measured_s * 1e3:.3f}",
                      f"{s.best_s * 1e3:.3f}", f"{s.ratio:.2f}")
    console.print(table)
    for s in report.stages:
        if not 0.67 <= s.ratio <= 1.5:  # NOTE: past 1.5x either way the plan's bound and bottleneck mislead
            side = "slower" if s.ratio > 1 else "faster"
            console.print(f"[yellow]{s.stage} runs {s.ratio:.1f}x {side} here than the plan estimates: its "
                          "throughput bound and bottleneck are off by as much on this host[/]")
    console.print(f"calibrated spec: {report.spec}")
