"""What one request costs to serve, in seconds, for admission by work (``sixfold.server.scheduling.batcher``).

The batcher bounds its queue by the time it would take to drain it, not only by
its length: a 1000-item query is worth hundreds of 1-item ones. It needs each
request's cost when the request arrives, cheaply (the serving path spends ~60 us
of Python per request; this adds a call and three multiplications, no numpy
reduction). The shape of the cost comes from the plan's cost model: a fixed
per-request part, the host stage's time per looked-up id, and the card stage's
time per item shared over the cards that run it in parallel. Its scale need not be
right: the batcher rescales every estimate by the service rate it measures
(``DynamicBatcher``: Little's law on finished batches), so an uncalibrated host
spec, or a throttled card, changes the scale and not the decision.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from sixfold.partitioner.plan import PartitionPlan

__all__ = ["PlanCost", "RequestCost", "PER_REQUEST_S"]

RequestCost = Callable[[Mapping[str, np.ndarray], int], float]
"""``cost(inputs, rows) -> seconds``: a request's estimated share of the server's time."""

PER_REQUEST_S = 60e-6
"""Fixed serving cost of one request (decode, validate, queue, encode): BENCHMARKS.md,
"serving overhead", measures 64-82 us of event-loop CPU per request."""


@dataclass(frozen=True)
class PlanCost:
    """``seconds(rows, ids) = per_request_s + per_row_s * rows + per_id_s * ids``; callable as a RequestCost.

    ``ids`` is the length of ``ids_input`` (``sparse_indices``: every id of the query);
    a model without it is priced by rows alone.
    """

    per_request_s: float = PER_REQUEST_S
    per_row_s: float = 0.0
    per_id_s: float = 0.0
    ids_input: str = "sparse_indices"

    def seconds(self, rows: int, ids: int) -> float:
        return self.per_request_s + self.per_row_s * rows + self.per_id_s * ids

    def __call__(self, inputs: Mapping[str, np.ndarray], rows: int) -> float:
        ids = inputs.get(self.ids_input)
        return self.per_request_s + self.per_row_s * rows + (self.per_id_s * ids.shape[0] if ids is not None else 0.0)

    @classmethod
    def from_plan(cls, plan: PartitionPlan, *, per_request_s: float = PER_REQUEST_S) -> "PlanCost":
        """Per-id host time and per-item card time from the plan's estimate of one ``batch_rows`` batch.

        Host: its batch time over the batch's ids (items x the tables' pooling; items alone when
        the plan has no pooling). Cards: the mean card's batch time over the batch's items and the
        cards (replicas run batches side by side). Approximate for pipelines and sharded tables;
        the batcher's measured rate corrects the scale.
        """
        est = plan.estimates
        rows = max(1, est.batch_rows)
        host = sum(d.batch_seconds for d in est.per_device if d.device == "host")
        cards = [d.batch_seconds for d in est.per_device if d.device != "host"]
        per_row = sum(cards) / len(cards) / rows / len(cards) if cards else 0.0
        pooling = plan.tables.get("pooling") or []
        names = {t.name for t in plan.inputs}
        if pooling and "sparse_indices" in names:
            return cls(per_request_s, per_row, host / (rows * sum(pooling)))
        return cls(per_request_s, per_row + host / rows, 0.0)
