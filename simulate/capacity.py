"""Capacity questions answered by simulated runs: latency vs rate, the latency-bounded maximum, fewest cards.

* ``latency_curve``: one run per offered rate (p50/p99/p99.9, utilisation, queueing).
* ``max_rate``: the highest rate whose p99 stays within a bound, by bisection. Every step
  draws its traffic from the same seed, so steps differ only by the rate (common random
  numbers). A step passes when its p99 is within the bound, at most ``max_error_rate`` of its
  requests were refused or failed (sixfold-loadgen's rule; admission refuses load the server
  cannot serve in time, so an overloaded step fails by its errors), and no device (cards,
  host stage, event loop) was busy 99% of the window or more: a saturated queue only grows,
  and a short run would not show it.
* ``fewest_cards``: the smallest card count (binary search over 1..``max_cards``, more cards
  never hurting) whose run at the target rate passes, per card spec and precision.

Before searching, a lone query of the mix's p99 size is simulated on the idle platform:
when that alone is over the bound no rate can meet it, and ``ImpossibleTarget`` says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from sixfold.backends.emulation_calibrate import EmulationCalibration
from sixfold.partitioner.pricing.host_stage_fit import HostStageFit
from sixfold.partitioner.pricing.served_latency import ServingPath
from sixfold.simulate.engine import RunResult, ServingSettings, simulate
from sixfold.simulate.platform import Platform, build_platform
from sixfold.simulate.traffic import Arrivals, Traffic

__all__ = ["ImpossibleTarget", "Step", "MaxRate", "CardsAnswer", "lone_query_ms", "run_at", "latency_curve",
           "max_rate", "fewest_cards"]

Progress = Callable[[str], None]


class ImpossibleTarget(ValueError):
    """The bound cannot be met at any rate (a lone query of the mix is slower than it)."""


@dataclass(frozen=True)
class Step:
    rate: float
    passed: bool
    result: RunResult


@dataclass
class MaxRate:
    """The latency-bounded maximum of one platform and traffic."""

    platform: str
    p99_bound_ms: float
    max_qps: float
    """Highest passing rate found (0: none passed)."""
    best: RunResult | None
    """The run at ``max_qps``."""
    steps: list[Step] = field(default_factory=list)
    lone_ms: float = 0.0
    """Latency of a lone query of the mix's p99 size on the idle platform."""


@dataclass
class CardsAnswer:
    """The fewest cards of one spec (and precision) meeting a rate at a bound."""

    card_spec: str
    table_precision: str
    dense_precision: str
    cards: int | None
    """None: not met with ``max_cards`` cards."""
    watts: float | None
    result: RunResult | None
    tried: dict[int, RunResult] = field(default_factory=dict)
    passed: dict[int, bool] = field(default_factory=dict)
    """Whether the run with that many cards met the target."""
    reason: str = ""


def run_at(platform: Platform, traffic: Traffic, rate: float | None, *, duration_s: float, warmup_s: float,
           settings: ServingSettings, seed: int = 0, progress: Callable[[float, float], None] | None = None,
           jobs: int = 1) -> RunResult:
    """One simulated run of ``duration_s`` measured seconds after ``warmup_s`` at ``rate`` queries/s."""
    if not duration_s > 0:
        raise ValueError(f"--duration must be > 0 s, got {duration_s}")
    if not warmup_s >= 0:
        raise ValueError(f"--warmup must be >= 0 s, got {warmup_s}")
    arrivals = traffic.draw(rate, warmup_s + duration_s, platform.ids_per_item, seed)
    return simulate(platform, arrivals, settings=settings, warmup_s=warmup_s, progress=progress, jobs=jobs)


def lone_query_ms(platform: Platform, items: int, settings: ServingSettings) -> float:
    """Latency of one query of ``items`` items on the idle platform (batching window included)."""
    ids = max(1, round(items * platform.ids_per_item))
    one = Arrivals(np.zeros(1), np.asarray([items]), np.asarray([ids]), 1.0, 1e-3)
    result = simulate(platform, one, settings=settings)
    if result.latency_ms["max"] is None:
        raise ImpossibleTarget(f"a lone {items}-item query is refused on {platform.label}: "
                               f"{', '.join(result.errors) or 'no answer'}")
    return float(result.latency_ms["max"])


SATURATED = 0.99
"""A device busy this share of the window fails the step: its queue only grows, however short the run."""


def _passes(result: RunResult, bound_ms: float, max_error_rate: float) -> bool:
    p99 = result.latency_ms["p99"]
    busiest = max(result.utilisation.values(), default=0.0)
    return p99 is not None and p99 <= bound_ms and result.error_rate <= max_error_rate and busiest < SATURATED


def latency_curve(platform: Platform, traffic: Traffic, rates: Sequence[float | None], *, duration_s: float,
                  warmup_s: float, settings: ServingSettings, seed: int = 0,
                  progress: Progress | None = None, jobs: int = 1) -> list[RunResult]:
    """One run per rate, in order."""
    out = []
    for rate in rates:
        if progress:
            progress(f"{platform.label}: {'its own rate' if rate is None else f'{rate:,.0f} q/s'}")
        out.append(run_at(platform, traffic, rate, duration_s=duration_s, warmup_s=warmup_s, settings=settings,
                          seed=seed, jobs=jobs))
    return out


