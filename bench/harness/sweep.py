"""The latency-bounded rate search (loadgen's ``--find-max-qps``, run in the bench process), its answer as
a JSON-ready dict, and what that answer says about the true maximum rate.

A search answer is not a number: a server may pass the highest rate tried (so "at least"), fail even
the floor ("below"), or pass a step from so few queries that its p99 is about their maximum ("at
most"). Ratios between servers are therefore intervals; reading them here keeps every bench honest
in the same way.
"""

from __future__ import annotations

import statistics
from typing import Any

from sixfold.loadgen import LoadConfig, SweepConfig, find_max_qps_async

__all__ = ["FEW_QUERIES", "INF", "fmt_qps", "fmt_ratio", "interval", "median_ratio", "mlperf_load", "ratio", "safe_div",
           "search_max_qps"]

FEW_QUERIES = 40  # a passing step with fewer queries likely drew only 0-1 of the 700-item ones (5% of the mix)
INF = float("inf")


def mlperf_load(url: str, model: str, cfg: Any, **kw: Any) -> LoadConfig:
    """The traffic the latency benches send ``model`` (``cfg``: its ``models.ModelConfig``): MLPerf DLRM query
    sizes (100..700 items) over the model's own table rows, pooling and id skew; ``kw``: the rest of the
    ``LoadConfig`` (rate, duration, seed, client ...)."""
    return LoadConfig(url=url, model=model, query_size="mlperf", table_rows=cfg.table_rows, pooling=cfg.pooling,
                      zipf=cfg.zipf, dense_dim=cfg.dense_dim, wait_ready_s=60.0, **kw)


async def search_max_qps(config: LoadConfig, *, p99_ms: float, lo: float, step_s: float, tolerance: float,
                         max_steps: int, floor: float, hi: float = 10_000.0, settle_s: float = 1.0,
                         console: Any = None) -> dict[str, Any]:
    """loadgen's find-max-qps search of ``config``'s server for one bound, from ``lo`` (doubling up to ``hi``,
    halving down to ``floor`` if the first step fails, then bisecting to ``tolerance``, at most
    ``max_steps`` steps of ``config.warmup_s`` + ``step_s``): the answer and its best step's figures,
    every step in ``steps``."""
    sweep = SweepConfig(p99_ms=p99_ms, min_qps=lo, max_qps=hi, floor_qps=floor, step_duration_s=step_s,
                        tolerance=tolerance, max_steps=max_steps, settle_s=settle_s)
    report = await find_max_qps_async(config, sweep, console=console)
    best = report.max_qps_under_slo
    found = best is not None
    measured = int(report.requests["scheduled"]) if found else None
    return {"max_qps": best, "floor": sweep.floor_qps, "lo": lo, "hi": hi, "at_ceiling": found and best >= hi,
            "queries": measured,
            "items_per_s": round(float(report.items_per_s), 1) if found else None,
            "p50_ms": report.latency_ms["p50"] if found else None,
            "p99_ms": report.latency_ms["p99"] if found else None,
            "steps": report.sweep, "warnings": list(report.warnings)}


def fmt_qps(r: dict[str, Any]) -> str:
    """A search answer as a table cell: ``12.50``, ``≥ 40.00`` (passed the ceiling), ``< 1`` (failed the floor),
    ``0`` (``infeasible``: not searched)."""
    if r.get("infeasible"):
        return "0"
    if r["max_qps"] is None:
        return f"< {r['floor']:g}"
    return ("≥ " if r["at_ceiling"] else "") + f"{r['max_qps']:.2f}"


def interval(r: dict[str, Any] | None) -> tuple[float, float] | None:
    """What one search result says about the true max q/s: (at least, at most); None: not measured."""
    if r is None:
        return None
    if r.get("infeasible"):
        return 0.0, 0.0
    if r["max_qps"] is None:
        return 0.0, r["floor"]
    if r["queries"] < FEW_QUERIES:  # † : a pass from a handful of queries says "at most about this"
        return 0.0, r["max_qps"]
    return r["max_qps"], INF if r["at_ceiling"] else r["max_qps"]


def safe_div(x: float, y: float) -> float:
    """``x / y`` with 0 / anything = 0 and x / 0 = inf."""
    if x == 0:
        return 0.0
    return INF if y == 0 else x / y


def ratio(a: tuple[float, float] | None, b: tuple[float, float] | None) -> dict[str, Any] | None:
    """a / b as an interval (low, high); ``both_zero`` when neither meets the bound at any rate."""
    if a is None or b is None:
        return None
    return {"low": safe_div(a[0], b[1]), "high": safe_div(a[1], b[0]), "both_zero": a == (0.0, 0.0) == b}


def median_ratio(values: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The median of per-run ratios, bound by bound (None: no run measured both)."""
    real = [v for v in values if v is not None]
    if not real:
        return None
    return {"low": statistics.median(v["low"] for v in real), "high": statistics.median(v["high"] for v in real),
            "both_zero": all(v["both_zero"] for v in real)}


def fmt_ratio(r: dict[str, Any] | None) -> str:
    """A ratio interval as a table cell: ``1.50``, ``≥ 1.20``, ``≤ 0.80``, ``0.90-1.10``, ``?`` (anything),
    ``both 0``, ``n/a`` (not measured)."""
    if r is None:
        return "n/a"
    lo, hi = r["low"], r["high"]
    if r["both_zero"]:
        return "both 0"
    if lo == hi:
        return "∞ (the other: 0)" if lo == INF else f"{lo:.2f}"
    if lo == 0 and hi == INF:
        return "?"
    if lo == 0:
        return f"≤ {hi:.2f}"
    return f"≥ {lo:.2f}" if hi == INF else f"{lo:.2f}-{hi:.2f}"
