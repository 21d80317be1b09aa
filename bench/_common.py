"""What every bench script shares: the machine line and rewriting its own section of BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

__all__ = ["BENCHMARKS", "machine_line", "publish", "write_section"]

BENCHMARKS = Path(__file__).resolve().parents[1] / "BENCHMARKS.md"


def machine_line(*extras: str) -> str:
    """``x86_64, 2 CPUs, <extras>, <date>``: where and when figures were taken (they move between machines)."""
    return ", ".join([platform.machine(), f"{os.cpu_count()} CPUs", *extras, time.strftime("%Y-%m-%d")])


def write_section(section: str, text: str, path: Path = BENCHMARKS) -> None:
    """Replace the ``<!-- bench:SECTION begin/end -->`` block of ``path`` with ``text`` (append it when absent).

    Only the marked block changes, so prose written under it (what the figures say) survives a re-run.
    """
    begin, end = f"<!-- bench:{section} begin -->", f"<!-- bench:{section} end -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = old.rstrip("\n") + "\n\n" + block
    path.write_text(new)


def publish(section: str, text: str, *, write: bool, path: Path = BENCHMARKS) -> None:
    """Print a bench's section and, unless ``--no-write`` (``write=False``), put it into BENCHMARKS.md."""
    print(text)
    if write:
        write_section(section, text, path)
        print(f"wrote the {section} section of {path.name}", file=sys.stderr)
