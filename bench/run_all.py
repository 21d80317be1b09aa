"""Run every benchmark in bench/ (``make bench``), one process each, each under a time limit.

Every bench script is a ``bench/*.py`` file other than this one; each writes its own
section of BENCHMARKS.md. Extra arguments are passed to every bench (e.g. ``--quick --no-write``).

    .venv/bin/python bench/run_all.py [--limit SECONDS] [bench args...]
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIMIT_S = 240  # per bench; each is designed to finish in about 2 minutes on 2 cores


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    limit = LIMIT_S
    if args[:1] == ["--limit"]:
        limit, args = int(args[1]), args[2:]
    benches = sorted(p for p in HERE.glob("*.py") if p.name != "run_all.py" and not p.name.startswith("_"))
    failed = []
    for bench in benches:
        t0 = time.perf_counter()
        print(f"== {bench.name}", flush=True)
        try:
            rc = subprocess.run([sys.executable, str(bench), *args], cwd=HERE.parent, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        print(f"== {bench.name}: {'ok' if rc == 0 else f'FAILED ({rc})'} in {time.perf_counter() - t0:.0f} s",
              flush=True)
        if rc != 0:
            failed.append(bench.name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
