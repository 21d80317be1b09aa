"""Price cards that are emulated on this host's cores at the speed the emulation reaches here, not their spec.

An emulated card (``simcard``) answers a batch at the later of its spec's modelled time and the real time its
single-thread ONNX Runtime session takes on the host's cores, shared with the other cards computing at the
same moment. On the 2-core development VM six emulated m2-cards took 21.3 ms for the card stage of a lone
700-item dlrm-mlperf query that the m2-card spec prices at 4 ms. So a part of ``rows`` items costs

    max(spec(rows), alone(rows) x sharing(k))

where ``alone`` is one single-thread call measured on a small real ONNX graph here and scaled by the
partition's FLOPs per item, and ``sharing(k)`` is the slowdown with ``k`` cards computing at once
(``sixfold.backends.emulation_calibrate``, measured once per machine and cached). A lone query of ``R`` items
is split as the server splits it (``sixfold.server.execution.runtime``): into ``k = min(cards, R // min_split_rows)``
equal parts when ``R >= 2 x min_split_rows``, else one part on one card.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from sixfold.backends.emulation_calibrate import EmulationCalibration
from sixfold.partitioner.pricing.loaded_stages import StageTiming
from sixfold.partitioner.pricing.served_latency import ServedLatency, _interpolate

__all__ = ["EmulatedCards", "DEFAULT_MIN_SPLIT_ROWS", "emulated_lone_query"]

DEFAULT_MIN_SPLIT_ROWS = 64
"""sixfold-serve's default ``--min-split-rows`` (``sixfold.server.execution.runtime.DEFAULT_MIN_SPLIT_ROWS``)."""


@dataclass(frozen=True)
class EmulatedCards:
    """``cards`` emulated cards on this host, priced from ``calibration``, split as the server splits."""

    calibration: EmulationCalibration
    cards: int
    min_split_rows: int = DEFAULT_MIN_SPLIT_ROWS
    splittable: bool = True
    """Whether the dense partition's batches may be split across cards (``CardSplit``)."""
    timing: StageTiming | None = None
    """The served partition timed here at load (``pricing.loaded_stages``): when set, it prices the cards instead
    of the calibration graph scaled by FLOPs (which keeps only simcard's own hand-off)."""

    def __post_init__(self) -> None:
        if self.cards < 1 or self.min_split_rows < 0:
            raise ValueError(f"EmulatedCards: cards >= 1 and min_split_rows >= 0, got {self.cards}, "
                             f"{self.min_split_rows}")

    def parts(self, rows: int) -> int:
        """Cards a lone ``rows``-item batch is split over."""
        m = self.min_split_rows
        if not self.splittable or m == 0 or rows < 2 * m:
            return 1
        return max(1, min(self.cards, rows // m))

    def part_seconds(self, flops_per_item: float, rows: int, sharing: int,
                     spec_seconds: Callable[[int], float]) -> float:
        """One card's time on ``rows`` items while ``sharing`` cards (itself included) compute at once."""
        if self.timing is not None and self.timing.alone and sharing > 1 and self.parts(rows * sharing) == sharing:
            # the last of a lone query's parts: priced as that query's card stage was measured, split the same way
            return max(float(spec_seconds(rows)), self._timed(rows * sharing) + self.calibration.call_overhead_s)
        if self.timing is not None and self.timing.alone:
            emulated = (_interpolate(self.timing.alone, rows) * self.timing.sharing_factor(sharing)
                        + self.calibration.call_overhead_s)
            return max(float(spec_seconds(rows)), emulated)
        emulated = self.calibration.alone_seconds(flops_per_item, rows) * self.calibration.sharing_factor(sharing)
        return max(float(spec_seconds(rows)), emulated)

    def lone_seconds(self, flops_per_item: float, rows: int, spec_seconds: Callable[[int], float]) -> float:
        """A lone ``rows``-item batch's card stage: its parts run at once, the largest part last to finish."""
        k = self.parts(rows)
        if self.timing is not None and self.timing.alone:  # measured as the router splits it
            return max(float(spec_seconds(-(-rows // k))), self._timed(rows) + self.calibration.call_overhead_s)
        return self.part_seconds(flops_per_item, -(-rows // k), k, spec_seconds)

    def _timed(self, rows: int) -> float:
        """A lone ``rows``-item query's card stage from the load-time timing: unsplit, one part's time alone; split
        in ``k`` parts, the timed query of the same ``k`` nearest in size, scaled by its parts' time alone."""
        t = self.timing
        k = self.parts(rows)
        part = -(-rows // k)
        if k == 1:
            return _interpolate(t.alone, part)
        same = [(r, s) for r, s in t.dense if self.parts(r) == k]
        if not same:
            return _interpolate(t.alone, part) * t.sharing_factor(k)
        if len(same) >= 2:
            return _interpolate(same, rows)
        r, s = same[0]
        return s * _interpolate(t.alone, part) / max(1e-12, _interpolate(t.alone, -(-r // k)))

    def describe(self) -> str:
        """Where the prices come from, for the plan line and the simulator's output."""
        c = self.calibration
        if self.timing is not None:
            return f"{self.cards} emulated cards priced as the served partition ran here ({self.timing.source})"
        return (f"{self.cards} emulated cards priced at this host's speed ({c.effective_cores:.1f} of "
                f"{c.usable_cores} cores shared; {c.source})")


def emulated_lone_query(lone: ServedLatency, cards: EmulatedCards, flops_per_item: float) -> ServedLatency:
    """``lone`` with its dense term priced on emulated ``cards`` (its spec prices kept as the floor)."""
    if flops_per_item <= 0:
        raise ValueError(f"emulated_lone_query: the dense partition's flops_per_item must be > 0, got {flops_per_item}")

    def spec(rows: int) -> float:
        return _interpolate(lone.dense, rows)

    dense = tuple((r, cards.lone_seconds(flops_per_item, r, spec)) for r, _ in lone.dense)
    return dataclasses.replace(lone, dense=dense, dense_source=cards.describe())
