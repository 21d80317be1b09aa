"""One run's parameters as typed, checked data (the CLI builds it; the library never reads argv)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from models.requests import parse_query_sizes

from .arrivals import parse_arrival

__all__ = ["LoadConfig", "parse_int_list", "REQUEST_LIMIT"]

REQUEST_LIMIT = 10_000_000
"""Hard cap on requests in one run, so a typo in --qps cannot exhaust memory."""


def parse_int_list(spec: str, what: str) -> tuple[int, ...]:
    """``"50000"`` or ``"50000,20000,..."`` -> positive ints; the error names the flag."""
    try:
        values = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"bad {what} {spec!r}: expected an integer or a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"bad {what} {spec!r}: every value must be >= 1")
    return values


@dataclass(frozen=True)
class LoadConfig:
    """An open-loop run against one model of a KServe v2 server."""

    url: str
    """Server address as HOST:PORT (gRPC, no scheme)."""
    model: str
    qps: float
    """Target offered load: mean requests (queries) per second."""
    duration_s: float
    """Length of the measured window; warmup comes before it."""
    arrival: str = "poisson"
    """Arrival process: ``poisson`` or ``constant``."""
    query_size: str = "mlperf"
    """Items per query: ``mlperf`` (100..700, MLPerf DLRM quantiles) or ``fixed:N``."""
    model_version: str = ""
    seed: int = 0
    """Seeds arrivals, query sizes and request contents: the same seed gives the same run."""
    max_requests: int | None = None
    """Upper bound on requests sent (warmup included); the schedule is cut there."""
    warmup_s: float = 0.0
    """Seconds of traffic at the same rate before the measured window, left out of the stats."""
    wait_ready_s: float = 30.0
    """How long to wait for ServerReady and ModelReady before giving up."""
    drain_timeout_s: float = 10.0
    """After the last send, how long in-flight requests may still answer; later ones are errors "timeout"."""
    pool: int = 32
    """Distinct pre-generated queries (at least one per distinct query size) the run cycles through."""
    table_rows: tuple[int, ...] | None = None
    """Rows per embedding table (one value for all, or one per table); overrides the server's."""
    pooling: tuple[int, ...] | None = None
    """Mean ids per (item, table) (one value for all, or one per table); overrides the server's."""
    dense_dim: int | None = None
    """Dense features per item; overrides the model metadata."""
    zipf: float | None = None
    """Power-law exponent of id popularity; overrides the server's (default 1.05)."""
    client: Literal["raw", "tritonclient"] = "raw"
    """``raw``: requests serialized once before the clock starts, sent on a gRPC channel;
    ``tritonclient``: every request goes through ``InferenceServerClient.infer``."""
    lag_threshold_ms: float = 5.0
    """A send later than this after its scheduled time counts as the generator falling behind."""

    def __post_init__(self) -> None:
        if not self.url or "://" in self.url or ":" not in self.url:
            raise ValueError(f"bad url {self.url!r}: expected HOST:PORT (gRPC, no scheme), e.g. 127.0.0.1:8001")
        if not self.model:
            raise ValueError("a model name is required")
        for name in ("qps", "duration_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("warmup_s", "wait_ready_s", "drain_timeout_s", "lag_threshold_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.pool < 1:
            raise ValueError(f"pool must be >= 1, got {self.pool}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.dense_dim is not None and self.dense_dim < 1:
            raise ValueError(f"dense_dim must be >= 1, got {self.dense_dim}")
        if self.client not in ("raw", "tritonclient"):
            raise ValueError(f"bad client {self.client!r}: expected 'raw' or 'tritonclient'")
        parse_arrival(self.arrival)
        parse_query_sizes(self.query_size)
        expected = self.qps * (self.warmup_s + self.duration_s)
        bound = min(expected, self.max_requests or expected)
        if bound > REQUEST_LIMIT:
            raise ValueError(f"{self.qps:g} qps for {self.warmup_s + self.duration_s:g} s is ~{expected:,.0f} "
                             f"requests, over the limit of {REQUEST_LIMIT:,}; lower --qps/--duration "
                             f"or set --max-requests")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready parameters, recorded in the report."""
        data = asdict(self)
        for key in ("table_rows", "pooling"):
            if data[key] is not None:
                data[key] = list(data[key])
        return data
