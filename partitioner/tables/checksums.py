"""Table file checksums: recorded in plan.json at partition time, checked at load.

``plan.tables["checksums"]`` maps each file under ``tables/`` to ``"crc32:<hex>:<bytes>"``.
Both sides stream the file in 8 MiB chunks (a 25 GB table set needs no 25 GB buffer) and
drop the pages they read from the page cache (``POSIX_FADV_DONTNEED``), so checking a
table larger than memory does not push the served rows out. A missing, truncated or
corrupted file fails the load naming the file, never a wrong score.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path

__all__ = ["file_checksum", "table_checksums", "verify_tables", "ChecksumError"]

_CHUNK = 8 << 20


class ChecksumError(ValueError):
    """A table file is missing, of the wrong size, or its contents differ from plan.json's checksum."""


def file_checksum(path: str | Path) -> str:
    """``crc32:<8 hex digits>:<size in bytes>`` of ``path``, read in chunks."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            try:
                os.posix_fadvise(fd, size, len(chunk), os.POSIX_FADV_DONTNEED)
            except (OSError, AttributeError):
                pass
            size += len(chunk)
    return f"crc32:{crc:08x}:{size}"


def table_checksums(directory: str | Path) -> dict[str, str]:
    """Checksums of the ``table_NNN.npy`` files in ``directory`` and its precision folders (paths relative to it)."""
    directory = Path(directory)
    return {p.relative_to(directory).as_posix(): file_checksum(p) for p in sorted(directory.glob("**/table_*.npy"))}


def verify_tables(directory: str | Path, checksums: Mapping[str, str]) -> None:
    """Check every file named in ``checksums``; ChecksumError naming the first bad file."""
    directory = Path(directory)
    for name, expected in sorted(checksums.items()):
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ChecksumError(f"table file {str(path)!r} is missing (plan.json lists it)") from None
        want_size = int(expected.rsplit(":", 1)[1])
        if size != want_size:
            raise ChecksumError(f"table file {str(path)!r} has {size} bytes; plan.json recorded {want_size} "
                                f"({'truncated' if size < want_size else 'grown'})")
        got = file_checksum(path)
        if got != expected:
            raise ChecksumError(f"table file {str(path)!r} is corrupted: checksum {got.split(':')[1]}, "
                                f"plan.json recorded {expected.split(':')[1]}")
