"""sixfold load generator: open-loop KServe v2 traffic for recommendation models.

Requests go out on a schedule drawn from an arrival process (Poisson by
default) whatever the server does, and latency is measured from each request's
scheduled time, so a stalled server shows its stall (no coordinated omission).

    from loadgen import LoadConfig, run_load
    report = run_load(LoadConfig(url="127.0.0.1:8001", model="rm2", qps=100, duration_s=30))
    report.write_json("run.json"); print(report.latency_ms["p99"])
"""

from __future__ import annotations

from .arrivals import ArrivalProcess, ConstantArrivals, PoissonArrivals, parse_arrival
from .clock import Clock, MonotonicClock
from .config import LoadConfig
from .driver import OpenLoopDriver
from .errors import LoadgenError
from .record import RunRecord
from .report import Report, print_report
from .runner import plan_run, run_load, run_load_async, summarize
from .schedule import QueryPool, Schedule, build_schedule
from .target import ModelShape, ShapeOverrides, discover_shape, shape_from, wait_until_ready
from .transport import RawGrpcTransport, RequestFailed, TritonClientTransport, Transport

__all__ = [
    "LoadConfig", "run_load", "run_load_async", "Report", "print_report", "LoadgenError",
    "ArrivalProcess", "PoissonArrivals", "ConstantArrivals", "parse_arrival",
    "Clock", "MonotonicClock", "OpenLoopDriver", "RunRecord", "summarize", "plan_run",
    "Schedule", "QueryPool", "build_schedule",
    "ModelShape", "ShapeOverrides", "discover_shape", "shape_from", "wait_until_ready",
    "Transport", "RawGrpcTransport", "TritonClientTransport", "RequestFailed",
]
