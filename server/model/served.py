"""A served model: its plan, signature, tables, runtime, batcher and statistics."""

from __future__ import annotations

import asyncio
import time
import weakref
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from sixfold.models.signature import INDICES
from sixfold.partitioner.plan import PartitionPlan

from sixfold.server.scheduling.batcher import BatchInfo, DynamicBatcher
from sixfold.server.errors import InvalidInput, clip_names
from sixfold.server.observability.metrics import ModelMetrics, ServerMetrics
from sixfold.server.execution.runtime import PlanRuntime
from sixfold.server.observability.stats import ModelStats
from sixfold.server.model.validation import InputSpec, validate_request

__all__ = ["ServedModel"]


@dataclass
class ServedModel:
    name: str
    version: str
    plan: PartitionPlan
    runtime: PlanRuntime
    batcher: DynamicBatcher
    metrics: ServerMetrics
    stats: ModelStats = field(default_factory=ModelStats)
    parameters: dict[str, str] = field(default_factory=dict)
    """Extra facts published in ModelConfig.parameters (table rows, pooling) for load generators."""
    allow_nonfinite: bool = False
    """Score dense features that are NaN or infinite (default: refuse them with INVALID_ARGUMENT)."""
    id_check: Any = None
    deltas: Any = None
    """A ``sixfold.server.deltas.delta_log.DeltaLog`` when table deltas can reach this model (a repository version with tables/)."""
    """For lookups not matched to tables (no per-table rows): ``check(inputs) -> None | why`` runs the
    host graph's index arithmetic on the request and checks each lookup's rows (``sixfold.partitioner.tables.id_check``)."""
    warmed_up: bool = False
    """Whether synthetic batches have run through it (``sixfold.server.model.warmup``)."""
    warmup_failed: str = ""
    """Why a warm-up batch failed through the model's own fault (empty: it passed, or none ran): such a
    version is never ready, since real requests of that size would fail the same way."""

    def __post_init__(self) -> None:
        # Read at scrape time from the metrics thread: the queue's length, whichever batcher is set by then.
        # NOTE: through a weak reference: the metrics outlive an unloaded version, which must not keep its
        # tables and cards alive (it did: a lambda over self held every unloaded model).
        model = weakref.ref(self)

        def pending() -> int:
            served = model()
            return served.batcher.queued if served is not None and served.batcher is not None else 0

        def ready() -> bool:  # an unloaded version (collected) answers nothing
            served = model()
            return served is not None and served.ready

        self._metrics.pending = pending
        self._metrics.ready = ready
        if self.runtime is not None:  # its cards' busy time, memory and health, while it lives
            self.metrics.watch_cards(self.name, self.version, self.runtime)

    @property
    def ready(self) -> bool:
        """Whether this version can answer now: its warm-up passed and a complete path is healthy
        (a card in rotation, or the host's dense fallback). KServe's model and server readiness follow it."""
        return not self.warmup_failed and (self.runtime is None or self.runtime.can_answer)

    def not_ready_because(self) -> str:
        """Why the version is not ready, in words (empty when it is)."""
        if self.warmup_failed:
            return self.warmup_failed
        if self.runtime is not None and self.runtime.closed:
            return "unloaded (its runtime is closed)"
        if self.runtime is not None and not self.runtime.can_answer:
            return f"no path can answer a batch ({self.runtime.paths()})"
        return ""

    # NOTE: cached: the plan does not change once served, and these are read on every request.
    @cached_property
    def input_specs(self) -> list[InputSpec]:
        # The table-batched host stage (format "tables") reads INT32 ids as well: half the bytes on the wire.
        narrow_ids = getattr(getattr(self.runtime.host, "artifact", None), "format", None) == "tables"
        return [InputSpec(t.name, t.datatype, t.shape,
                          also=("INT32",) if narrow_ids and t.name == INDICES and t.datatype == "INT64" else ())
                for t in self.plan.inputs]

    @cached_property
    def output_names(self) -> list[str]:
        return [t.name for t in self.plan.outputs]

    @cached_property
    def table_rows(self) -> list[int] | None:
        return self.plan.tables.get("rows")

    @cached_property
    def _metrics(self) -> ModelMetrics:
        return self.metrics.for_model(self.name, self.version)

    async def run_batch(self, inputs: dict[str, np.ndarray], info: BatchInfo) -> dict[str, np.ndarray]:
        """What the batcher calls: one batch through the plan, with per-stage metrics."""
        outputs = await self.runtime.run(inputs, info)
        self.stats.record_batch()
        timings = info.timings
        card = int(timings.get("card", 0))
        self._metrics.record_batch(info.rows, timings.get("host_s", 0.0), timings.get("card_s", 0.0),
                                   self.runtime.host_dense_max_rows, card < 0)
        if card < 0:  # the dense part ran on the host (small batch): no card to report
            return outputs
        m = self._metrics
        executable = self.runtime.cards[card]
        m.card(card).set(self.runtime.router.loads[card].outstanding_rows)
        stats = getattr(executable, "stats", None)
        if callable(stats):  # a simulated card says when the host could not keep up with its model
            m.card_lag(card).set(stats().total_lag_s)
        return outputs

    async def infer(self, inputs: dict[str, np.ndarray], requested: list[str],
                    timeout_s: float | None = None, priority: int = 0) -> dict[str, np.ndarray]:
        """Validate, queue for batching, and return the requested outputs of this request.

        ``timeout_s``: the client's deadline (gRPC deadline or ``timeout`` parameter); a request
        still queued when it passes is dropped before compute with DEADLINE_EXCEEDED.
        ``priority``: the request's priority level (1 = highest; 0 = the model's default level).
        """
        t0 = time.perf_counter()
        try:
            rows = validate_request(inputs, self.input_specs, self.table_rows, self.allow_nonfinite)
            if self.id_check is not None and rows:
                why = self.id_check(inputs)
                if why is not None:
                    raise InvalidInput(why)
            unknown = sorted(set(requested) - set(self.output_names)) if requested else ()
            if unknown:
                raise InvalidInput(f"unknown output(s) {clip_names(unknown)}; the model has {self.output_names}")
            if rows == 0:
                outputs = {t.name: np.zeros((0, *t.shape[1:]), dtype=np.float32) for t in self.plan.outputs}
                info = BatchInfo()
            else:  # NOTE: the batcher's submit, with the future awaited here: one coroutine frame fewer
                queued = self.batcher.enqueue(inputs, rows, timeout_s, priority)
                try:
                    outputs = await queued.future
                except BaseException:  # timed out, its batch failed, or the client went away
                    self.batcher.abandon(queued)
                    raise
                info = queued.info
        except asyncio.CancelledError:  # the client gave up (its deadline passed, or it went away)
            self.stats.record_failure(time.perf_counter() - t0)
            self._metrics.record_failure("cancelled")
            raise
        except Exception as exc:
            self.stats.record_failure(time.perf_counter() - t0)
            self._metrics.record_failure(getattr(exc, "reason", "internal"))
            raise
        total = time.perf_counter() - t0
        host = info.timings.get("host_s", 0.0)
        card = info.timings.get("card_s", 0.0)
        self.stats.record_success(total, info.queue_s, host, card, max(0.0, total - info.queue_s - host - card), rows)
        self._metrics.record_success(rows, total, info.queue_s, host, card)
        return {n: outputs[n] for n in requested} if requested else outputs

    def config_parameters(self) -> dict[str, Any]:
        return dict(self.parameters)
