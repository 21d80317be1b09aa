"""Reports: every key, valid JSON, the loud warning when the generator fell behind, live progress."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
from rich.console import Console

from sixfold.loadgen import LoadConfig, RunRecord, print_report, summarize
from sixfold.loadgen.report import generator_fell_behind
from sixfold.loadgen.progress import progress_line

CONFIG = LoadConfig(url="127.0.0.1:1", model="m", qps=100.0, duration_s=1.0)


def record(lag_s: float = 0.0, every: int = 1) -> RunRecord:
    due = np.arange(100) / 100
    rec = RunRecord(due, np.full(100, 200))
    for i, t in enumerate(due):
        sent = t + (lag_s if i % every == 0 else 0.0)
        rec.mark_sent(i, sent)
        rec.mark_ok(i, sent + 0.010)
    return rec


def test_report_is_complete_json(tmp_path):
    report = summarize(record(), CONFIG, {"url": CONFIG.url, "model": "m"})
    data = json.loads(report.write_json(tmp_path / "r.json").read_text())
    for key in ("latency_ms", "achieved_qps", "requests", "items_per_s", "offered_qps", "duration_s",
                "query_size", "send_lag_ms", "errors_by_reason", "config", "timeline", "warnings"):
        assert key in data
    assert data["requests"]["sent"] == data["requests"]["ok"] == 100
    assert data["latency_ms"]["p50"] == 10.0 and data["query_size"]["mean"] == 200
    assert data["achieved_qps"] == 100.0 and data["items_per_s"] == 20_000
    assert data["warnings"] == []


def test_generator_falling_behind_is_loud():
    report = summarize(record(lag_s=0.020), CONFIG, {})
    assert report.send_lag_ms["p99"] == 20.0 and report.send_lag_ms["late"] == 100
    assert report.latency_ms["p50"] == 30.0  # lag is charged to latency
    assert report.warnings[0].startswith("GENERATOR FELL BEHIND") and generator_fell_behind(report)
    out = io.StringIO()
    print_report(report, Console(file=out, width=120))
    assert "GENERATOR FELL BEHIND" in out.getvalue()


def test_an_occasional_late_send_is_a_note_only():
    report = summarize(record(lag_s=0.020, every=100), CONFIG, {})
    assert report.send_lag_ms["late"] == 1 and report.send_lag_ms["p99"] < 5.0
    assert report.warnings[0].startswith("note: generator was late") and not generator_fell_behind(report)


def test_progress_line():
    line = progress_line(record(), 1.0, 1.0)
    assert "100 q/s" in line and "p50 10.0 p99 10.0 ms" in line and "ok 100 err 0" in line


async def test_live_progress_on_a_terminal_and_off_it():
    from sixfold.loadgen import MonotonicClock
    from sixfold.loadgen.progress import live_progress

    rec = record()
    for terminal in (True, False):
        out = io.StringIO()
        console = Console(file=out, force_terminal=terminal, width=150)
        async with live_progress(rec, MonotonicClock(), console, 1.0, interval_s=0.02, plain_interval_s=0.02):
            await asyncio.sleep(0.1)
        text = out.getvalue()
        assert "ok 100 err 0" in text
        assert ("\x1b[" in text) == terminal  # plain lines, no escape codes, off a terminal


def test_timeline_plot_shows_sent_even_where_all_were_answered(tmp_path, monkeypatch):
    """sent == ok in every second here: sent are bars, ok a line over them, both in the legend."""
    from matplotlib.container import BarContainer

    from sixfold.loadgen import plot

    report = summarize(record(), CONFIG, {"url": CONFIG.url, "model": "m"})
    drawn = {}
    real_save = plot._save
    monkeypatch.setattr(plot, "_save", lambda fig, path: drawn.setdefault("fig", fig) and real_save(fig, path))
    path = plot.plot_report(report, tmp_path / "t.png")
    assert path.stat().st_size > 0
    ax = drawn["fig"].axes[1]
    [bars] = [c for c in ax.containers if isinstance(c, BarContainer)]
    [ok] = [line for line in ax.get_lines() if line.get_label() == "ok"]
    assert [b.get_height() for b in bars] == list(ok.get_ydata()) == [r["sent"] for r in report.timeline]
    assert bars.get_label() == "sent" and ok.get_color() != bars.patches[0].get_facecolor()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["sent", "ok", "errors"]
    assert ax.get_ylim()[1] > max(r["sent"] for r in report.timeline)  # the legend sits above the bars
