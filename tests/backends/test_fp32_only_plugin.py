"""A vendor's fp32-only card as a real pip-installed package: it passes the kit, declining fp16 and int8, and serves.

The package is written here (pyproject + entry point in ``sixfold.backends``), built and installed by pip into
a temporary target, and used only through subprocesses that find it on PYTHONPATH, as a vendor's user would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as tc

from sixfold import models
from tests.backends.test_vendor_example import _env, _install
from tests.conftest import ServeProcess, triton_inputs

ROOT = Path(__file__).resolve().parents[2]
NAME = "fp32-card"

PYPROJECT = f"""
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "sixfold-fp32-card"
version = "0.1.0"
requires-python = ">=3.10"
dependencies = ["sixfold"]

[project.entry-points."sixfold.backends"]
{NAME} = "fp32_card:Fp32CardBackend"

[tool.setuptools]
packages = ["fp32_card"]
"""

MODULE = f'''
"""A card whose compiler takes fp32 graphs only; it computes with ONNX Runtime."""
import os

from sixfold.backends import OnnxRuntimeBackend, PartitionArtifact


class Fp32CardBackend(OnnxRuntimeBackend):
    name = "{NAME}"
    api_version = "1.3"

    def supports(self, artifact: PartitionArtifact) -> bool:
        return artifact.dtype == "fp32" and super().supports(artifact)

    def load(self, artifact, device):
        if os.environ.get("FP32_CARD_LOADS"):  # which physical card each load is for (Backend API 1.3)
            card = artifact.card
            with open(os.environ["FP32_CARD_LOADS"], "a") as f:
                f.write(f"{{artifact.name}} {{card.index if card else None}} {{card.spec if card else None}} "
                        f"{{device.name}}\\n")
        return super().load(artifact, device)
'''


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    source = tmp_path_factory.mktemp("fp32-card") / "src"
    (source / "fp32_card").mkdir(parents=True)
    (source / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (source / "fp32_card" / "__init__.py").write_text(textwrap.dedent(MODULE))
    target = source.parent / "site"
    _install(source, target)
    assert (target / "fp32_card" / "__init__.py").is_file()
    assert any(p.name.startswith("sixfold_fp32_card") for p in target.glob("*.dist-info"))
    yield target


def test_it_passes_the_kit_declining_fp16_and_int8(installed: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "sixfold.backends.conformance", NAME,
                           "--models", "rm2,rm2@fp16,rm2@int8", "--max-batch", "6", "--json", str(report)],
                          env=_env(installed), capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "DECLINED" in proc.stdout
    results = json.loads(report.read_text())["results"]
    by_case: dict[str, set[str]] = {}
    for r in results:
        by_case.setdefault(r["case"], set()).add(r["outcome"])
    assert by_case["rm2"] == {"pass"}
    assert by_case["rm2@fp16"] == {"declined"} and by_case["rm2@int8"] == {"declined"}
    ops = {case: outcomes for case, outcomes in by_case.items() if case.startswith("op ")}
    assert any(case.endswith("float16") for case in ops) and any(case.endswith("float32") for case in ops)
    # The op cases keep their true dtype: those touching fp16 (inputs, or a Cast to it) are declined, not failed.
    assert all(outcomes in ({"pass"}, {"declined"}) for outcomes in ops.values()), ops
    assert all(ops[case] == {"declined"} for case in ops if case.endswith("float16"))
    assert sum(ops[case] == {"pass"} for case in ops) >= 10


def _scores(*args: str, env: dict[str, str], request: dict[str, np.ndarray]) -> tuple[np.ndarray, str]:
    serve = ServeProcess(*args, "--model", "rm2", "--max-rows", "500", "--cards", "2", "--grpc-port", "0",
                         "--metrics-port", "-1", env=env, cwd=ROOT, timeout=120)
    try:
        assert serve.url, serve.output
        with tc.InferenceServerClient(serve.url) as client:
            scores = client.infer("rm2", triton_inputs(tc, request)).as_numpy("scores")
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=30) == 0, "".join(serve.lines)
        return scores, " ".join("".join(serve.lines).split())  # rich may wrap a line
    finally:
        serve.kill()


def test_sixfold_serve_runs_it_with_the_default_backends_answers(installed: Path, tmp_path: Path) -> None:
    request = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=500), seed=5).make(7)
    loads = tmp_path / "loads.txt"
    env = {**_env(installed), "FP32_CARD_LOADS": str(loads)}
    ours, log = _scores("--backend", NAME, env=env, request=request)
    default, default_log = _scores(env=env, request=request)
    assert f"2 {NAME} cards" in log and f"2 {NAME} cards" not in default_log
    assert ours.shape == (7, 1) and ((ours > 0) & (ours < 1)).all()
    np.testing.assert_allclose(ours, default, rtol=0, atol=1e-6)
    # Each load named its physical card (index and spec), the device given to load named SPEC/cardK.
    assert sorted(loads.read_text().splitlines()) == ["dense 0 m2-card m2-card/card0", "dense 1 m2-card m2-card/card1"]


def test_sixfold_serve_refuses_an_fp16_plan_on_it_naming_the_backend(installed: Path) -> None:
    """What the kit's DECLINED rows promise: serving never sends it a precision its supports() declines."""
    proc = subprocess.run([str(Path(sys.executable).parent / "sixfold-serve"), "--backend", NAME,
                           "--dense-precision", "fp16", "--model", "rm2", "--max-rows", "500", "--cards", "2",
                           "--grpc-port", "0", "--http-port", "0", "--metrics-port", "-1"],
                          env=_env(installed), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode != 0 and "READY" not in proc.stdout, proc.stdout[-2000:]
    assert f"backend '{NAME}'" in proc.stderr and "partition dense" in proc.stderr, proc.stderr[-2000:]
    assert "at precision fp16" in proc.stderr, proc.stderr[-2000:]  # the reason, not only the formats
