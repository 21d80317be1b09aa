"""Files derived from a model's tables (fused weights, fp16/int8/int4 rows), kept outside the repository.

Why a cache folder of its own: a model repository may be mounted read-only (docs/deploy.md), and
a file written beside the tables goes stale when a new version is copied over the folder with its
modification times kept (``cp -p``, ``rsync -a``). So derived files live under ``--cache-dir``
(default: ``$SIXFOLD_CACHE_DIR``, else ``$XDG_CACHE_HOME/sixfold``, else ``~/.cache/sixfold``), named
by a key over the *contents* of the tables they come from (the checksums plan.json records, or
computed), never by a modification time: different rows give a different file.

Writes never go through a memory map (a full disk would be SIGBUS): the file is allocated whole
first (``posix_fallocate``), then written with ``os.write`` to a temporary name, synced and renamed
into place, so a reader sees a complete file or none. ENOSPC is an ``OSError`` naming the path and
the bytes. Temporaries left by a crashed process are removed when a cache is opened.

The cache is capped (``--cache-max-bytes``, ``$SIXFOLD_CACHE_MAX_BYTES``; default 4x its largest
entry): before and after a new entry is written, the least recently used entries are removed
until the folder fits, but never one a process maps or holds open (a served model's weights,
found in ``/proc/*/maps`` and ``/proc/*/fd``), the entry just written, nor one used in the last
``RECENT_S`` (a load in progress writes its entries before it maps them all). "Used" is the later
of an entry's access and modification times; an entry seen in use is marked used now.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import os
import re
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from sixfold.backends.processes import process_alive

__all__ = ["CACHE_ENV", "CACHE_MAX_ENV", "FORMAT", "default_cache_dir", "content_key", "source_checksum",
           "write_npy", "remove_stale_temporaries", "prepare_dir", "cache_max_bytes", "evict", "files_in_use"]

log = logging.getLogger(__name__)

CACHE_ENV = "SIXFOLD_CACHE_DIR"
"""Environment variable naming the cache folder (``sixfold-serve --cache-dir`` takes precedence)."""
CACHE_MAX_ENV = "SIXFOLD_CACHE_MAX_BYTES"
"""Environment variable capping the cache's bytes (``sixfold-serve --cache-max-bytes`` sets it); 0: no cap."""
DEFAULT_CAP_ENTRIES = 4
"""With no cap given, the cache keeps this many times its largest entry (room for a few versions' tables)."""
RECENT_S = 600.0
"""Entries used this recently are never evicted: a model still loading may have written them and not mapped them yet."""
FORMAT = 1
"""Part of every key: raise it when the layout of a derived file changes, and old files are never read."""
_TMP = re.compile(r"^\..+\.tmp(\d+)$")
_CHUNK = 8 << 20
_NO_ALLOCATE = {errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}
"""posix_fallocate errors that only mean the file system cannot pre-allocate: then the writes find out."""


def default_cache_dir() -> Path:
    """``$SIXFOLD_CACHE_DIR``, else ``$XDG_CACHE_HOME/sixfold``, else ``~/.cache/sixfold``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "sixfold"


def source_checksum(path: str | Path) -> str:
    """``crc32:<hex>:<bytes>`` of a table file: the same form plan.json records (``tables.checksums``)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return f"crc32:{crc:08x}:{size}"


def content_key(kind: str, sources: Sequence[tuple[str, str]], **params: object) -> str:
    """A hex SHA-256 over what a derived file is (``kind``, ``params``) and its sources' (name, checksum)."""
    digest = hashlib.sha256(f"sixfold-derived/{FORMAT}/{kind}\n".encode())
    for name in sorted(params):
        digest.update(f"{name}={params[name]!r}\n".encode())
    for name, checksum in sources:
        digest.update(f"source {name}={checksum}\n".encode())
    return digest.hexdigest()


