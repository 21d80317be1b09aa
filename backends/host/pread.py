"""Batched positional reads of table rows: a small C helper through ctypes, or a Python loop.

``gather(fd, offsets, row_bytes, out, block=0)`` reads row i from byte ``offsets[i]`` into
``out[i]``. The helper (``_pread.c``) is compiled with the system C compiler on first use
into ``$SIXFOLD_CACHE_DIR`` (default ``~/.cache/sixfold``) and called through ctypes, which
releases the GIL: a thread pool reads one batch's misses concurrently. With no compiler the
same reads run as an ``os.preadv`` loop (correct, slower: ~1 us of Python per row).
``block`` > 0: the file was opened with ``O_DIRECT``; reads are whole aligned blocks.
"""

from __future__ import annotations

import ctypes
import errno as errno_
import os

import numpy as np

from sixfold.backends.host.native import NativeHelper

__all__ = ["gather", "native_available", "ReadError"]


class ReadError(OSError):
    """A row read failed: ``index`` is the first row that did not read (errno 0: end of file)."""

    def __init__(self, err: int, index: int) -> None:
        message = os.strerror(err) if err else "unexpected end of file"
        super().__init__(err or errno_.EIO, message)
        self.index = index


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.sixfold_gather
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.POINTER(ctypes.c_int)]


HELPER = NativeHelper("_pread.c", _declare, opt_out=("SIXFOLD_PREAD", "python"),
                      purpose="table reads fall back to a Python pread loop")


def native_available() -> bool:
    """Whether reads go through the compiled helper (else a Python loop)."""
    return HELPER.load() is not None


def gather(fd: int, offsets: np.ndarray, row_bytes: int, out: np.ndarray, block: int = 0) -> None:
    """Read ``len(offsets)`` rows of ``row_bytes`` into ``out`` (C-contiguous, ``row_bytes`` per row)."""
    n = int(offsets.shape[0])
    if n == 0:
        return
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    assert out.flags.c_contiguous and out.nbytes >= n * row_bytes
    lib = HELPER.load()
    if lib is not None:
        err = ctypes.c_int(0)
        rc = lib.sixfold_gather(fd, offsets.ctypes.data, n, row_bytes, out.ctypes.data, block, ctypes.byref(err))
        if rc < 0:
            raise ReadError(err.value, int(-rc - 1))
        return
    view = memoryview(out.reshape(-1).view(np.uint8))
    if block:
        scratch = np.empty(row_bytes + 3 * block, np.uint8)  # aligned within: O_DIRECT needs an aligned buffer
        start = (-scratch.ctypes.data) % block
        for i, off in enumerate(offsets.tolist()):
            lo = off - off % block
            hi = -(-(off + row_bytes) // block) * block
            buf = memoryview(scratch[start:start + hi - lo])
            got = os.preadv(fd, [buf], lo)
            if got < off + row_bytes - lo:
                raise ReadError(0, i)
            view[i * row_bytes:(i + 1) * row_bytes] = buf[off - lo:off - lo + row_bytes]
        return
    for i, off in enumerate(offsets.tolist()):
        got = os.preadv(fd, [view[i * row_bytes:(i + 1) * row_bytes]], off)
        if got != row_bytes:
            raise ReadError(0, i)
