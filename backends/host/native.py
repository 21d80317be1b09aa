"""Small C helpers, compiled with the system C compiler on first use and called through ctypes.

A helper is one C file next to this module. It is compiled once per machine (and per source
version: the file name carries its hash) into ``cache_dir()`` (``$SIXFOLD_CACHE_DIR``, default
``~/.cache/sixfold``), then loaded with ``ctypes``, whose calls release the GIL. With no
compiler, or with the helper's opt-out variable set, ``load`` returns ``None`` and the
caller runs its pure-Python/numpy path, which gives the same results more slowly.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["NativeHelper", "cache_dir"]

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where sixfold keeps per-machine files (compiled helpers, calibrations): $SIXFOLD_CACHE_DIR, else
    $XDG_CACHE_HOME/sixfold, else ~/.cache/sixfold."""
    if os.environ.get("SIXFOLD_CACHE_DIR"):
        return Path(os.environ["SIXFOLD_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sixfold"


def write_json_atomic(path: Path, data: object) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary file renamed into place: two processes
    calibrating at once leave one whole file, and a reader never sees half of one."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


class NativeHelper:
    """One C source, loaded at most once per process.

    ``declare`` sets the ``argtypes``/``restype`` of the functions the caller uses (and so
    fails, leaving the Python path, if a symbol is missing). ``opt_out`` is an environment
    variable and the value that turns the helper off (e.g. ``("SIXFOLD_PREAD", "python")``).
    ``purpose`` finishes the warning logged when the helper is unavailable.
    """

    def __init__(self, source: str, declare: Callable[[ctypes.CDLL], None], *, opt_out: tuple[str, str],
                 purpose: str, flags: Sequence[str] = ("-O2",)) -> None:
        self.source = Path(__file__).with_name(source)
        self.declare, self.opt_out, self.purpose, self.flags = declare, opt_out, purpose, tuple(flags)
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def load(self) -> ctypes.CDLL | None:
        with self._lock:
            if self._tried:
                return self._lib
            self._tried = True
            name, value = self.opt_out
            if os.environ.get(name) == value:
                return None
            source = self.source.read_bytes() + " ".join(self.flags).encode()
            target = cache_dir() / f"sixfold_{self.source.stem.lstrip('_')}_{hashlib.sha1(source).hexdigest()[:12]}.so"
            try:
                if not target.exists():
                    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
                    if compiler is None:
                        raise OSError("no C compiler (cc) on PATH")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
                    subprocess.run([compiler, *self.flags, "-shared", "-fPIC", "-o", str(tmp), str(self.source)],
                                   check=True, capture_output=True, timeout=120)
                    os.replace(tmp, target)
                lib = ctypes.CDLL(str(target))
                self.declare(lib)
                self._lib = lib
            except (OSError, AttributeError, subprocess.SubprocessError) as exc:
                log.warning("%s (C helper %s unavailable: %s)", self.purpose, self.source.name, exc)
            return self._lib
