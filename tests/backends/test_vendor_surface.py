"""The vendor surface: ``sixfold.backends``' ``__all__``, the Backend API version, and plug-ins of another
major refused by the registry (with the reason ``sixfold-serve --list-backends`` shows)."""

from __future__ import annotations

import ast
import logging
import re
import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import sixfold.backends
from sixfold.backends import api, registry
from sixfold.backends.registry import BackendNotFound, discover, discover_from, get_backend
from tests.backends.test_vendor_example import EXAMPLE, _env, _install

ROOT = Path(__file__).resolve().parents[2]
VENDOR_PAGES = (ROOT / "docs" / "vendor.md", ROOT / "docs" / "backends.md")
FROM_SURFACE = re.compile(r"^from sixfold\.backends import (\(.*?\)|[^\n]+)$", re.S | re.M)


def ep(name: str, cls: str) -> EntryPoint:
    return EntryPoint(name=name, value=f"tests.backends.dummy_plugins:{cls}", group=registry.ENTRY_POINT_GROUP)


def surface_names(import_list: str) -> set[str]:
    return {n.strip() for n in import_list.strip("()").split(",") if n.strip()}


# --- __all__ and the version ---------------------------------------------------------------------------------

def test_every_name_in_all_resolves_once():
    names = sixfold.backends.__all__
    assert len(names) == len(set(names)), "a name is listed twice in sixfold.backends.__all__"
    missing = [n for n in names if not hasattr(sixfold.backends, n)]
    assert not missing, f"sixfold.backends.__all__ names what it does not define: {missing}"
    namespace: dict = {}
    exec("from sixfold.backends import *", namespace)
    assert set(names) <= set(namespace)


def test_all_holds_what_a_vendor_needs():
    vendor = {"BACKEND_API_VERSION", "Backend", "Executable", "PartitionArtifact", "DeviceSpec", "load_spec",
              "BackendError", "DoesNotFit", "check_fits", "format_bytes", "reject_unknown", "int_option",
              "bool_option", "get_backend", "discover", "describe", "BackendNotFound", "ENTRY_POINT_GROUP",
              "SPECS_GROUP", "OnnxRuntimeBackend", "SimCardBackend", "TorchBackend"}
    assert vendor <= set(sixfold.backends.__all__), vendor - set(sixfold.backends.__all__)
    assert sixfold.backends.Backend is api.Backend and sixfold.backends.check_fits.__module__ == "sixfold.backends.memory"


def test_the_version_is_major_dot_minor_and_the_default_a_backend_declares():
    version = sixfold.backends.BACKEND_API_VERSION
    assert version is api.BACKEND_API_VERSION
    assert re.fullmatch(r"\d+\.\d+", version)
    assert sixfold.backends.parse_api_version(version) == tuple(int(p) for p in version.split("."))
    assert sixfold.backends.Backend.api_version == version
    assert sixfold.backends.OnnxRuntimeBackend.api_version == version
    for bad in ("1", "1.0.2", "one.zero", "", 1, None, "1.x"):
        with pytest.raises(ValueError, match="MAJOR.MINOR"):
            sixfold.backends.parse_api_version(bad)


# --- the registry's check ------------------------------------------------------------------------------------

@pytest.fixture
def other_major(fresh_registry, monkeypatch):
    """The real entry points plus one written against the next major, as if such a package were installed."""
    real = list(registry.entry_points(group=registry.ENTRY_POINT_GROUP))
    monkeypatch.setattr(registry, "entry_points", lambda group: [*real, ep("from-next-major", "FromNextMajor")])
    monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
    discover(reload=True)


def test_a_plugin_of_another_major_is_failed_with_both_versions(caplog):
    with caplog.at_level(logging.ERROR, logger="sixfold.backends.registry"):
        info = discover_from([ep("from-next-major", "FromNextMajor")])["from-next-major"]
    assert (info.status, info.cls) == ("failed", None)
    assert info.reason == ("tests.backends.dummy_plugins:FromNextMajor: written against Backend API 2.0, "
                           f"but this sixfold provides Backend API {api.BACKEND_API_VERSION} "
                           "(major versions must match: update sixfold)")
    assert "from-next-major" in caplog.text and "Backend API 2.0" in caplog.text


