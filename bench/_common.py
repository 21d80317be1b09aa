"""``bench._common``, kept importable for older scripts and the docs that name it: the code is
``bench.harness``'s (commands, report, bench_server); new code imports from there."""

from __future__ import annotations

from bench.harness.bench_server import serve_until_signalled
from bench.harness.commands import _ENTRY_POINTS, ROOT, command
from bench.harness.report import BENCHMARKS, machine_line, publish, write_section

__all__ = ["BENCHMARKS", "ROOT", "_ENTRY_POINTS", "command", "machine_line", "publish", "serve_until_signalled",
           "write_section"]
