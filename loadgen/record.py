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
        self.size = n
        """Requests in the record; the arrays may be longer (closed loop grows them, then trims)."""
        self.sent_count = 0
        self.finished = 0
        self.errors = 0

    def __len__(self) -> int:
        return self.size

    @classmethod
    def growing(cls, capacity: int = 1024) -> "RunRecord":
        """An empty record for a closed-loop run, whose requests are added as they go (``add``)."""
        record = cls(np.full(max(1, capacity), np.nan), np.zeros(max(1, capacity), dtype=np.int64))
        record.size = 0
        return record

    def add(self, due: float, items: int) -> int:
        """Append a request due at ``due`` with ``items`` items; returns its number."""
        i = self.size
        if i == self.due.size:
            grow = max(1024, i)
            self.due = np.concatenate([self.due, np.full(grow, np.nan)])
            self.items = np.concatenate([self.items, np.zeros(grow, dtype=np.int64)])
            self.sent = np.concatenate([self.sent, np.full(grow, np.nan)])
            self.done = np.concatenate([self.done, np.full(grow, np.nan)])
            self.status = np.concatenate([self.status, np.zeros(grow, dtype=np.int8)])
            self.order = np.concatenate([self.order, np.zeros(grow, dtype=np.int64)])
        self.due[i], self.items[i] = due, items
        self.size = i + 1
        return i

    def trim(self) -> "RunRecord":
        """Cut the arrays to the requests really added (after a closed-loop run)."""
        n = self.size
        self.due, self.items, self.sent = self.due[:n], self.items[:n], self.sent[:n]
        self.done, self.status, self.order = self.done[:n], self.status[:n], self.order[:n]
        return self

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
