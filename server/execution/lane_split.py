"""Whether splitting a batch across host cores shortens it: measured at load, never assumed.

On the cpu layout (``sixfold.backends.cpu_layout``) every dense lane is a core of the same host.
Halving a batch over two cores costs a cut, a second thread's wake-up and a concatenation, and
two single-thread sessions share the caches and the memory bus; whether the halves finish before
the whole depends on the model and the machine. So the runtime times one lane on the whole batch
against two lanes on its halves (cut and rejoin included), at a few sizes, and splits only batches
of the sizes where the halves won (DeepRecSys's query splitting, decided by measurement).
"""

from __future__ import annotations

import concurrent.futures
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from sixfold.backends.api import Arrays, Executable

from sixfold.server.execution.card_split import CardSplit

__all__ = ["SplitDecision", "SPLIT_PROBE_ROWS", "measure_split", "decide"]

SPLIT_PROBE_ROWS: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
"""Batch sizes timed whole and halved: the batcher's range, a small batch to an MLPerf query."""


@dataclass(frozen=True)
class SplitDecision:
    """The measured whole / halved times per batch size, and the smallest half that pays."""

    min_split_rows: int
    """Split batches of at least twice this many items (0: never split, the halves never won)."""
    whole_s: dict[int, float] = field(default_factory=dict)
    halves_s: dict[int, float] = field(default_factory=dict)
    why: str = ""

    def describe(self) -> str:
        """One line for the start-up plan: the rule and the times it rests on."""
        times = ", ".join(f"{r}: {self.whole_s[r] * 1e3:.2f} / {self.halves_s[r] * 1e3:.2f} ms"
                          for r in sorted(self.whole_s))
        rule = (f"split batches of >= {2 * self.min_split_rows} items across cores" if self.min_split_rows
                else "never split a batch across cores")
        return f"{rule} ({self.why or 'measured whole / halved'}: {times})" if times else f"{rule} ({self.why})"


def decide(whole_s: Mapping[int, float], halves_s: Mapping[int, float], *, margin: float = 0.95) -> int:
    """The smallest half (items) from which the halves beat the whole at every larger measured size; 0: never.

    ``margin``: the halves must take under this share of the whole (noise on a busy host is not a win).
    """
    sizes = sorted(set(whole_s) & set(halves_s))
    smallest = 0
    for rows in reversed(sizes):
        if halves_s[rows] < margin * whole_s[rows]:
            smallest = rows
        else:
            break
    return smallest // 2


def _median(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_split(lanes: Sequence[Executable], card_inputs: Mapping[str, np.ndarray], rows: int, *,
                  sizes: Sequence[int] = SPLIT_PROBE_ROWS, runs: int = 7, budget_s: float = 3.0) -> SplitDecision:
    """Time lane 0 on whole batches and lanes 0 and 1 on their halves (cut and rejoin included).

    ``card_inputs``: a batch of ``rows`` items of the dense partition's inputs; sizes above it are
    skipped. Whole and halved runs alternate, so load from elsewhere slows both alike; the whole
    measurement stops at ``budget_s``, deciding on the sizes done by then.
    """
    if len(lanes) < 2:
        return SplitDecision(0, why="one lane: nothing to split over")
    split = CardSplit(lanes[0].artifact)
    if not split.splittable:
        return SplitDecision(0, why=split.why_not)
    names = lanes[0].input_names
    batch: Arrays = {n: card_inputs[n] for n in names}
    whole_s: dict[int, float] = {}
    halves_s: dict[int, float] = {}
    deadline = time.perf_counter() + budget_s
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="split-probe") as other:
        for size in (s for s in sizes if 2 <= s <= rows):
            inputs = split.head(batch, rows, size)
            half = size // 2

            def whole(inputs: Arrays = inputs) -> object:
                return lanes[0].run(inputs)

            def halves(inputs: Arrays = inputs, size: int = size, half: int = half) -> object:
                first, second = split.pieces(inputs, size, [(0, half), (half, size)])
                pending = other.submit(lanes[1].run, second)
                mine = lanes[0].run(first)
                theirs = pending.result()
                return {n: np.concatenate([mine[n], theirs[n]]) for n in mine}

            whole(), halves()  # warm: the session's plan for these shapes
            w, h = [], []
            for _ in range(runs):
                w.append(_median(whole, 1))
                h.append(_median(halves, 1))
            whole_s[size], halves_s[size] = statistics.median(w), statistics.median(h)
            if time.perf_counter() > deadline:
                break
    return SplitDecision(decide(whole_s, halves_s), whole_s, halves_s)
