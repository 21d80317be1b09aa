"""Write a model version folder whole or not at all: into a temporary sibling, renamed into place.

Why: a failure half-way (a full disk, a kill) used to leave a version folder with some tables and
an old or missing plan.json, which a later load refused with a misleading checksum message. Now
everything goes to ``.NAME.tmpPID`` beside the folder and one rename publishes it; a failure
removes the temporary, and temporaries of processes that no longer run are removed before the
next write into the same parent. Disk errors name the folder and keep the file and byte counts
of the write that failed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sixfold.backends.host.derived_cache import remove_stale_temporaries

__all__ = ["staged", "publish", "carry_over"]


@contextmanager
def staged(out: str | Path) -> Iterator[Path]:
    """A fresh temporary folder to write ``out``'s contents into; renamed to ``out`` when the block succeeds."""
    out = Path(out)
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(parent)
    tmp = parent / f".{out.name}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        publish(tmp, out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        where = f" ({exc.filename})" if exc.filename else ""
        raise OSError(exc.errno, f"{out}: not written, nothing half-built left: {exc.strerror or exc}{where}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish(tmp: Path, out: Path) -> None:
    """Put folder ``tmp`` at ``out``: one rename when ``out`` is missing or empty, else the old one moved aside first."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise OSError(20, f"{out}: not a folder; give a folder path")  # ENOTDIR
    if out.is_dir():
        try:
            out.rmdir()  # empty: replaced by one rename
        except OSError:
            old = out.parent / f".{out.name}.old.tmp{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
            return
    os.rename(tmp, out)


def carry_over(old: Path, new: Path, *, skip: Callable[[Path], bool], copy: Callable[[Path], bool]) -> int:
    """Put ``old``'s files into ``new`` (a staged folder) as hard links, so a version is rewritten in part without
    copying what stays; ``skip(relative)``: left out (it is written anew); ``copy(relative)``: a real copy (a file
    the writer changes in place, which a link would change in ``old`` too). Returns the files carried over."""
    if not old.is_dir():
        return 0
    carried = 0
    for entry in sorted(old.rglob("*")):
        relative = entry.relative_to(old)
        target = new / relative
        if skip(relative):
            continue
        if entry.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(entry), target)
        elif entry.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            if copy(relative):
                shutil.copy2(entry, target)
            else:
                try:
                    os.link(entry, target)
                except OSError:  # another file system, or links not allowed: a copy
                    shutil.copy2(entry, target)
        carried += 1
    return carried

