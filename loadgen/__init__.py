"""sixfold load generator: open-loop KServe v2 traffic for recommendation models, over gRPC or
REST (``LoadConfig(protocol="http")``), plaintext or TLS (``ssl=True``, ``root_certificates=PEM``).

Requests go out on a schedule drawn from an arrival process (Poisson by
default) whatever the server does, and latency is measured from each request's
scheduled time, so a stalled server shows its stall (no coordinated omission).

    from sixfold.loadgen import LoadConfig, run_load
    report = run_load(LoadConfig(url="127.0.0.1:8001", model="rm2", qps=100, duration_s=30))
    report.write_json("run.json"); print(report.latency_ms["p99"])

Also closed loop (``LoadConfig(concurrency=N)``), ``find_max_qps`` (highest QPS
under a p99 target), record/replay (``record_path``/``replay_path``),
perf_analyzer input-data export, and MLPerf LoadGen's Server and Offline
scenarios (``run_mlperf``).
"""

from __future__ import annotations

from sixfold.loadgen.arrivals import (ArrivalProcess, BurstyArrivals, ConstantArrivals, DiurnalArrivals, PoissonArrivals,
                       TraceArrivals, parse_arrival)
from sixfold.loadgen.clock import Clock, MonotonicClock
from sixfold.loadgen.config import LoadConfig
from sixfold.loadgen.driver import ClosedLoopDriver, OpenLoopDriver
from sixfold.loadgen.export import export_perf_analyzer_async, write_perf_analyzer_json
from sixfold.loadgen.errors import LoadgenError
from sixfold.loadgen.mlperf import MLPerfResult, MLPerfSettings, parse_summary, run_mlperf
from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.recording import Recording, load_recording, save_recording
from sixfold.loadgen.report import Report, print_report
from sixfold.loadgen.runner import Target, drive, plan_run, run_load, run_load_async, summarize
from sixfold.loadgen.schedule import QueryPool, Schedule, build_schedule, shift_ids
from sixfold.loadgen.sweep import SweepConfig, find_max_qps, find_max_qps_async
from sixfold.loadgen.target import ModelShape, ShapeOverrides, discover_shape, shape_from, wait_until_ready
from sixfold.loadgen.transport import RawGrpcTransport, RequestFailed, TritonClientTransport, Transport

__all__ = [
    "LoadConfig", "run_load", "run_load_async", "Report", "print_report", "LoadgenError",
    "ArrivalProcess", "PoissonArrivals", "ConstantArrivals", "BurstyArrivals", "DiurnalArrivals",
    "TraceArrivals", "parse_arrival",
    "Clock", "MonotonicClock", "OpenLoopDriver", "ClosedLoopDriver", "RunRecord", "summarize", "plan_run",
    "Target", "drive", "Schedule", "QueryPool", "build_schedule", "shift_ids",
    "SweepConfig", "find_max_qps", "find_max_qps_async",
    "Recording", "save_recording", "load_recording", "write_perf_analyzer_json", "export_perf_analyzer_async",
    "ModelShape", "ShapeOverrides", "discover_shape", "shape_from", "wait_until_ready",
    "Transport", "RawGrpcTransport", "TritonClientTransport", "RequestFailed",
    "MLPerfSettings", "MLPerfResult", "run_mlperf", "parse_summary",
]