def test_get_backend_and_describe_give_the_reason(other_major):
    with pytest.raises(BackendNotFound, match=r"backend 'from-next-major' is failed: .*written against Backend API 2\.0"):
        get_backend("from-next-major")
    lines = registry.describe().splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("from-next-major "))
    assert lines[row].split()[1:3] == ["failed", "-"]
    assert "written against Backend API 2.0, but this sixfold provides Backend API 1." in lines[row + 1]
    assert lines[-2] == f"Backend API {api.BACKEND_API_VERSION}: a plug-in declaring another major version is refused"
    assert discover()["onnxruntime"].status == "ok"  # the others are untouched


def test_a_newer_minor_loads_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="sixfold.backends.registry"):
        info = discover_from([ep("from-newer-minor", "FromNewerMinor")])["from-newer-minor"]
    assert (info.status, info.reason) == ("ok", "")
    assert "Backend API 1.99, newer than this sixfold's" in caplog.text


def test_a_malformed_version_is_failed():
    info = discover_from([ep("malformed-version", "MalformedVersion")])["malformed-version"]
    assert info.status == "failed"
    assert 'api_version must be a "MAJOR.MINOR" string' in info.reason and "got 1" in info.reason


def test_an_installed_package_of_another_major_is_refused_by_the_cli(tmp_path):
    """The example package, its api_version changed to 2.0, pip-installed: --list-backends and the kit say why."""
    source = tmp_path / "next-major-src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    module = source / "numpy_backend" / "__init__.py"
    text = module.read_text()
    declared = f'    api_version = "{api.BACKEND_API_VERSION}"'
    assert declared in text, "the example no longer declares the current api_version"
    module.write_text(text.replace(declared, '    api_version = "2.0"'))
    target = tmp_path / "site"
    _install(source, target)
    listing = subprocess.run([str(Path(sys.executable).parent / "sixfold-serve"), "--list-backends"],
                             env=_env(target), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("numpy-ref "))
    assert lines[row].split()[1] == "failed"
    assert lines[row + 1].strip() == ("numpy_backend:NumpyRefBackend: written against Backend API 2.0, but this "
                                      f"sixfold provides Backend API {api.BACKEND_API_VERSION} "
                                      "(major versions must match: update sixfold)")
    kit = subprocess.run([sys.executable, "-m", "sixfold.backends.conformance", "numpy-ref", "--models", "rm2",
                          "--max-batch", "2", "--checks", "load"],
                         env=_env(target), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert kit.returncode == 2, kit.stdout + kit.stderr
    assert "written against Backend API 2.0" in kit.stderr


# --- the example and the pages use the surface only ----------------------------------------------------------

def test_the_example_imports_only_the_surface_and_declares_its_version():
    module = EXAMPLE / "numpy_backend" / "__init__.py"
    tree = ast.parse(module.read_text())
    sixfold_imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                       and any(m.startswith("sixfold") for m in
                               ([n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]))]
    assert sixfold_imports, "the example imports nothing from sixfold?"
    for node in sixfold_imports:
        assert isinstance(node, ast.ImportFrom) and node.module == "sixfold.backends", ast.unparse(node)
        names = {a.name for a in node.names}
        assert names <= set(sixfold.backends.__all__), names - set(sixfold.backends.__all__)
    before = sys.modules.pop("numpy_backend", None)
    sys.path.insert(0, str(EXAMPLE))
    try:
        from numpy_backend import NumpyRefBackend
    finally:
        sys.path.remove(str(EXAMPLE))
        sys.modules.pop("numpy_backend", None)
        if before is not None:
            sys.modules["numpy_backend"] = before
    assert "api_version" in vars(NumpyRefBackend), "the example must declare its api_version, not inherit it"
    assert api.api_version_problem(NumpyRefBackend.api_version) == ""


@pytest.mark.parametrize("page", VENDOR_PAGES, ids=lambda p: p.name)
def test_the_pages_import_only_names_in_all(page: Path):
    text = page.read_text()
    assert not re.search(r"^\s*(from|import) backends\b", text, re.M), f"{page.name} imports the old top-level name"
    imports = FROM_SURFACE.findall(text)
    assert imports, f"{page.name} shows no `from sixfold.backends import ...`"
    for import_list in imports:
        names = surface_names(import_list)
        assert names <= set(sixfold.backends.__all__), (page.name, names - set(sixfold.backends.__all__))
    assert "BACKEND_API_VERSION" in text and "api_version" in text
