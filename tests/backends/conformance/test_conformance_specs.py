"""Shipped data files: the GPU spec loads and the simcard fault files are valid simcard options."""

from __future__ import annotations

import json

import pytest

from sixfold.backends import SimCardBackend, load_spec
from sixfold.backends.spec import SPEC_DIR, spec_names

FAULTS = sorted((SPEC_DIR / "faults").glob("*.json"))


def test_gpu_l4_spec() -> None:
    spec = load_spec("gpu-l4")
    assert spec.kind == "gpu" and spec.memory_bytes == 24 * 2**30
    assert spec.peak_flops["fp16"] > spec.peak_flops["fp32"]
    assert spec.link_bandwidth > load_spec("m2-card").link_bandwidth


def test_fault_files_are_not_device_specs() -> None:
    assert not {p.stem for p in FAULTS} & set(spec_names())


@pytest.mark.parametrize("path", FAULTS, ids=[p.stem for p in FAULTS])
def test_fault_files_are_simcard_options(path) -> None:
    options = json.loads(path.read_text())
    assert options.pop("description")
    backend = SimCardBackend(**options)
    assert backend.faults.crash_after is not None or backend.faults.slow_factor != 1.0


def test_options_file_drives_the_kit(capsys: pytest.CaptureFixture[str]) -> None:
    from sixfold.backends.conformance.cli import main
    code = main(["simcard", "--models", "rm2", "--max-batch", "24", "--checks", "outputs",
                 "--options-file", str(SPEC_DIR / "faults" / "flaky.json")])
    assert code == 1
    assert "injected fault: crash_after=20" in capsys.readouterr().out.replace("\n", " ").replace("│", "")
