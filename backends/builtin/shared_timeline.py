"""A simulated card's modelled busy time, shared by every process that simulates the same card.

Several server processes (``sixfold-serve --workers N``) each load the same plan, so each holds
a copy of every simulated card. Without a shared timeline each copy would serve on its own, and N
processes would model N times the cards. With one, the copies of a card are one card: a batch
starts when the card is free of every process's earlier batches. The time lives in an 8-byte
file (``mmap``) per card and loaded partition (its name and a digest of its payload, so two models'
partitions of one name on one card stay two queues, as in one process), advanced under ``flock``;
the clock must be one that all processes share (``time.monotonic`` is the host's).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import re
import struct
from pathlib import Path

__all__ = ["SharedTimeline", "payload_digest"]

_SLOT = struct.Struct("d")


def payload_digest(payload: object) -> str:
    """What tells one loaded partition from another of the same name: its bytes, or the file they are in."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return hashlib.blake2b(payload, digest_size=8).hexdigest()
    if isinstance(payload, (str, os.PathLike)):
        return hashlib.blake2b(os.fsencode(os.path.realpath(payload)), digest_size=8).hexdigest()
    return ""


class SharedTimeline:
    """``advance(arrival, service)`` places a batch on the card's timeline; every process sees it."""

    def __init__(self, folder: str | Path, card: str, partition: str, digest: str = "") -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / re.sub(r"[^A-Za-z0-9_.-]", "_", f"{card}--{partition}--{digest}.timeline")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if os.fstat(self._fd).st_size < _SLOT.size:  # the first process to open it: free since ever
                    os.pwrite(self._fd, _SLOT.pack(float("-inf")), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(self._fd, _SLOT.size)
        except BaseException:
            os.close(self._fd)
            raise

    def advance(self, arrival: float, service: float) -> float:
        """The batch's modelled finish: it starts when it arrives or when the card is free, whichever is later."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            finish = max(arrival, _SLOT.unpack_from(self._map)[0]) + service
            _SLOT.pack_into(self._map, 0, finish)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        return finish

    @property
    def busy_until(self) -> float:
        return _SLOT.unpack_from(self._map)[0]

    def close(self) -> None:
        if self._fd >= 0:
            self._map.close()
            os.close(self._fd)
            self._fd = -1
