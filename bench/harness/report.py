"""What a bench leaves behind: its own section of BENCHMARKS.md, markdown table rows, a JSON file.

Every bench rewrites only its marked section, so prose written under it survives a re-run, and
the figures name the machine and date they came from (they move between machines).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness.commands import ROOT

__all__ = ["BENCHMARKS", "machine_line", "md_row", "md_rule", "publish", "write_json", "write_section"]

BENCHMARKS = ROOT / "BENCHMARKS.md"


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


def write_json(path: str | Path, data: Any) -> None:
    """Every figure of a run (``--json PATH``), indented, non-JSON values (paths, numpy scalars) as text."""
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def md_row(*cells: object) -> str:
    """One markdown table row: ``| a | b |`` (an empty cell stays ``|  |``)."""
    return "| " + " | ".join(map(str, cells)) + " |"


def md_rule(columns: int) -> str:
    """The line under a markdown table's header: ``|---|---|``."""
    return "|" + "---|" * columns
