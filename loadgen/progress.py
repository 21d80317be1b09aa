"""Live progress while a run goes on: one rich line on a terminal, sparse plain lines otherwise.

It reads the RunRecord the driver writes (no locking: same event loop) and
does little work per refresh, so it does not disturb the send schedule.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import numpy as np
from rich.console import Console
from rich.live import Live
from rich.text import Text

from sixfold.loadgen.clock import Clock
from sixfold.loadgen.record import OK, RunRecord

__all__ = ["progress_line", "live_progress"]

_MAX_SAMPLE = 50_000


def progress_line(record: RunRecord, now_s: float, total_s: float, warmup_s: float = 0.0) -> str:
    """``t 12/30s | 99 q/s | p50 12.1 p99 40.2 ms | ok 1200 err 3 | in flight 34 | lag max 1.2 ms``.

    q/s counts answers in the last second; percentiles are over all answers so far.
    """
    done = record.order[:record.finished]
    recent = done[record.done[done] >= now_s - 1.0] if done.size else done
    if done.size > _MAX_SAMPLE:  # NOTE: bound the work per refresh on long runs
        done = done[:: done.size // _MAX_SAMPLE + 1]
    ok = done[record.status[done] == OK]
    lat = (record.done[ok] - record.due[ok]) * 1e3
    if lat.size:
        p50, p99 = np.percentile(lat, [50, 99], method="inverted_cdf")
        latency = f"p50 {p50:.1f} p99 {p99:.1f} ms"
    else:
        latency = "p50 - p99 - ms"
    phase = " (warmup)" if now_s < warmup_s else ""
    lag = record.send_lag()[:record.sent_count]
    lag_max = float(np.nanmax(lag)) * 1e3 if record.sent_count else 0.0
    return (f"t {max(0.0, now_s):.0f}/{total_s:.0f}s{phase} | {recent.size} q/s | {latency} | "
            f"ok {record.finished - record.errors} err {record.errors} | in flight {record.in_flight} | "
            f"lag max {lag_max:.1f} ms")


@contextlib.asynccontextmanager
async def live_progress(record: RunRecord, clock: Clock, console: Console, total_s: float, *,
                        warmup_s: float = 0.0, interval_s: float = 0.5,
                        plain_interval_s: float = 5.0) -> AsyncIterator[None]:
    """Refresh a live line while the body runs; plain lines every ``plain_interval_s`` off a TTY."""
    terminal = console.is_terminal
    live = Live(Text(""), console=console, auto_refresh=False, transient=True) if terminal else None

    async def refresh() -> None:
        while True:
            await asyncio.sleep(interval_s if terminal else plain_interval_s)
            line = progress_line(record, clock.now() - record.t0, total_s, warmup_s)
            if live is not None:
                live.update(Text(line), refresh=True)
            else:
                console.print(line, markup=False, highlight=False)

    task = asyncio.get_running_loop().create_task(refresh())
    if live is not None:
        live.start()
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if live is not None:
            live.stop()
