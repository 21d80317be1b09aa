"""What happened to every request of a run: due, sent and answered times, outcome.

Flat numpy arrays indexed by request number, written by the driver while the
run goes on and read by the live progress and the final statistics.
"""

from __future__ import annotations

import numpy as np

__all__ = ["RunRecord", "PENDING", "OK", "ERROR"]

PENDING, OK, ERROR = 0, 1, 2


class RunRecord:
    """Times are seconds after ``t0`` (the clock reading at offset 0 of the schedule)."""

    def __init__(self, offsets: np.ndarray, items: np.ndarray) -> None:
        n = int(offsets.size)
        self.due = np.asarray(offsets, dtype=np.float64)
        self.items = np.asarray(items, dtype=np.int64)
        self.sent = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.status = np.zeros(n, dtype=np.int8)
        self.reasons: dict[int, str] = {}
        self.order = np.zeros(n, dtype=np.int64)
        """Request numbers in completion order; the first ``finished`` entries are valid."""
        self.t0 = 0.0
        self.sent_count = 0
        self.finished = 0
        self.errors = 0

    def __len__(self) -> int:
        return int(self.due.size)

    @property
    def in_flight(self) -> int:
        return self.sent_count - self.finished

    def mark_sent(self, i: int, t: float) -> None:
        self.sent[i] = t
        self.sent_count += 1

    def _finish(self, i: int, t: float, status: int) -> None:
        self.done[i] = t
        self.status[i] = status
        self.order[self.finished] = i
        self.finished += 1

    def mark_ok(self, i: int, t: float) -> None:
        self._finish(i, t, OK)

    def mark_error(self, i: int, t: float, reason: str) -> None:
        self.reasons[i] = reason
        self.errors += 1
        self._finish(i, t, ERROR)

    def latency(self) -> np.ndarray:
        """Answer time minus DUE time, per request (NaN if unanswered): coordinated omission free."""
        return self.done - self.due

    def send_lag(self) -> np.ndarray:
        """How late the generator sent each request (NaN if never sent)."""
        return np.maximum(self.sent - self.due, 0.0)
