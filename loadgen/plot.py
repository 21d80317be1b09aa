"""A PNG of a run's timeline: latency percentiles and throughput per second."""

from __future__ import annotations

from pathlib import Path

from .report import Report

__all__ = ["plot_report"]


def plot_report(report: Report, path: str | Path) -> Path:
    """Draw p50/p99 latency and sent/ok/errors per second of the measured window."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: no display needed; also safe in worker threads
    import matplotlib.pyplot as plt

    rows = report.timeline
    t = [r["t"] for r in rows]
    fig, (ax_lat, ax_qps) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    for key, label in (("p50_ms", "p50"), ("p99_ms", "p99")):
        ax_lat.plot(t, [r[key] if r[key] is not None else float("nan") for r in rows], label=label)
    ax_lat.set_ylabel("latency from scheduled send (ms)")
    ax_lat.legend()
    ax_lat.grid(alpha=0.3)
    ax_qps.plot(t, [r["sent"] for r in rows], label="sent")
    ax_qps.plot(t, [r["ok"] for r in rows], label="ok")
    ax_qps.plot(t, [r["errors"] for r in rows], label="errors")
    ax_qps.set_ylabel("requests per second (by due time)")
    ax_qps.set_xlabel("second of the measured window")
    ax_qps.legend()
    ax_qps.grid(alpha=0.3)
    fig.suptitle(f"{report.target.get('model', '')}: {report.config.get('arrival')} "
                 f"{report.offered_qps:g} q/s, query size {report.config.get('query_size')}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
