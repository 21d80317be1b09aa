"""A shared-memory arena: one file in the run folder (/dev/shm), mapped by a front end and the engine.

Tensors cross between the processes of ``sixfold-serve --workers N`` here instead of being pickled
onto a socket: the writer copies an array into a block it allocated, sends the block's offset in a
small header (``sixfold.server.workers.engine_channel``), and the reader views it as a numpy array
in place. Each arena has one allocating side (a front end for request inputs, the engine for
response outputs); the other side only reads and says when a block may be freed. The file's size
is the bound: a full arena is a refusal, never growth. The file is sparse, so it holds memory only
for the blocks in use.
"""

from __future__ import annotations

import bisect
import mmap
import os
from pathlib import Path

import numpy as np

__all__ = ["ALIGN", "Arena", "ArenaFile"]

ALIGN = 64
"""Every block starts on a cache line, so every dtype's view is aligned."""


class Arena:
    """First-fit allocation of ``size`` bytes: blocks of offsets, freed by offset. One thread only."""

    def __init__(self, size: int) -> None:
        if size < ALIGN:
            raise ValueError(f"arena size must be >= {ALIGN} bytes, got {size}")
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]
        """Free (offset, length) runs, sorted by offset and merged with their neighbours."""
        self._used: dict[int, int] = {}
        self.held = 0
        """Bytes in allocated blocks."""

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free block of at least ``nbytes``; None when no run is that large."""
        need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self._used[offset] = need
                self.held += need
                return offset
        return None

    def free(self, offset: int) -> None:
        """Give a block back; KeyError for an offset that is not an allocated block's."""
        length = self._used.pop(offset)
        self.held -= length
        i = bisect.bisect(self._free, (offset, 0))
        if i < len(self._free) and offset + length == self._free[i][0]:  # merge with the run after
            length += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # and the run before
            offset, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, length))


class ArenaFile:
    """The arena's bytes: a file of ``size`` bytes mapped shared (``create`` makes it, ``open`` maps it)."""

    def __init__(self, path: Path, size: int, *, create: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise ValueError(f"arena {path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size

    def write(self, offset: int, array: np.ndarray) -> None:
        """Copy ``array`` (C order) into the arena at ``offset``."""
        target = np.ndarray(array.shape, array.dtype, self.map, offset)
        np.copyto(target, array, casting="no")

    def view(self, offset: int, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        """A read-only array over the arena's bytes at ``offset`` (no copy)."""
        array = np.ndarray(shape, dtype, self.map, offset)
        array.flags.writeable = False
        return array

    def unlink(self) -> None:
        """Remove the file (the mapping stays valid until every view is gone)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
