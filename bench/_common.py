"""What every bench script shares: the machine line and rewriting its own section of BENCHMARKS.md."""

from __future__ import annotations

import asyncio
import os
import platform
import signal
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["BENCHMARKS", "command", "machine_line", "publish", "serve_until_signalled", "write_section"]

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"
# NOTE: pyproject's [project.scripts] (tests/bench/test_common.py keeps the two equal)
_ENTRY_POINTS = {"sixfold-serve": "sixfold.server.cli", "sixfold-partition": "sixfold.partitioner.cli",
                 "sixfold-loadgen": "sixfold.loadgen.cli", "sixfold-simulate": "sixfold.simulate.cli",
                 "sixfold-delta": "sixfold.server.deltas.cli"}


def command(script: str, bin_dir: Path | None = None) -> list[str]:
    """How to start one of the project's commands (``sixfold-serve``, ...) in a child process.

    The console script beside this interpreter where the project is installed; else this interpreter
    running the same entry point from this checkout (a lent machine with no install). The current
    directory is dropped from ``sys.path`` and the checkout appended: a tree put first on PYTHONPATH
    (``--baseline-tree``) still wins.
    """
    installed = (Path(sys.executable).parent if bin_dir is None else bin_dir) / script
    if installed.exists():
        return [str(installed)]
    module = _ENTRY_POINTS[script]
    return [sys.executable, "-c",
            f"import sys; sys.path[:] = [p for p in sys.path if p]; sys.path.append({str(ROOT)!r}); "
            f"sys.argv[0] = {script!r}; from {module} import main; sys.exit(main())"]


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


async def serve_until_signalled(server: Any, address: str) -> None:
    """Start a bench's grpc.aio ``server``, print sixfold-serve's READY line for ``address`` (what
    ``sixfold.server.workers.process.ReadyProcess`` waits for), and serve until SIGINT or SIGTERM."""
    from sixfold.server.workers.process import READY_PREFIX

    await server.start()
    print(f"{READY_PREFIX}{address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)
