"""The distribution as a user installs it: one import name, ``sixfold``, and a tree with no import cycle.

The wheel is built from the tracked files only (what a fresh clone holds), installed into a
folder of its own, and run from a folder that is not the checkout: what serves there came from
the wheel, not from the repository's root folders.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc

from sixfold import models
from sixfold.server.workers.process import ReadyProcess
from tests.conftest import free_port, triton_inputs

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("models", "backends", "partitioner", "server", "loadgen", "simulate")
"""The root folders that are sub-packages of ``sixfold`` (setup.py maps them)."""


def _tracked_copy(dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pip wheel --no-deps`` of a copy of the tracked tree (no build isolation: no download)."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the wheel is built from its tracked files)")
    tree = _tracked_copy(tmp_path_factory.mktemp("tree"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(tree)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (found,) = out.glob("sixfold-*.whl")
    return found


def test_the_wheel_holds_sixfold_and_its_dist_info_only(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"sixfold"}, sorted(tops)
    for package in PACKAGES:
        assert f"sixfold/{package}/__init__.py" in names
    # data files the code opens beside itself
    for data in ("sixfold/backends/specs/m2-card.json", "sixfold/backends/host/_pread.c",
                 "sixfold/backends/host/_bag_order.c", "sixfold/backends/conformance/dense_ops.json"):
        assert data in names, data
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    targets = [line.split("=", 1)[1].strip() for line in entry_points.splitlines() if "=" in line]
    assert targets and all(t.startswith("sixfold.") for t in targets), targets


def test_the_installed_wheel_serves_from_any_folder_and_has_no_bare_names(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = ("import importlib.util, sixfold.server\n"
             f"bare = [n for n in {PACKAGES!r} if importlib.util.find_spec(n) is not None]\n"
             "print(sixfold.server.__file__); print(bare)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    where, bare = done.stdout.splitlines()
    assert Path(where).is_relative_to(target), where
    assert bare == "[]", f"top-level names other than sixfold are importable: {bare}"

    serve = ReadyProcess([str(target / "bin" / "sixfold-serve"), "--model", "tiny", "--grpc-port", "0",
                          "--http-port", "0", "--metrics-port", str(free_port()), "--drain-seconds", "0"],
                         env=env, cwd=elsewhere, timeout_s=180)
    try:
        assert serve.url, serve.output
        request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=3).make(4)
        with tc.InferenceServerClient(serve.url) as client:
            scores = client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores")
        assert scores.shape == (4, 1) and np.isfinite(scores).all()
    finally:
        serve.stop()


def _modules() -> dict[str, Path]:
    mods = {}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            parts = [folder, *path.relative_to(ROOT / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods["sixfold." + ".".join(parts)] = path
    return mods


def _imports(path: Path) -> list[tuple[int, str, int]]:
    """(line, imported name, relative level) of every import outside ``if TYPE_CHECKING:`` blocks;
    ``from X import a`` gives ``X.a`` (a module or a name in X)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in node.body for n in ast.walk(sub)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            found += [(node.lineno, f"{base}.{alias.name}" if base else alias.name, node.level)
                      for alias in node.names]
    return found


def test_code_imports_its_own_modules_as_sixfold_only() -> None:
    bare = []
    for path in [*_modules().values(), *(ROOT / "bench").rglob("*.py"), *(ROOT / "tests").rglob("*.py"),
                 *(ROOT / "scripts").glob("*.py"), *(ROOT / "examples").rglob("*.py")]:
        for line, name, level in _imports(path):
            if level == 0 and name.split(".")[0] in PACKAGES:
                bare.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not bare, "bare top-level imports (say sixfold.<package>):\n" + "\n".join(bare)


def test_no_import_cycle_between_files() -> None:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for _, name, level in _imports(path):
            if level:
                base = package.split(".")
                name = ".".join(base[:len(base) - level + 1] + ([name] if name else []))
            while name and name not in mods:
                name = name.rpartition(".")[0]
            # a package's __init__ re-exporting its own children is not a cycle of design
            if name and name != mod and not name.startswith(mod + "."):
                graph[mod].add(name)
    # Tarjan's strongly connected components, iteratively
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        cycles.append(" <-> ".join(sorted(component)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


ALLOWED = {
    "models": set(),
    "backends": set(),
    "partitioner": {"backends", "models"},
    "loadgen": {"models"},
    "server": {"partitioner", "backends", "models", "loadgen"},
    "simulate": {"server", "partitioner", "backends", "models", "loadgen"},
}
"""Which packages each may import (docs/architecture.md, "Layers"): dependencies point down."""
SERVER_TO_LOADGEN = {"sixfold.server.model.warm"}
"""The one place the server reads loadgen's recording format (``--warm-from``)."""


def test_packages_depend_downward_only() -> None:
    wrong = []
    for mod, path in _modules().items():
        package = mod.split(".")[1]
        for line, name, _level in _imports(path):
            parts = name.split(".")
            if parts[0] != "sixfold" or len(parts) < 2 or parts[1] not in ALLOWED or parts[1] == package:
                continue
            if parts[1] not in ALLOWED[package]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {package} imports {name}")
            elif package == "server" and parts[1] == "loadgen" and mod not in SERVER_TO_LOADGEN:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: the server reads loadgen only in {SERVER_TO_LOADGEN}")
    assert not wrong, "imports pointing up or sideways:\n" + "\n".join(wrong)


SERVER_ORDER = ["cli", "frontend", "app", "transport", "loading", "core", "deltas", "model", "execution", "scheduling",
                "protocol", "workers", "observability", "memory", "errors"]
"""server/'s parts from the top down (server/__init__.py); each imports only parts after it."""


def test_server_subpackages_import_downward() -> None:
    parts = {p.name.removesuffix(".py") for p in (ROOT / "server").iterdir()
             if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert parts == set(SERVER_ORDER), f"update SERVER_ORDER and server/__init__.py: {sorted(parts ^ set(SERVER_ORDER))}"
    wrong = []
    for mod, path in _modules().items():
        if not mod.startswith("sixfold.server."):
            continue
        mine = mod.split(".")[2]
        for line, name, _level in _imports(path):
            parts = name.split(".")
            if parts[:2] == ["sixfold", "server"] and len(parts) > 2 and parts[2] != mine:
                if SERVER_ORDER.index(parts[2]) < SERVER_ORDER.index(mine):
                    wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {name}, above it")
    assert not wrong, "server/ imports pointing up:\n" + "\n".join(wrong)
