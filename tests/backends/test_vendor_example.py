"""The example vendor package, installed the way a vendor's users would: discovered, conformant, servable."""

from __future__ import annotations

import importlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as tc

from sixfold import models
from sixfold.backends import registry, spec_catalog
from sixfold.backends.spec_catalog import load_spec
from sixfold.backends.conformance import run_conformance
from tests.conftest import ServeProcess, triton_inputs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vendor_backend"
BIN = Path(sys.executable).parent


def _install(source: Path, target: Path) -> None:
    """pip install the package at ``source`` into ``target`` (offline: no deps, no build isolation)."""
    build = target.parent / f"{target.name}-src"
    shutil.copytree(source, build, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-input", "--disable-pip-version-check", "--target", str(target), str(build)],
                   check=True, capture_output=True, text=True, timeout=120)


def _env(path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != registry.BACKENDS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    target = tmp_path_factory.mktemp("vendor") / "site"
    _install(EXAMPLE, target)
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    try:
        yield target
    finally:
        sys.path.remove(str(target))
        sys.modules.pop("numpy_backend", None)
        importlib.invalidate_caches()
        registry.discover(reload=True)
        spec_catalog.catalog(reload=True)


def test_registry_discovers_the_installed_package(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
    infos = registry.discover(reload=True)
    info = infos["numpy-ref"]
    assert info.status == "ok" and info.value == "numpy_backend:NumpyRefBackend"
    assert Path(sys.modules["numpy_backend"].__file__).is_relative_to(installed)
    assert "numpy-ref" in registry.describe()


def test_its_device_specs_resolve_by_name(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The package ships numpy-ref-card (entry point sixfold.device_specs) and finds numpy-ref-local (devices())."""
    monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
    registry.discover(reload=True)
    entries = spec_catalog.catalog(reload=True)
    try:
        card = load_spec("numpy-ref-card")
        assert card.memory_bytes == 2 * 2**30 and card.kind == "card"
        assert entries["numpy-ref-card"].source.startswith("entry point numpy-ref = numpy_backend:SPECS_DIR")
        assert "package sixfold-numpy-backend" in entries["numpy-ref-card"].source
        local = load_spec("numpy-ref-local")
        assert local.memory_bytes > 0 and entries["numpy-ref-local"].source.startswith("backend numpy-ref.devices()")
        assert "numpy-ref-card" in spec_catalog.describe_specs()
    finally:
        spec_catalog.catalog(reload=True)


def test_it_passes_the_kit(installed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
    registry.discover(reload=True)
    report = run_conformance("numpy-ref", models=("rm2",), max_batch=12)
    assert report.passed, [(r.check, r.detail) for r in report.failures]


def test_a_broken_copy_fails_the_kit(tmp_path: Path) -> None:
    source = tmp_path / "broken-src"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    module = source / "numpy_backend" / "__init__.py"
    text = module.read_text()
    good = "return {n: np.asarray(v) for n, v in zip(self.output_names, values)}"
    assert good in text
    module.write_text(text.replace(good, "return {n: np.asarray(v) + np.float32(1e-2) for n, v in "
                                         "zip(self.output_names, values)}"))
    target = tmp_path / "site"
    _install(source, target)
    proc = subprocess.run([sys.executable, "-m", "sixfold.backends.conformance", "numpy-ref", "--models", "rm2",
                           "--max-batch", "4", "--checks", "outputs"],
                          env=_env(target), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "differs from onnxruntime" in proc.stdout


def test_sixfold_serve_runs_it(installed: Path) -> None:
    serve = ServeProcess("--backend", "numpy-ref", "--card-spec", "numpy-ref-card", "--model", "rm2",
                         "--max-rows", "500", "--cards", "2",
                         "--grpc-port", "0", "--metrics-port", "-1", env=_env(installed), cwd=ROOT, timeout=120)
    proc, lines, url = serve.proc, serve.lines, [serve.url]
    try:
        assert serve.url, serve.output
        request = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=500), seed=3).make(5)
        with tc.InferenceServerClient(url[0]) as client:
            scores = client.infer("rm2", triton_inputs(tc, request)).as_numpy("scores")
            assert scores.shape == (5, 1) and ((scores > 0) & (scores < 1)).all()
            config = client.get_model_metadata("rm2", as_json=True)
            assert config["name"] == "rm2"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, "".join(lines)
        assert "2 numpy-ref cards" in " ".join("".join(lines).split())  # rich may wrap the line
    finally:
        serve.kill()


def test_sixfold_serve_defaults_to_the_backends_own_device_and_lists_every_spec(installed: Path) -> None:
    probe = "from sixfold.server.cli import _default_card_spec as d; print(d('numpy-ref'), d('simcard'))"
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(installed), capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["numpy-ref-local", "m2-card"]  # its devices() first; simcard reports none
    listing = subprocess.run([str(Path(sys.executable).parent / "sixfold-serve"), "--list-specs"],
                             env=_env(installed), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert listing.returncode == 0, listing.stderr
    assert "numpy-ref-card" in listing.stdout and "numpy-ref-local" in listing.stdout and "m2-card" in listing.stdout
