"""Kit cases from a model repository: every version's card partitions, each pipeline stage, at the plan's precision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sixfold.backends import OnnxRuntimeBackend, PartitionArtifact
from sixfold.backends.conformance import run_conformance
from sixfold.backends.conformance.cli import main
from sixfold.backends.conformance.repository import repository_cases
from tests.backends.conformance.test_conformance import _ReadsEveryInput

BIN = Path(sys.executable).parent
CASES = {"rm2/1/dense.0@fp32", "rm2/1/dense.1@fp32", "rm2/1/dense.2@fp32", "rm2/2/dense@int8"}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Version 1: a 3-stage pipeline; version 2: the same model at int8; written by the real sixfold-partition."""
    root = tmp_path_factory.mktemp("repo")
    for version, flags in (("1", ["--strategy", "pipeline", "--stages", "3", "--cards", "3"]),
                           ("2", ["--dense-precision", "int8", "--cards", "2"])):
        proc = subprocess.run([str(BIN / "sixfold-partition"), "--model", "rm2", "--max-rows", "200", *flags,
                               "--out", str(root / "rm2" / version)], capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-2000:]
    return root


def test_cases_are_the_plans_partitions_with_their_precision_and_layouts(repo: Path) -> None:
    cases = {c.name: c for c in repository_cases(repo, max_batch=5)}
    assert set(cases) == CASES
    first = cases["rm2/1/dense.0@fp32"].artifact
    assert first.layouts["host_embedding_bag"].consumed is False  # stage 1 only passes it on
    assert first.metadata["passthrough"] == ["host_embedding_bag"]
    assert cases["rm2/2/dense@int8"].artifact.dtype == "int8"
    assert cases["rm2/1/dense.0@fp32"].artifact.layouts["host_embedding_bag"].rows_per_item == 32
    # A later stage is fed what the stages before it answer, as serving feeds it.
    second = cases["rm2/1/dense.1@fp32"]
    np.testing.assert_array_equal(second.feeds[4]["linear_1"], cases["rm2/1/dense.0@fp32"].expected[4]["linear_1"])
    assert second.feeds[4]["host_embedding_bag"].shape == (4 * 32, 64)


def test_the_cli_checks_a_backend_on_the_repository(repo: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report.json"
    assert main(["onnxruntime", "--repository", str(repo), "--max-batch", "5", "--json", str(out)]) == 0
    assert "rm2/1/dense.2@fp32" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["passed"] and {r["case"] for r in report["results"]} == CASES  # no zoo models, no op cases


def test_a_backend_that_breaks_on_a_deployed_stage_fails_on_that_stage(repo: Path) -> None:
    report = run_conformance(_ReadsEveryInput(), repository=repo, max_batch=4)
    failed = {r.case for r in report.results if r.outcome == "fail"}
    assert failed == {"rm2/1/dense.0@fp32"}, [(r.case, r.check, r.detail) for r in report.failures]


class _Fp32Only(OnnxRuntimeBackend):
    def supports(self, artifact: PartitionArtifact) -> bool:
        return artifact.dtype == "fp32" and super().supports(artifact)


def test_a_precision_the_backend_declines_is_declined_not_failed(repo: Path) -> None:
    report = run_conformance(_Fp32Only(), repository=repo, max_batch=4)
    assert report.passed, [(r.case, r.check, r.detail) for r in report.failures]
    assert {r.outcome for r in report.results if r.case == "rm2/2/dense@int8"} == {"declined"}
    assert {r.outcome for r in report.results if r.case != "rm2/2/dense@int8"} == {"pass"}


def test_what_is_not_a_repository_is_named(tmp_path: Path, capsys) -> None:
    assert main(["onnxruntime", "--repository", str(tmp_path / "nope")]) == 2
    assert f"--repository {tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
    assert main(["onnxruntime", "--repository", str(tmp_path)]) == 2
    assert "no model version holds a plan.json" in capsys.readouterr().err
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "plan.json").write_text("{not json")
    assert main(["onnxruntime", "--repository", str(tmp_path)]) == 2
    assert f"{tmp_path / 'm' / '1' / 'plan.json'}: not a sixfold plan" in capsys.readouterr().err
