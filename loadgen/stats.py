"""Numbers from a RunRecord: percentiles, rates, send lag, and the per-second timeline.

Percentiles are nearest-rank: every reported value is a
latency some request really had. Empty inputs give ``None`` (JSON null).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sixfold.loadgen.record import ERROR, OK, PENDING, RunRecord

__all__ = ["percentiles", "LATENCY_QUANTILES", "CDF_PERCENTILES", "window_stats", "timeline", "latency_cdf"]

LATENCY_QUANTILES: dict[str, float] = {"p50": 50, "p90": 90, "p95": 95, "p99": 99, "p999": 99.9}


def percentiles(values: np.ndarray, quantiles: dict[str, float] = LATENCY_QUANTILES, *,
                scale: float = 1.0) -> dict[str, float | None]:
    """``{name: value}`` for each quantile plus ``max``, times ``scale``; ``None`` when empty."""
    values = np.asarray(values, dtype=np.float64)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return {**{name: None for name in quantiles}, "max": None}
    values = np.sort(values)
    n = values.size
    out: dict[str, float | None] = {}
    for name, q in quantiles.items():
        # NOTE: the tolerance keeps 99.9% of 1000 at rank 999 despite float rounding.
        rank = min(n, max(1, int(np.ceil(q / 100.0 * n - 1e-9))))
        out[name] = float(values[rank - 1]) * scale
    out["max"] = float(values[-1]) * scale
    return out


CDF_PERCENTILES: tuple[float, ...] = tuple(float(p) for p in range(0, 100)) + (99.5, 99.9, 99.95, 99.99, 100.0)


def latency_cdf(record: RunRecord, start_s: float, duration_s: float) -> list[list[float]]:
    """[[percentile, ms], ...] of the answered requests due in the window (nearest rank; p0 is the min)."""
    mask = (record.due >= start_s) & (record.due < start_s + duration_s) & (record.status == OK)
    values = np.sort(record.latency()[mask]) * 1e3
    if values.size == 0:
        return []
    n = values.size
    ranks = np.clip(np.ceil(np.asarray(CDF_PERCENTILES) / 100.0 * n - 1e-9).astype(np.int64), 1, n)
    return [[p, round(float(values[r - 1]), 3)] for p, r in zip(CDF_PERCENTILES, ranks.tolist())]


def _round(d: dict[str, Any], digits: int = 3) -> dict[str, Any]:
    return {k: (round(v, digits) if isinstance(v, float) else v) for k, v in d.items()}


def window_stats(record: RunRecord, start_s: float, duration_s: float, *,
                 lag_threshold_ms: float) -> dict[str, Any]:
    """Summary of the requests DUE in [start_s, start_s + duration_s) (the measured window).

    ``achieved_qps`` divides the answers by the time the server took to give
    them: the window, or longer when answers came after it (during the drain),
    so a server that falls behind cannot look as fast as the offered load.
    """
    due = record.due
    mask = (due >= start_s) & (due < start_s + duration_s)
    status = record.status[mask]
    ok = status == OK
    latency_s = record.latency()[mask][ok]
    items = record.items[mask]
    sent = int(np.count_nonzero(~np.isnan(record.sent[mask])))
    errors = int(np.count_nonzero(status == ERROR))
    pending = int(np.count_nonzero(status == PENDING))
    done_ok = record.done[mask][ok]
    span = max(duration_s, float(done_ok.max()) - start_s) if done_ok.size else duration_s
    lag_ms = record.send_lag()[mask] * 1e3
    lag_ms = lag_ms[~np.isnan(lag_ms)]
    reasons: dict[str, int] = {}
    for i in np.flatnonzero(mask & (record.status == ERROR)).tolist():
        reason = record.reasons.get(i, "unknown")
        reasons[reason] = reasons.get(reason, 0) + 1
    size_pct = percentiles(items, {"p50": 50, "p99": 99})
    return {
        "requests": {"scheduled": int(mask.sum()), "sent": sent, "ok": int(ok.sum()), "errors": errors,
                     "unsent": pending},
        "latency_ms": _round({**percentiles(latency_s, scale=1e3),
                              "mean": float(latency_s.mean() * 1e3) if latency_s.size else None,
                              "min": float(latency_s.min() * 1e3) if latency_s.size else None}),
        "achieved_qps": round(ok.sum() / span, 3),
        "items_per_s": round(float(items[ok].sum()) / span, 3),
        "scheduled_qps": round(mask.sum() / duration_s, 3),
        "answer_span_s": round(span, 3),
        "query_size": _round({"mean": float(items.mean()) if items.size else None,
                              "min": int(items.min()) if items.size else None,
                              "p50": size_pct["p50"], "p99": size_pct["p99"], "max": size_pct["max"]}),
        "send_lag_ms": _round({**percentiles(lag_ms, {"p50": 50, "p99": 99}),
                               "late": int(np.count_nonzero(lag_ms > lag_threshold_ms)),
                               "threshold_ms": float(lag_threshold_ms)}),
        "errors_by_reason": dict(sorted(reasons.items(), key=lambda kv: -kv[1])),
    }


def timeline(record: RunRecord, start_s: float, duration_s: float) -> list[dict[str, Any]]:
    """One entry per second of the window, by DUE time: what was sent then and how it fared.

    Bucketing by due time puts a stall's latency on the seconds whose requests
    suffered it.
    """
    latency_ms = record.latency() * 1e3
    seconds = int(np.ceil(duration_s - 1e-9))
    bucket = np.floor(record.due - start_s).astype(np.int64)
    order = np.argsort(bucket, kind="stable")
    edges = np.searchsorted(bucket[order], np.arange(seconds + 1))
    rows = []
    for t in range(seconds):
        idx = order[edges[t]:edges[t + 1]]
        status = record.status[idx]
        ok = status == OK
        pct = percentiles(latency_ms[idx][ok], {"p50": 50, "p99": 99})
        rows.append({"t": t, "sent": int(np.count_nonzero(~np.isnan(record.sent[idx]))), "ok": int(ok.sum()),
                     "errors": int(np.count_nonzero(status == ERROR)),
                     "p50_ms": None if pct["p50"] is None else round(pct["p50"], 3),
                     "p99_ms": None if pct["p99"] is None else round(pct["p99"], 3)})
    return rows
