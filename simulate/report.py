"""Tables (rich) and plots (matplotlib) of simulated runs, and their JSON form."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from sixfold.simulate.capacity import CardsAnswer, MaxRate
from sixfold.simulate.engine import RunResult

__all__ = ["runs_table", "max_rate_table", "cards_table", "plot_curves", "plot_max_rates", "plot_cards",
           "cards_figure", "write_json", "result_dict"]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _util(result: RunResult) -> str:
    u = result.utilisation
    cards = [v for k, v in u.items() if k.startswith("card")]
    parts = [f"loop {u.get('frontend', 0):.0%}", f"host {u.get('host', 0):.0%}"]
    if "host-dense" in u:
        parts.append(f"host-dense {u['host-dense']:.0%}")
    if cards:
        parts.append(f"cards {min(cards):.0%}-{max(cards):.0%}" if min(cards) != max(cards)
                     else f"cards {cards[0]:.0%}")
    return ", ".join(parts)


def _errors(result: RunResult) -> str:
    if not result.errors:
        return "0"
    total = sum(result.errors.values())
    return f"{total} ({', '.join(f'{k} {v}' for k, v in sorted(result.errors.items()))})"


def runs_table(rows: Sequence[tuple[str, RunResult]], title: str) -> Table:
    """One row per run: offered rate, latency percentiles, queueing, errors, utilisation."""
    table = Table(title=title, title_justify="left")
    for col in ("platform / traffic", "offered q/s", "answered q/s", "p50 ms", "p99 ms", "p99.9 ms",
                "queue wait p99 ms", "queue len mean / max", "batch rows", "errors", "utilisation"):
        table.add_column(col, justify="left" if col in ("platform / traffic", "errors", "utilisation") else "right")
    for label, r in rows:
        table.add_row(label, f"{r.rate:,.1f}", f"{r.achieved_qps:,.1f}", _ms(r.latency_ms["p50"]),
                      _ms(r.latency_ms["p99"]), _ms(r.latency_ms["p999"]), _ms(r.queue_ms["p99"]),
                      f"{r.queue_len['mean']:.1f} / {r.queue_len['max']}", f"{r.mean_batch_rows:.0f}",
                      _errors(r), _util(r))
    return table


def max_rate_table(rows: Sequence[tuple[str, MaxRate]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("platform / traffic", "max q/s", "p50 / p99 / p99.9 ms there", "lone p99-size query ms",
                "utilisation there", "steps"):
        table.add_column(col, justify="right" if col in ("max q/s", "steps") else "left")
    for label, m in rows:
        b = m.best
        there = (f"{_ms(b.latency_ms['p50'])} / {_ms(b.latency_ms['p99'])} / {_ms(b.latency_ms['p999'])}"
                 if b else "-")
        table.add_row(label, f"{m.max_qps:,.1f}", there, f"{m.lone_ms:.2f}", _util(b) if b else "-",
                      str(len(m.steps)))
    return table


def cards_table(answers: Sequence[tuple[str, CardsAnswer]], qps: float, p99_ms: float) -> Table:
    table = Table(title=f"Fewest cards for {qps:,.0f} q/s at p99 <= {p99_ms:g} ms", title_justify="left")
    for col in ("card spec", "tables / dense", "traffic", "cards", "card watts", "p50 / p99 ms", "utilisation",
                "tried (cards: p99 ms; x missed)"):
        table.add_column(col)
    for traffic, a in answers:
        tried = ", ".join(f"{c}: {_ms(r.latency_ms['p99'])}{'' if a.passed.get(c) else ' x'}"
                          for c, r in sorted(a.tried.items()))
        r = a.result
        table.add_row(a.card_spec, f"{a.table_precision} / {a.dense_precision}", traffic,
                      str(a.cards) if a.cards else f"- ({a.reason})",
                      f"{a.watts:,.0f}" if a.watts else ("-" if a.cards is None else "n/a"),
                      f"{_ms(r.latency_ms['p50'])} / {_ms(r.latency_ms['p99'])}" if r else "-",
                      _util(r) if r else "-", tried)
    return table


def result_dict(r: RunResult) -> dict[str, Any]:
    return {k: v for k, v in r.summary().items()}


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float))
    return path


def _figure():  # noqa: ANN202
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_curves(curves: Sequence[tuple[str, Sequence[RunResult]]], path: str | Path,
                p99_ms: float | None = None) -> Path:
    """p50, p99 and p99.9 against the offered rate, one colour per platform / traffic."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(8, 5))
    for k, (label, runs) in enumerate(curves):
        colour = f"C{k % 10}"
        rates = [r.rate for r in runs]
        for key, style, name in (("p50", ":", "p50"), ("p99", "-", "p99"), ("p999", "--", "p99.9")):
            ax.plot(rates, [r.latency_ms[key] if r.latency_ms[key] is not None else float("nan") for r in runs],
                    style, color=colour, marker="o", ms=3, label=f"{label} {name}")
    if p99_ms:
        ax.axhline(p99_ms, color="grey", lw=1, label=f"bound {p99_ms:g} ms")
    ax.set_xlabel("offered rate (queries/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("sixfold-simulate: latency vs offered rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_max_rates(rows: Sequence[tuple[str, MaxRate]], path: str | Path) -> Path:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(8, max(3, 0.4 * len(rows) + 1.5)))
    labels = [label for label, _ in rows]
    ax.barh(range(len(rows)), [m.max_qps for _, m in rows], color="C0")
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    bound = rows[0][1].p99_bound_ms if rows else 0
    ax.set_xlabel(f"max queries/s at p99 <= {bound:g} ms")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def cards_figure(answers: Sequence[tuple[str, CardsAnswer]], qps: float, p99_ms: float) -> Any:
    """The figure ``plot_cards`` saves (laid out: every label inside it)."""
    plt = _figure()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

    fig, ax = plt.subplots(figsize=(8, 5))
    for k, (traffic, a) in enumerate(answers):
        colour = f"C{k % 10}"
        cards = sorted(a.tried)
        p99 = [a.tried[c].latency_ms["p99"] or float("nan") for c in cards]
        # NOTE: the answer goes in the legend: answers at the same spot, written beside it, print over each other
        answer = (f"{a.cards} card{'s' if a.cards != 1 else ''}" + (f", {a.watts:,.0f} W" if a.watts else "")
                  if a.cards else "not met")
        ax.plot(cards, p99, "-", color=colour,
                label=f"{a.card_spec} {a.table_precision}/{a.dense_precision} {traffic}: {answer}")
        ok = [c for c in cards if a.passed.get(c)]
        bad = [c for c in cards if not a.passed.get(c)]
        ax.plot(ok, [a.tried[c].latency_ms["p99"] or float("nan") for c in ok], "o", color=colour)
        ax.plot(bad, [a.tried[c].latency_ms["p99"] or float("nan") for c in bad], "x", color=colour, ms=8)
        if a.cards:
            ax.plot([a.cards], [a.tried[a.cards].latency_ms["p99"] or float("nan")], "o", ms=14, mfc="none",
                    color=colour)
    ax.axhline(p99_ms, color="grey", lw=1, label=f"bound {p99_ms:g} ms")
    handles, labels = ax.get_legend_handles_labels()
    handles += [Line2D([], [], color="black", marker="o", ls=""), Line2D([], [], color="black", marker="x", ls=""),
                Line2D([], [], color="black", marker="o", ms=10, mfc="none", ls="")]
    labels += ["met the bound", "missed: over the bound, refused or saturated", "the answer: fewest cards that met it"]
    ax.set_xlabel("cards")
    ax.set_ylabel(f"p99 latency at {qps:,.0f} q/s (ms)")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())  # 20, 50, not 2x10^1, 5x10^1
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # a card count is whole
    ax.grid(True, alpha=0.3)
    ax.legend(handles, labels, fontsize=7)
    ax.set_title(f"Fewest cards for {qps:,.0f} q/s at p99 <= {p99_ms:g} ms")
    fig.tight_layout()
    return fig


def plot_cards(answers: Sequence[tuple[str, CardsAnswer]], qps: float, p99_ms: float, path: str | Path) -> Path:
    """p99 at the target rate against cards tried, per spec; the answer and its watts marked."""
    fig = cards_figure(answers, qps, p99_ms)
    fig.savefig(path, dpi=120)
    _figure().close(fig)
    return Path(path)
