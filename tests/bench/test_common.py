"""bench/harness/commands.py (``bench._common`` before): starting the project's commands with or without an install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.commands import command

ROOT = Path(__file__).resolve().parents[2]


def test_an_installed_command_is_its_console_script(tmp_path: Path) -> None:
    script = tmp_path / "sixfold-serve"  # what `pip install` puts beside the interpreter
    script.write_text("#!/bin/sh\n")
    assert command("sixfold-serve", bin_dir=tmp_path) == [str(script)]
    assert command("sixfold-loadgen", bin_dir=tmp_path)[:2] == [sys.executable, "-c"]  # not installed there


def test_the_entry_points_are_pyproject_s_scripts() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from bench.harness.commands import _ENTRY_POINTS

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {name: f"{module}:main" for name, module in _ENTRY_POINTS.items()} == scripts


def test_without_an_install_the_command_runs_from_the_checkout(tmp_path: Path) -> None:
    argv = command("sixfold-serve", bin_dir=tmp_path)  # no console script there: a lent machine with no install
    assert argv[0] == sys.executable and "sixfold.server.cli" in argv[-1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([*argv, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: sixfold-serve"), done.stdout[:200]


def test_a_tree_first_on_pythonpath_wins_over_the_checkout(tmp_path: Path) -> None:
    """``--baseline-tree``: the other tree's code serves, not this checkout's. The tree is laid out as this
    checkout (``sixfold/__init__.py`` maps the root folders in), as ``git archive`` of a commit gives it."""
    (tmp_path / "tree" / "sixfold").mkdir(parents=True)
    shutil.copy(ROOT / "sixfold" / "__init__.py", tmp_path / "tree" / "sixfold" / "__init__.py")
    fake = tmp_path / "tree" / "server"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "cli.py").write_text("def main():\n    print('the other tree')\n    return 0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "tree")}
    done = subprocess.run(command("sixfold-serve", bin_dir=tmp_path), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "the other tree"


def test_bench_common_still_names_the_harness() -> None:
    """``bench._common`` (named by the docs and older scripts) is the harness's code, not a copy."""
    import bench._common as common
    from bench.harness import bench_server, commands, report

    assert common.command is commands.command and common.publish is report.publish
    assert common.serve_until_signalled is bench_server.serve_until_signalled


@pytest.mark.parametrize("layout", ["sixfold", "bare"])
def test_a_baseline_tree_serves_its_own_code_whatever_is_installed(tmp_path: Path, layout: str) -> None:
    """``--baseline-tree`` of a commit from before the one import name has no ``sixfold/`` and names its
    entry point ``server.cli``; the installed ``sixfold-serve`` would run this checkout instead."""
    tree = tmp_path / "tree"
    if layout == "sixfold":
        (tree / "sixfold").mkdir(parents=True)
        shutil.copy(ROOT / "sixfold" / "__init__.py", tree / "sixfold" / "__init__.py")
    (tree / "server").mkdir(parents=True)
    (tree / "server" / "__init__.py").write_text("")
    (tree / "server" / "cli.py").write_text(f"def main():\n    print('the {layout} tree')\n    return 0\n")
    installed = tmp_path / "bin" / "sixfold-serve"
    installed.parent.mkdir()
    installed.write_text("#!/bin/sh\necho this checkout\n")
    argv = command("sixfold-serve", bin_dir=installed.parent, tree=tree)
    assert argv[0] == sys.executable
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"the {layout} tree"