def prepare_dir(folder: Path) -> None:
    """Create ``folder`` and remove stale temporaries in it; OSError (naming it) when it cannot be written."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot create cache folder {str(folder)!r}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OSError(errno.EACCES, f"cache folder {str(folder)!r} is not writable")
    remove_stale_temporaries(folder)
    _CACHE_FOLDERS.add(folder.resolve())
    evict(folder)


_CACHE_FOLDERS: set[Path] = set()
"""Folders ``prepare_dir`` opened: a file ``write_npy`` puts in one is a cache entry, and the cap is kept after it."""


def cache_max_bytes() -> int | None:
    """The cap from ``$SIXFOLD_CACHE_MAX_BYTES`` (bytes; 0: no cap), or None (the default: 4x the largest entry)."""
    text = os.environ.get(CACHE_MAX_ENV, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${CACHE_MAX_ENV}={text!r}: give the cache's cap in bytes (0: no cap)") from None
    if value < 0:
        raise ValueError(f"${CACHE_MAX_ENV}={text!r}: the cap must be >= 0 bytes")
    return value


def files_in_use(paths: Iterable[Path]) -> set[Path]:
    """Those of ``paths`` some process maps or holds open (``/proc/*/maps``, ``/proc/*/fd``; processes this user
    cannot inspect are not seen)."""
    wanted: dict[tuple[int, int], Path] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        wanted[(st.st_dev, st.st_ino)] = p
    found: set[Path] = set()
    if not wanted:
        return found
    devices = {(os.major(dev), os.minor(dev)): dev for dev, _ in wanted}
    try:
        pids = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) < 6 or fields[4] == "0":
                        continue
                    major, _, minor = fields[3].partition(":")
                    dev = devices.get((int(major, 16), int(minor, 16)))
                    if dev is not None and (dev, int(fields[4])) in wanted:
                        found.add(wanted[(dev, int(fields[4]))])
        except (OSError, ValueError):
            pass
        try:
            fds = os.scandir(f"/proc/{pid}/fd")
        except OSError:
            continue
        with fds:
            for fd in fds:
                try:
                    st = os.stat(fd.path)
                except OSError:
                    continue
                key = (st.st_dev, st.st_ino)
                if key in wanted:
                    found.add(wanted[key])
        if len(found) == len(wanted):
            break
    return found


def evict(folder: Path, max_bytes: int | None = None, keep: Iterable[Path] = ()) -> list[Path]:
    """Remove least recently used entries (``*.npy``) of cache ``folder`` until it holds at most ``max_bytes``
    (None: ``cache_max_bytes()``, else 4x its largest entry; 0: no cap); never one in use or in ``keep``.

    Returns the entries removed. A folder that cannot be made to fit (its entries in use are larger)
    is left over the cap, with a warning."""
    cap = cache_max_bytes() if max_bytes is None else max_bytes
    entries: list[tuple[float, int, Path]] = []
    try:
        listing = list(os.scandir(folder))
    except OSError:
        return []
    for e in listing:
        if not e.name.endswith(".npy") or _TMP.match(e.name):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if e.is_file(follow_symlinks=False):
            entries.append((max(st.st_atime, st.st_mtime), st.st_size, Path(e.path)))
    if not entries:
        return []
    if cap is None:
        cap = DEFAULT_CAP_ENTRIES * max(size for _, size, _ in entries)
    total = sum(size for _, size, _ in entries)
    if not cap or total <= cap:
        return []
    protected = {Path(p) for p in keep}
    busy = files_in_use(path for _, _, path in entries)
    now = time.time()
    for path in busy:  # in use is used: it ranks as recent once its model lets it go
        try:
            os.utime(path, (now, path.stat().st_mtime))
        except OSError:
            pass
    removed: list[Path] = []
    for used, size, path in sorted(entries):
        if total <= cap:
            break
        if path in busy or path in protected or now - used < RECENT_S:
            continue
        try:
            path.unlink()
        except OSError as exc:
            log.warning("cache %s: could not remove %s to keep it under %d bytes: %s", folder, path.name, cap, exc)
            continue
        total -= size
        removed.append(path)
        log.info("cache %s: removed %s (%d bytes, least recently used) to keep it under %d bytes", folder,
                 path.name, size, cap)
    if total > cap:
        log.warning("cache %s holds %d bytes, over its cap of %d: the rest is in use or used in the last %g s "
                    "(--cache-max-bytes)", folder, total, cap, RECENT_S)
    return removed


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove ``.NAME.tmpPID`` entries of processes that no longer run (a crash's leftovers); returns them."""
    import shutil

    removed = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP.match(entry.name)
        if not m or process_alive(int(m.group(1))):
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry)
        except OSError:
            continue
    if removed:
        log.info("removed %d temporaries left by stopped processes in %s", len(removed), folder)
    return removed


def write_npy(path: Path, dtype: np.dtype | type, shape: tuple[int, ...], chunks: Iterable[np.ndarray]) -> None:
    """Write a C-ordered ``.npy`` of ``shape`` from ``chunks`` (rows in order), allocated before written.

    The file appears at ``path`` complete or not at all. A full disk or quota is an OSError naming
    ``path`` and the bytes needed (the temporary is removed); no memory map is involved.
    """
    dtype = np.dtype(dtype)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(dtype),
                                                  "fortran_order": False, "shape": tuple(int(s) for s in shape)})
    total = header.tell() + int(np.prod(shape)) * dtype.itemsize
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    written = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as exc:
            if exc.errno not in _NO_ALLOCATE:
                raise _space_error(exc, path, total, 0) from None
        try:
            written += _write_all(fd, header.getvalue())
            for chunk in chunks:
                chunk = np.ascontiguousarray(chunk, dtype)
                written += _write_all(fd, memoryview(chunk).cast("B"))
            if written != total:
                raise ValueError(f"{path}: {written} bytes of rows given, {total} expected")
            os.fsync(fd)
        except OSError as exc:
            raise _space_error(exc, path, total, written) from None
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if _CACHE_FOLDERS and path.parent.resolve() in _CACHE_FOLDERS:
        evict(path.parent, keep=[path])


def _write_all(fd: int, data: bytes | memoryview) -> int:
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])
    return done


def _space_error(exc: OSError, path: Path, total: int, written: int) -> OSError:
    """``exc`` again, its message naming the file and the bytes (ENOSPC's own says neither)."""
    reason = exc.strerror or str(exc)
    return OSError(exc.errno, f"writing {str(path)!r}: {reason} ({total} bytes needed, {written} written, "
                              f"{_free(path.parent)} free on its file system)")


def _free(folder: Path) -> str:
    try:
        st = os.statvfs(folder)
    except OSError:
        return "unknown bytes"
    return f"{st.f_bavail * st.f_frsize} bytes"
