"""One run's parameters as typed, checked data (the CLI builds it; the library never reads argv)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Literal

from sixfold.models.requests import parse_query_sizes

from sixfold.loadgen.arrivals import parse_arrival

__all__ = ["LoadConfig", "parse_int_list", "parse_float_list", "REQUEST_LIMIT", "CLOSED_LOOP_QUERIES", "CLIENTS",
           "IDS_DTYPES", "PROTOCOLS"]

CLIENTS = ("raw", "tritonclient", "shm")
"""How requests are sent (``LoadConfig.client``, ``sixfold-loadgen --client``; ``sixfold.loadgen.transport``)."""
PROTOCOLS = ("grpc", "http")
"""KServe v2 over gRPC, or over REST (HTTP/1.1; the binary-data extension) (``sixfold-loadgen --protocol``)."""
IDS_DTYPES = ("int64", "int32")
"""How ``sparse_indices`` go on the wire: INT64 (the signature's), or INT32 (half the bytes)."""

REQUEST_LIMIT = 10_000_000
"""Hard cap on requests in one run, so a typo in --qps cannot exhaust memory."""
CLOSED_LOOP_QUERIES = 200_000
"""A closed-loop run draws this many query assignments (fewer with max_requests) and cycles them."""


def parse_int_list(spec: str, what: str) -> tuple[int, ...]:
    """``"50000"`` or ``"50000,20000,..."`` -> positive ints; the error names the flag."""
    try:
        values = tuple(int(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"bad {what} {spec!r}: expected an integer or a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise ValueError(f"bad {what} {spec!r}: every value must be >= 1")
    return values


def parse_float_list(spec: str, what: str) -> tuple[float, ...]:
    """``"1.05"`` or ``"1.05,0.9,..."`` -> positive floats; the error names the flag."""
    try:
        values = tuple(float(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"bad {what} {spec!r}: expected a number or a comma-separated list of numbers") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"bad {what} {spec!r}: every value must be a finite number > 0")
    return values


@dataclass(frozen=True)
class LoadConfig:
    """An open-loop run against one model of a KServe v2 server."""

    url: str
    """Server address as HOST:PORT (no scheme: ``protocol`` and ``ssl`` say how to speak to it)."""
    model: str
    qps: float
    """Target offered load: mean requests (queries) per second. 0 means "not set", allowed only in
    closed loop (``concurrency``), for ``trace:`` arrivals (the trace's own rate) and for ``replay``."""
    duration_s: float
    """Length of the measured window; warmup comes before it."""
    arrival: str = "poisson"
    """Arrival process: ``poisson``, ``constant``, ``bursty:...``, ``diurnal:...``, ``trace:PATH`` (see arrivals)."""
    query_size: str = "mlperf"
    """Items per query: ``mlperf`` (100..700, MLPerf DLRM quantiles), ``fixed:N``, ``uniform:A-B``,
    ``lognormal:MEAN,SIGMA`` or ``file:PATH``."""
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
    zipf: float | tuple[float, ...] | None = None
    """Power-law exponent of id popularity (one, or one per table); overrides the server's (default 1.05)."""
    id_drift: float = 0.0
    """Popular ids rotate by this fraction of each table per second of schedule time (0: fixed hot set)."""
    concurrency: int | None = None
    """Closed loop: keep exactly this many requests outstanding (``qps`` and ``arrival`` are then unused)."""
    record_path: str | None = None
    """Write what was sent, when, and what came back to this ``.npz`` (see sixfold.loadgen.recording)."""
    replay_path: str | None = None
    """Send the schedule and tensors of a recorded run instead of drawing new ones."""
    client: Literal["raw", "tritonclient", "shm"] = "raw"
    """``raw``: requests serialized once before the clock starts, sent on a gRPC channel;
    ``tritonclient``: every request goes through ``InferenceServerClient.infer``; ``shm``: as
    ``raw``, with the tensors in shared memory segments registered with a server on this host."""
    lag_threshold_ms: float = 5.0
    """A send later than this after its scheduled time counts as the generator falling behind."""
    channels: int = 1
    """gRPC connections the ``raw`` and ``shm`` clients spread requests over, round robin: a channel
    stays on one process of a server of several (``sixfold-serve --workers``), so reach them all."""
    ids_dtype: Literal["int64", "int32"] = "int64"
    """``int32``: send ``sparse_indices`` as INT32, half the bytes of INT64, to a server that takes
    them (sixfold does for table-batched models; another server may refuse them)."""
    protocol: Literal["grpc", "http"] = "grpc"
    """``grpc`` (KServe v2 gRPC) or ``http`` (KServe v2 REST, tensors in the binary-data extension):
    readiness, discovery and every request go over it."""
    ssl: bool = False
    """TLS: gRPC over TLS, or HTTPS."""
    root_certificates: str | None = None
    """PEM file of the certificates to trust the server's by (with ``ssl``); None: the system's."""
    batch_dim: bool = False
    """Send every input with a leading batch dimension of 1 (``[1, items, 13]``, ``[1, ids]``) and take
    scores as ``[1, items, 1]``: the signature of a Triton model with ``max_batch_size > 0`` whose inputs
    allow ragged batches, the only way Triton's dynamic batcher batches recommendation requests (whole
    requests; their item counts and id counts differ)."""
    deadline_s: float | None = None
    """Send every request with this gRPC deadline (None: none), as clients that hold an SLA of their own do:
    a server may refuse at once what it cannot answer in time (sixfold does, docs/admission.md); one that
    runs out counts as the error ``deadline_exceeded``."""

    def __post_init__(self) -> None:
        if not self.url or "://" in self.url or ":" not in self.url:
            raise ValueError(f"bad url {self.url!r}: expected HOST:PORT (no scheme; --protocol http for REST, "
                             "--ssl for TLS), e.g. 127.0.0.1:8001")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"bad protocol {self.protocol!r}: expected one of {', '.join(PROTOCOLS)}")
        if self.root_certificates is not None:
            if not self.ssl:
                raise ValueError("root_certificates (--root-certificates) needs ssl (--ssl)")
            if not os.path.isfile(self.root_certificates):
                raise ValueError(f"--root-certificates {self.root_certificates!r}: no such file")
        if self.protocol == "http" and self.client == "shm":
            raise ValueError("the shm client needs protocol grpc (sixfold's REST serves no shared memory)")
        if self.protocol == "http" and self.channels > 1:
            raise ValueError("channels > 1 is for gRPC; over HTTP connections open as requests need them")
        if not self.model:
            raise ValueError("a model name is required")
        if not (math.isfinite(self.duration_s) and self.duration_s > 0):
            raise ValueError(f"duration_s must be a finite number > 0, got {self.duration_s}")
        rate_free = self.concurrency is not None or self.replay_path is not None \
            or self.arrival.strip().lower().startswith("trace:")
        if not (math.isfinite(self.qps) and (self.qps > 0 or (rate_free and self.qps == 0))):
            raise ValueError(f"qps must be a finite number > 0, got {self.qps}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not (math.isfinite(self.id_drift) and 0 <= self.id_drift <= 1):
            raise ValueError(f"id_drift must be in [0, 1] (a fraction of each table per second), got {self.id_drift}")
        for name in ("warmup_s", "wait_ready_s", "drain_timeout_s", "lag_threshold_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.deadline_s is not None:
            if not (math.isfinite(self.deadline_s) and self.deadline_s > 0):
                raise ValueError(f"deadline_s (--deadline-ms) must be a finite number > 0, got {self.deadline_s}")
            if self.protocol != "grpc":
                raise ValueError("a deadline per request (--deadline-ms) is sent as a gRPC deadline: use protocol grpc")
        if self.pool < 1:
            raise ValueError(f"pool must be >= 1, got {self.pool}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {self.max_requests}")
        if self.dense_dim is not None and self.dense_dim < 1:
            raise ValueError(f"dense_dim must be >= 1, got {self.dense_dim}")
        if self.client not in CLIENTS:
            raise ValueError(f"bad client {self.client!r}: expected one of {', '.join(CLIENTS)}")
        if self.ids_dtype not in IDS_DTYPES:
            raise ValueError(f"bad ids_dtype {self.ids_dtype!r}: expected one of {', '.join(IDS_DTYPES)}")
        if self.channels < 1:
            raise ValueError(f"channels must be >= 1, got {self.channels}")
        if self.channels > 1 and self.client == "tritonclient":
            raise ValueError("channels > 1 needs the raw or shm client (tritonclient's client has one channel)")
        if self.replay_path is None:
            parse_query_sizes(self.query_size)
        if self.concurrency is not None or self.replay_path is not None:
            return
        arrival = parse_arrival(self.arrival)
        rate = self.qps or getattr(arrival, "mean_qps", lambda: 0.0)()
        expected = rate * (self.warmup_s + self.duration_s)
        bound = min(expected, self.max_requests or expected)
        if bound > REQUEST_LIMIT:
            raise ValueError(f"{rate:g} qps for {self.warmup_s + self.duration_s:g} s is ~{expected:,.0f} "
                             f"requests, over the limit of {REQUEST_LIMIT:,}; lower --qps/--duration "
                             f"or set --max-requests")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready parameters, recorded in the report."""
        data = asdict(self)
        for key in ("table_rows", "pooling", "zipf"):
            if isinstance(data[key], tuple):
                data[key] = list(data[key])
        return data
