"""Each case's report line says the tolerance it compared with and the largest error it saw."""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np

from sixfold.backends.api import Arrays
from sixfold.backends.conformance import run_conformance
from sixfold.backends.conformance.cli import main
from tests.backends.conformance.test_conformance import _Wrapped, broken

FAST = {"models": ("rm2",), "max_batch": 6, "timeout_s": 5.0, "ops": False}


class _AddsThreeMillionths(_Wrapped):
    """Within the default tolerance (1e-4), but not bit-equal: the report must show the 3e-6."""

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return {k: v + np.float32(3e-6) for k, v in self.inner.run(inputs).items()}


class _AddsAThousandth(_Wrapped):
    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return {k: v + np.float32(1e-3) for k, v in self.inner.run(inputs).items()}


def test_a_passing_check_reports_its_tolerance_and_the_error_it_saw() -> None:
    report = run_conformance(broken(_AddsThreeMillionths), **FAST, checks=["outputs", "items", "memory"])
    assert report.passed, [(r.check, r.detail) for r in report.failures]
    outputs = report.result("rm2", "outputs")
    assert outputs.atol == 1e-4
    assert outputs.max_error is not None and 1e-6 < outputs.max_error < 1e-5
    assert report.result("rm2", "items").max_error is not None
    memory = report.result("rm2", "memory")  # compares no answers: no tolerance to report
    assert memory.atol is None and memory.max_error is None and memory.tolerance_text == ""


def test_a_failing_check_reports_the_error_beyond_its_tolerance() -> None:
    report = run_conformance(broken(_AddsAThousandth), **FAST, checks=["outputs"], atol=2e-4)
    outputs = report.result("rm2", "outputs")
    assert outputs.outcome == "fail" and outputs.atol == 2e-4
    assert outputs.max_error is not None and 9e-4 < outputs.max_error < 1.1e-3
    assert outputs.tolerance_text == f"{outputs.max_error:.1e} / 0.0002"


def test_a_case_with_its_own_tolerance_reports_that_one() -> None:
    """fp16 op cases carry a looser tolerance than the kit's default; the line says which one was used."""
    from sixfold.backends.conformance import op_cases
    case = next(c for c in op_cases(0) if float(c.notes.get("atol", 0)) > 1e-4)
    report = run_conformance("onnxruntime", cases=[case], checks=["op"])
    line = report.result(case.name, "op")
    assert line.outcome == "pass" and line.atol == float(case.notes["atol"])
    assert line.max_error is not None and line.max_error <= line.atol


def test_the_cli_table_and_json_carry_them(capsys, tmp_path) -> None:
    out = tmp_path / "report.json"
    assert main(["onnxruntime", "--models", "rm2", "--max-batch", "4", "--no-ops", "--checks", "outputs",
                 "--json", str(out)]) == 0
    assert "max err / atol" in capsys.readouterr().out
    line = next(r for r in json.loads(out.read_text())["results"] if r["check"] == "outputs")
    assert line["atol"] == 1e-4 and line["max_error"] == 0.0  # onnxruntime against itself: bit-equal
