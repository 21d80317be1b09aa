"""PNG plots of a run (matplotlib, Agg backend: no display needed).

- timeline: p50/p99 latency and sent (bars) / ok / errors (lines) per second of the window;
- CDF: the latency distribution (``latency_cdf_ms``), log-scaled tail view;
- sweep: offered QPS vs p99 (and achieved QPS) of a ``--find-max-qps`` search.

``plot_all(report, spec)`` draws what the report has. ``spec`` ending in
``.png`` is the main plot's path (the sweep for a search, else the timeline)
and the others go next to it as ``STEM-cdf.png`` / ``STEM-timeline.png``;
any other ``spec`` is a prefix: ``PREFIX-timeline.png``, ``PREFIX-cdf.png``,
``PREFIX-sweep.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sixfold.loadgen.report import Report

__all__ = ["plot_report", "plot_cdf", "plot_sweep", "plot_all", "plot_paths"]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # NOTE: no display needed; also safe in worker threads
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _pyplot().close(fig)
    return path


def _title(report: Report) -> str:
    how = (f"closed loop, {report.concurrency} outstanding" if report.mode == "closed"
           else f"{report.config.get('arrival')} {report.offered_qps:g} q/s")
    return f"{report.target.get('model', '')}: {how}, query size {report.config.get('query_size')}"


def plot_report(report: Report, path: str | Path) -> Path:
    """Draw p50/p99 latency and sent/ok/errors per second of the measured window."""
    plt = _pyplot()
    rows = report.timeline
    t = [r["t"] for r in rows]
    fig, (ax_lat, ax_qps) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
        ax_lat.plot(t, [r[key] if r[key] is not None else float("nan") for r in rows], marker=".", label=label)
    ax_lat.set_ylabel("latency from scheduled send (ms)")
    ax_lat.legend()
    ax_lat.grid(alpha=0.3)
    # NOTE: sent and ok are equal in any second where all were answered: bars under a line keep both in sight
    ax_qps.bar(t, [r["sent"] for r in rows], width=0.8, color="lightgrey", edgecolor="grey", label="sent")
    ax_qps.plot(t, [r["ok"] for r in rows], color="tab:green", marker=".", label="ok")
    ax_qps.plot(t, [r["errors"] for r in rows], color="tab:red", marker="x", label="errors")
    ax_qps.set_ylabel("requests per second (by due time)")
    ax_qps.set_xlabel("second of the measured window")
    ax_qps.set_ylim(0, 1.3 * max([1] + [r["sent"] for r in rows]))  # room above the bars for the legend
    handles, labels = ax_qps.get_legend_handles_labels()
    order = [labels.index(name) for name in ("sent", "ok", "errors")]
    ax_qps.legend([handles[k] for k in order], [labels[k] for k in order], loc="upper right", ncol=3)
    ax_qps.grid(alpha=0.3)
    fig.suptitle(_title(report))
    return _save(fig, path)


def plot_cdf(report: Report, path: str | Path) -> Path:
    """Latency CDF (left) and the tail as 1 - CDF on a log scale (right), p50/p99 marked."""
    plt = _pyplot()
    points = report.latency_cdf_ms
    fig, (ax, ax_tail) = plt.subplots(1, 2, figsize=(10, 4.5))
    if points:
        pct = [p for p, _ in points]
        ms = [v for _, v in points]
        ax.step(ms, [p / 100 for p in pct], where="post")
        tail = [(v, 1 - p / 100) for p, v in points if p < 100]
        ax_tail.step([v for v, _ in tail], [q for _, q in tail], where="post")
        ax_tail.set_yscale("log")
        for name, style in (("p50", ":"), ("p99", "--")):
            value = report.latency_ms.get(name)
            if value is not None:
                for a in (ax, ax_tail):
                    a.axvline(value, linestyle=style, color="grey")
                ax.text(value, 0.02, f" {name} {value:.1f} ms", rotation=90, va="bottom", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no answered requests", ha="center", transform=ax.transAxes)
    ax.set_xlabel("latency from scheduled send (ms)")
    ax.set_ylabel("fraction of requests <= latency")
    ax_tail.set_xlabel("latency (ms)")
    ax_tail.set_ylabel("fraction slower (1 - CDF)")
    for a in (ax, ax_tail):
        a.grid(alpha=0.3)
    fig.suptitle("latency CDF  " + _title(report))
    return _save(fig, path)


def plot_sweep(report: Report, path: str | Path) -> Path:
    """Offered QPS vs p99 (pass green, fail red), the SLO line, achieved QPS on a second axis."""
    plt = _pyplot()
    rows = sorted(report.sweep or [], key=lambda r: r["qps"])
    slo = (report.slo or {}).get("p99_ms")
    fig, ax = plt.subplots(figsize=(9, 5))
    qps = [r["qps"] for r in rows]
    ax.plot(qps, [r["p99_ms"] if r["p99_ms"] is not None else float("nan") for r in rows], color="tab:blue",
            label="p99")
    ax.plot(qps, [r["p50_ms"] if r["p50_ms"] is not None else float("nan") for r in rows], color="tab:blue",
            linestyle=":", label="p50")
    for r in rows:
        if r["p99_ms"] is not None:
            ax.scatter(r["qps"], r["p99_ms"], color="tab:green" if r["pass"] else "tab:red", zorder=3)
    if slo is not None:
        ax.axhline(slo, color="grey", linestyle="--", label=f"p99 target {slo:g} ms")
    if report.max_qps_under_slo is not None:
        ax.axvline(report.max_qps_under_slo, color="tab:green", linestyle="-.",
                   label=f"max QPS under target: {report.max_qps_under_slo:,.1f}")
    ax.set_yscale("log")
    from matplotlib.ticker import ScalarFormatter

    for axis in (ax.yaxis,):
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(ScalarFormatter())
    ax.set_xlabel("offered load (queries/s)")
    ax.set_ylabel("latency from scheduled send (ms)")
    ax.grid(alpha=0.3, which="both")
    ax2 = ax.twinx()
    ax2.plot(qps, [r["achieved_qps"] for r in rows], color="tab:orange", marker="x", label="achieved q/s")
    ax2.plot(qps, qps, color="tab:orange", alpha=0.3, linestyle="--")
    ax2.set_ylabel("achieved queries/s", color="tab:orange")
    handles = ax.get_legend_handles_labels()
    more = ax2.get_legend_handles_labels()
    ax.legend(handles[0] + more[0], handles[1] + more[1], loc="upper left", fontsize=8)
    fig.suptitle(f"find-max-qps  {report.target.get('model', '')}, query size {report.config.get('query_size')}")
    return _save(fig, path)


def plot_paths(report: Report, spec: str | Path) -> dict[str, Path]:
    """Which plot goes where for ``--plot spec`` (see the module docstring)."""
    spec = Path(spec)
    kinds = ["sweep", "timeline", "cdf"] if report.sweep else ["timeline", "cdf"]
    if spec.suffix.lower() == ".png":
        stem = spec.with_suffix("")
        return {kind: spec if k == 0 else Path(f"{stem}-{kind}.png") for k, kind in enumerate(kinds)}
    return {kind: Path(f"{spec}-{kind}.png") for kind in kinds}


def plot_all(report: Report, spec: str | Path) -> list[Path]:
    """Draw every plot the report supports; returns the files written."""
    draw = {"timeline": plot_report, "cdf": plot_cdf, "sweep": plot_sweep}
    return [draw[kind](report, path) for kind, path in plot_paths(report, spec).items()]
