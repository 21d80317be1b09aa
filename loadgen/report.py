"""The result of a run: a JSON file other tools read, and a table people read.

JSON keys (stable; other tools rely on them): ``latency_ms`` {p50, p90, p95,
p99, p999, max, mean, min}, ``achieved_qps``, ``items_per_s``, ``offered_qps``,
``scheduled_qps``, ``duration_s``, ``requests`` {sent, ok, errors, ...},
``query_size`` {mean, p50, max, ...}, ``send_lag_ms`` {p50, p99, max, late,
threshold_ms}, ``errors_by_reason``, ``config``, ``target``, ``timeline``
[{t, sent, ok, errors, p50_ms, p99_ms}], ``warnings``, ``mode`` (open | closed |
replay), ``concurrency``, ``latency_cdf_ms`` [[percentile, ms], ...], and for
``--find-max-qps``: ``sweep`` [{qps, achieved_qps, p50_ms, p99_ms, errors, pass,
...}] and ``max_qps_under_slo``; ``recording`` when the run was recorded.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["Report", "SCHEMA", "print_report", "generator_fell_behind", "endpoint_note"]

SCHEMA = "sixfold.loadgen.report/1"


@dataclass
class Report:
    """One run's measured window (warmup excluded); see the module docstring for the keys."""

    config: dict[str, Any]
    target: dict[str, Any]
    duration_s: float
    offered_qps: float
    scheduled_qps: float
    achieved_qps: float
    items_per_s: float
    answer_span_s: float
    requests: dict[str, int]
    latency_ms: dict[str, float | None]
    query_size: dict[str, float | None]
    send_lag_ms: dict[str, float | None]
    errors_by_reason: dict[str, int]
    timeline: list[dict[str, Any]]
    warmup: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    started_at: str = ""
    wall_s: float = 0.0
    mode: str = "open"
    """``open`` (scheduled arrivals), ``closed`` (``concurrency`` outstanding) or ``replay``."""
    concurrency: int | None = None
    latency_cdf_ms: list[list[float]] = field(default_factory=list)
    """[[percentile, latency ms], ...] from 0 to 100, denser in the tail: enough to draw the CDF."""
    sweep: list[dict[str, Any]] | None = None
    """--find-max-qps: one row per step, in the order run."""
    max_qps_under_slo: float | None = None
    slo: dict[str, float] | None = None
    recording: str | None = None
    schema: str = SCHEMA

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: str | Path) -> Path:
        """Write the report (creating parent folders); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        return path


def generator_fell_behind(report: Report) -> bool:
    """True when the p99 send lag passed the threshold: the offered load was not what was asked."""
    p99 = report.send_lag_ms.get("p99")
    return p99 is not None and p99 > report.send_lag_ms["threshold_ms"]


def endpoint_note(target: dict[str, Any]) -> str:
    """`` (REST, TLS)``, `` (TLS)``, `` (REST)`` or nothing (gRPC, plaintext) for a report's ``target``."""
    parts = (["REST"] if target.get("protocol") == "http" else []) + (["TLS"] if target.get("ssl") else [])
    return f" ({', '.join(parts)})" if parts else ""


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def print_report(report: Report, console: Console) -> None:
    """The summary table, then any warnings (a generator that fell behind in bold red)."""
    lat, req, size, lag = report.latency_ms, report.requests, report.query_size, report.send_lag_ms
    table = Table(title=Text(f"sixfold-loadgen  {report.target.get('model', '')} @ {report.target.get('url', '')}"
                             + endpoint_note(report.target)),
                  show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("latency p50 / p90 / p99 (ms)", f"{_ms(lat['p50'])} / {_ms(lat['p90'])} / {_ms(lat['p99'])}")
    table.add_row("latency p99.9 / max (ms)", f"{_ms(lat['p999'])} / {_ms(lat['max'])}")
    if report.mode == "closed":
        table.add_row(f"queries/s achieved (closed loop, {report.concurrency} outstanding)",
                      f"{report.achieved_qps:,.1f}")
    else:
        table.add_row("queries/s achieved (offered)", f"{report.achieved_qps:,.1f} ({report.offered_qps:,.1f})")
    table.add_row("items/s", f"{report.items_per_s:,.0f}")
    table.add_row("requests sent / ok / errors", Text(f"{req['sent']:,} / {req['ok']:,} / {req['errors']:,}",
                                                      style="bold red" if req["errors"] else ""))
    if size["mean"] is not None:
        table.add_row("items/query mean / p50 / max", f"{size['mean']:.1f} / {size['p50']:.0f} / {size['max']:.0f}")
    table.add_row("send lag p99 / max (ms)", f"{_ms(lag['p99'])} / {_ms(lag['max'])}")
    table.add_row("window (s)", f"{report.duration_s:g}")
    console.print(table)
    if report.errors_by_reason:
        reasons = ", ".join(f"{k}: {v}" for k, v in report.errors_by_reason.items())
        console.print(Text(f"errors by reason: {reasons}", style="red"))
    for warning in report.warnings:
        console.print(Text(warning, style="bold red" if warning.startswith("GENERATOR") else "yellow"))
