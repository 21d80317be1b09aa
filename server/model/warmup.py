"""Run a few synthetic batches through a model before it takes traffic (Triton's ``model_warmup``).

A fresh model pays one-time costs on its first batches of each size: the C heap grows to the
batch's buffers (page faults), ONNX Runtime plans memory for a shape it has not seen, torch
starts its thread pool, and the host-stage and host-dense tuners have nothing measured yet.
Measured on rm2 (6 simcards, a quiet machine): the first 700-item batch after READY took
136 ms in the host stage and 116 ms on the cards, against 19 and 4 ms once warm; over the first
6 s of 16 q/s of MLPerf-sized queries right after READY, client p99 was 79 and 144 ms cold against
63 and 63 ms warmed (``bench/latency_breakdown.py --model rm2 --qps 16 --duration 6 --warmup 0``,
``-- --no-warmup`` for cold). A replica that a load balancer adds to a fleet takes traffic right
after its readiness probe passes, so those first requests land in the fleet's p99.

``warm_up`` runs batches of a few sizes (one row up to the largest batch the batcher makes)
straight through the model's runtime, before the model is served: not through the batcher, so
the model's statistics and metrics count no request. Inputs are made from the model's signature:
zero dense features, the plan's pooling per table (``sixfold.pooling``; one id per bag when the
plan has none) and id 0 everywhere, which every table has. A model whose inputs are not the
canonical three is warmed with zeros of each declared shape (dynamic dims = the batch size).
A tiered host stage's row-cache counters are reset afterwards (its hits and misses are traffic's).

Warm-up is also the model's first check (issue 31.5: a model that failed at 1 item logged "serving
it unwarmed", reported READY, and every lone 1-item request failed INTERNAL). A batch that fails
through the model's own fault (its host stage, or its dense part on the cards and on the host
fallback alike) leaves the version never ready (``ServedModel.warmup_failed``), with an ERROR line
naming the size and the reason; a repository load refuses it (``ModelControl.load``). A batch that
failed on the cards alone (every card erred or hung, no host fallback to try) is the cards' health,
not the model's: the version is ready again when a card is back in rotation (``ServedModel.ready``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from sixfold.models import DENSE, INDICES, LENGTHS

from sixfold.server.execution.card_health import CardError, CardHang, NoHealthyCardLeft
from sixfold.server.scheduling.batcher import BatchInfo
from sixfold.server.model.served import ServedModel
from sixfold.server.model.validation import InputSpec

__all__ = ["WarmupReport", "warm_up", "warmup_rows", "synthetic_batch", "cards_alone"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupReport:
    model: str
    rows: tuple[int, ...]
    """Batch sizes run, in order."""
    seconds: float
    failed: str = ""
    """Why a synthetic batch was refused (empty: every size ran)."""
    model_fault: bool = False
    """Whether that failure was the model's own (not the cards' alone): the version is never ready."""


def warmup_rows(max_batch_rows: int) -> tuple[int, ...]:
    """1, 16, 64, 256 and the largest batch (each at most ``max_batch_rows``): the sizes a batcher makes."""
    return tuple(sorted({min(r, max_batch_rows) for r in (1, 16, 64, 256, max_batch_rows) if r >= 1}))


def synthetic_batch(model: ServedModel, rows: int) -> dict[str, np.ndarray]:
    """Inputs of ``rows`` items that every model of this signature accepts (zeros, id 0, the plan's pooling)."""
    specs = {s.name: s for s in model.input_specs}
    inputs = {name: _zeros(spec, rows) for name, spec in specs.items()}
    if {DENSE, LENGTHS, INDICES} <= set(specs):  # the canonical request: the plan's pooling, id 0
        tables = specs[LENGTHS].shape[-1] if specs[LENGTHS].shape[-1] > 0 else len(model.table_rows or [1])
        pooling = (model.plan.tables or {}).get("pooling") or [1] * tables
        per_bag = np.maximum(1, np.rint(np.asarray(pooling, dtype=np.float64))).astype(np.int32)
        inputs[LENGTHS] = np.broadcast_to(per_bag[:tables], (rows, tables)).copy()
        inputs[INDICES] = np.zeros(int(inputs[LENGTHS].sum()), np.int64)
    return inputs


def _zeros(spec: InputSpec, rows: int) -> np.ndarray:
    """Zeros of the spec's shape: the first dynamic dim is the batch, any other one is 1."""
    shape = [rows if d < 0 else d for d in spec.shape[:1]] + [1 if d < 0 else d for d in spec.shape[1:]]
    return np.zeros(tuple(shape), spec.dtype)


def cards_alone(exc: BaseException) -> bool:
    """Whether a batch failed on the cards alone (each tried card erred or hung, and no host fallback ran)."""
    return isinstance(exc, (CardError, CardHang, NoHealthyCardLeft))


def _forget_lookups(model: ServedModel) -> None:
    """The synthetic batches are not traffic: a tiered host stage's row-cache counters start at zero."""
    stage = getattr(model.runtime.host, "stage", None)
    for store in stage.stores if stage is not None and hasattr(stage, "stores") else ():
        store.reset_stats()


async def warm_up(model: ServedModel, rows: tuple[int, ...] | None = None) -> WarmupReport:
    """Run one synthetic batch of each size in ``rows`` (default: ``warmup_rows`` of the model's batcher)."""
    sizes = rows if rows is not None else warmup_rows(model.batcher.config.max_batch_rows)
    t0 = time.perf_counter()
    done: list[int] = []
    failed = ""
    model_fault = False
    for n in sizes:
        try:
            await model.runtime.run(synthetic_batch(model, n), BatchInfo(rows=n, requests=1))
        except Exception as exc:  # noqa: BLE001 - said in the log and in the model's readiness
            failed = f"{type(exc).__name__}: {exc}"
            model_fault = not cards_alone(exc)
            if model_fault:
                model.warmup_failed = f"warm-up batch of {n} items failed ({failed})"
                log.error("model %s version %s is not ready: its warm-up batch of %d items failed (%s); requests "
                          "of %d items would fail the same way", model.name, model.version, n, failed, n)
            else:
                log.warning("model %s version %s: warm-up batch of %d items failed on the cards (%s); the version "
                            "is ready while a card or the host fallback can answer", model.name, model.version, n,
                            failed)
            break
        done.append(n)
    model.warmed_up = True
    _forget_lookups(model)
    report = WarmupReport(model.name, tuple(done), time.perf_counter() - t0, failed, model_fault)
    if not failed:
        log.info("model %s version %s warmed up in %.2f s (batches of %s rows)", model.name, model.version,
                 report.seconds, ", ".join(map(str, done)))
    return report
