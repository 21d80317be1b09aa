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


def _ragged_version(folder: Path, *, fmt: str = "onnx") -> None:
    """A one-partition plan whose dense input has one row per id, counted by a lengths input (as a model whose
    pooling follows the cut has): written by hand, with a real ONNX graph (rows * 2 + the ids' count)."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Mul", ["bag_rows", "two"], ["doubled"])], "ragged",
        [helper.make_tensor_value_info("sparse_lengths", TensorProto.INT32, ["N", 3]),
         helper.make_tensor_value_info("bag_rows", TensorProto.FLOAT, ["R", 4])],
        [helper.make_tensor_value_info("doubled", TensorProto.FLOAT, ["R", 4])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True)
    (folder / "dense.onnx").write_bytes(model.SerializeToString())
    tensor = {"rows_per_item": None, "ragged_by": "sparse_lengths", "consumed": True, "passed_on": False}
    plan = {"partitions": [{"name": "dense", "kind": "dense", "format": fmt, "artifact": "dense.onnx", "dtype": "fp32",
                            "param_bytes": 4, "flops_per_item": 8.0, "bytes_per_item": 32.0,
                            "inputs": [{"name": "sparse_lengths", "datatype": "INT32", "shape": [-1, 3],
                                        "rows_per_item": 1},
                                       {"name": "bag_rows", "datatype": "FP32", "shape": [-1, 4], **tensor}],
                            "outputs": [{"name": "doubled", "datatype": "FP32", "shape": [-1, 4], **tensor}]}]}
    (folder / "plan.json").write_text(json.dumps(plan))


def test_ragged_inputs_are_sized_by_their_lengths(tmp_path: Path) -> None:
    _ragged_version(tmp_path / "mine" / "3")
    (case,) = repository_cases(tmp_path, max_batch=6)
    assert case.name == "mine/3/dense@fp32" and case.artifact.layouts["bag_rows"].ragged_by == "sparse_lengths"
    for rows in case.batch_sizes:
        feed = case.feeds[rows]
        assert feed["sparse_lengths"].shape == (rows, 3) and feed["sparse_lengths"].min() >= 0
        assert feed["bag_rows"].shape == (int(feed["sparse_lengths"].sum()), 4)
        np.testing.assert_array_equal(case.expected[rows]["doubled"], feed["bag_rows"] * 2)
    report = run_conformance("onnxruntime", repository=tmp_path, max_batch=6)
    assert report.passed, [(r.check, r.detail) for r in report.failures]
    # As the server does, the kit never splits a batch on a ragged tensor: whole batches only.
    assert report.result(case.name, "items").detail.startswith("not split: bag_rows, doubled have no fixed rows")


def test_a_dense_partition_the_kit_cannot_compare_is_named(tmp_path: Path) -> None:
    _ragged_version(tmp_path / "mine" / "1", fmt="torch-fx")
    with pytest.raises(ValueError, match=r"mine/1/plan.json: dense partition\(s\) \['dense'\] are not ONNX"):
        repository_cases(tmp_path)