def check_bound(platform: Platform, traffic: Traffic, p99_ms: float, settings: ServingSettings) -> float:
    """The lone p99-size query's latency; ImpossibleTarget naming --p99-ms when it is over the bound."""
    if not (p99_ms > 0 and math.isfinite(p99_ms)):
        raise ValueError(f"--p99-ms must be > 0, got {p99_ms}")
    items = traffic.max_items(99.0)
    lone = lone_query_ms(platform, items, settings)
    if lone > p99_ms:
        raise ImpossibleTarget(f"--p99-ms {p99_ms:g}: a lone {items}-item query (the mix's p99 size) takes "
                               f"{lone:.1f} ms on {platform.label}, idle: no rate can meet the bound")
    return lone


def max_rate(platform: Platform, traffic: Traffic, p99_ms: float, *, duration_s: float, warmup_s: float,
             settings: ServingSettings, seed: int = 0, tolerance: float = 0.02, max_steps: int = 14,
             max_error_rate: float = 0.0, progress: Progress | None = None, jobs: int = 1) -> MaxRate:
    """Bisect the rate at which p99 reaches ``p99_ms`` (see the module docstring)."""
    lone = check_bound(platform, traffic, p99_ms, settings)
    capacity = platform.throughput_items_per_s() / traffic.mean_items(seed)
    if platform.per_request_s > 0:
        capacity = min(capacity, 1.0 / platform.per_request_s)
    answer = MaxRate(platform.label, p99_ms, 0.0, None, lone_ms=lone)

    def step(rate: float) -> bool:
        if progress:
            progress(f"{platform.label}: trying {rate:,.1f} q/s")
        result = run_at(platform, traffic, rate, duration_s=duration_s, warmup_s=warmup_s, settings=settings,
                        seed=seed, jobs=jobs)
        ok = _passes(result, p99_ms, max_error_rate)
        answer.steps.append(Step(rate, ok, result))
        if ok and rate > answer.max_qps:
            answer.max_qps, answer.best = rate, result
        return ok

    lo, hi = 0.0, capacity * 1.05  # the bound, a little over: the cost model's figure is not a promise
    if step(hi):  # passes even at the bound: report it (the platform is faster than its plan-style bound)
        return answer
    while len(answer.steps) < max_steps and hi - lo > tolerance * max(hi, 1e-9):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) else (lo, mid)
        if not lo and hi < capacity * 1e-4:
            break
    return answer


def fewest_cards(model: str, traffic: Traffic, qps: float, p99_ms: float, *, card_spec: str, host_spec: str,
                 table_precision: str = "fp32", dense_precision: str = "fp32", max_cards: int = 16,
                 max_rows: int | None = None, host_memory_bytes: int | None = None, duration_s: float,
                 warmup_s: float, settings: ServingSettings, seed: int = 0, max_error_rate: float = 0.0,
                 per_request_s: float | None = None, progress: Progress | None = None,
                 jobs: int = 1, serving_path: ServingPath | None = None,
                 emulation: EmulationCalibration | None = None,
                 host_stage_fit: HostStageFit | None = None) -> CardsAnswer:
    """Binary search over 1..``max_cards`` for the fewest cards whose run at ``qps`` passes."""
    if not (qps > 0 and math.isfinite(qps)):
        raise ValueError(f"--qps must be > 0, got {qps}")
    if max_cards < 1:
        raise ValueError(f"--max-cards must be >= 1, got {max_cards}")
    answer = CardsAnswer(card_spec, table_precision, dense_precision, None, None, None)
    extra: dict = {} if per_request_s is None else {"per_request_s": per_request_s}
    extra["serving_path"] = serving_path
    extra["emulation"] = emulation  # emulated cards here: priced at this host's speed (platform.build_platform)
    extra["host_stage_fit"] = host_stage_fit

    def platform(cards: int) -> Platform:
        return build_platform(model, cards=cards, card_spec=card_spec, host_spec=host_spec,
                              table_precision=table_precision, dense_precision=dense_precision,
                              max_rows=max_rows, host_memory_bytes=host_memory_bytes, **extra)

    def passes(cards: int) -> bool:
        p = platform(cards)
        if progress:
            progress(f"{p.label} ({table_precision}/{dense_precision}) at {qps:,.0f} q/s")
        result = run_at(p, traffic, qps, duration_s=duration_s, warmup_s=warmup_s, settings=settings, seed=seed,
                        jobs=jobs)
        answer.tried[cards] = result
        answer.passed[cards] = _passes(result, p99_ms, max_error_rate)
        return answer.passed[cards]

    try:
        check_bound(platform(max_cards), traffic, p99_ms, settings)
    except ImpossibleTarget as exc:
        answer.reason = str(exc)
        return answer
    if not passes(max_cards):
        answer.reason = f"not met with {max_cards} cards (raise --max-cards, or the host is the bottleneck)"
        return answer
    lo, hi = 0, max_cards  # lo fails (0 cards), hi passes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if passes(mid) else (mid, hi)
    answer.cards = hi
    answer.result = answer.tried[hi]
    answer.watts = platform(hi).power_watts
    return answer
