"""How a bench starts one of the project's commands in a child process, installed or not.

A lent machine may run the benches from a bare checkout; a ``--baseline-tree`` run puts another
source tree first on PYTHONPATH. Both need the command started the same way everywhere.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["ROOT", "command"]

ROOT = Path(__file__).resolve().parents[2]
# NOTE: pyproject's [project.scripts] (tests/bench/test_common.py keeps the two equal)
_ENTRY_POINTS = {"sixfold-serve": "sixfold.server.cli", "sixfold-partition": "sixfold.partitioner.cli",
                 "sixfold-loadgen": "sixfold.loadgen.cli", "sixfold-simulate": "sixfold.simulate.cli",
                 "sixfold-delta": "sixfold.server.deltas.cli"}
# A tree from before the one import name (no sixfold/ folder) names its entry points bare.
_BARE_ENTRY_POINTS = {"sixfold-serve": "server.cli", "sixfold-partition": "partitioner.cli",
                      "sixfold-loadgen": "loadgen.cli", "sixfold-simulate": "simulate.cli",
                      "sixfold-delta": "server.delta_cli"}


def command(script: str, bin_dir: Path | None = None, tree: str | Path | None = None) -> list[str]:
    """How to start one of the project's commands (``sixfold-serve``, ...) in a child process.

    The console script beside this interpreter where the project is installed; else this interpreter
    running the same entry point from this checkout (a lent machine with no install). The current
    directory is dropped from ``sys.path`` and the checkout appended: a tree put first on PYTHONPATH
    (``--baseline-tree``) still wins.

    ``tree``: run that source tree's code (put first on sys.path here, whatever is installed), by its
    own entry point: ``sixfold.server.cli`` in a tree with ``sixfold/``, ``server.cli`` in one from
    before the one import name (an installed script would serve this checkout's code instead).
    """
    if tree is not None:
        tree = Path(tree).resolve()
        module = _ENTRY_POINTS[script] if (tree / "sixfold" / "__init__.py").exists() else _BARE_ENTRY_POINTS[script]
        return [sys.executable, "-c",
                f"import sys; sys.path[:] = [{str(tree)!r}] + [p for p in sys.path if p]; "
                f"sys.argv[0] = {script!r}; from {module} import main; sys.exit(main())"]
    installed = (Path(sys.executable).parent if bin_dir is None else bin_dir) / script
    if installed.exists():
        return [str(installed)]
    module = _ENTRY_POINTS[script]
    return [sys.executable, "-c",
            f"import sys; sys.path[:] = [p for p in sys.path if p]; sys.path.append({str(ROOT)!r}); "
            f"sys.argv[0] = {script!r}; from {module} import main; sys.exit(main())"]
