"""The dense partition's ONNX op list: derived from the zoo, written down, and checked by the kit op by op."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from sixfold.backends import BackendError, OnnxRuntimeBackend
from sixfold.backends.conformance import run_conformance
from sixfold.backends.conformance.ops import DENSE_OPS_FILE, dense_ops, markdown_table, op_cases

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("dense_ops_script", ROOT / "scripts" / "dense_ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_op_list_and_the_docs_table_match_the_zoo_exported_now():
    script = _script()
    inv, table = script.current()  # every zoo model's dense partition, fp32 and fp16, exported now
    assert inv == dense_ops(), f"{DENSE_OPS_FILE} is stale: run scripts/dense_ops.py"
    doc = (ROOT / "docs" / "backends.md").read_text()
    assert script.with_table(doc, table) == doc, "docs/backends.md's op table is stale: run scripts/dense_ops.py"
    vendor = (ROOT / "docs" / "vendor.md").read_text()
    assert script.with_summary(vendor, table) == vendor, "docs/vendor.md's op list is stale: run scripts/dense_ops.py"
    assert table == markdown_table(dense_ops())
    ops = {u["op"] for u in inv["ops"]}
    assert {"Gemm", "MatMul", "Relu", "Sigmoid", "Concat", "Gather", "Reshape", "Cast"} <= ops
    assert inv["opset"] == {"": 20}


def test_every_op_use_is_a_case_that_onnxruntime_passes():
    cases = op_cases()
    assert len(cases) == len(dense_ops()["ops"]) and all(c.batch_sizes == [1, 2, 3] for c in cases)
    report = run_conformance("onnxruntime", cases=cases, checks=["op"])
    assert report.passed, [(r.case, r.detail) for r in report.failures]
    assert {r.check for r in report.results} == {"load", "op"}
    assert any(r.case.startswith("op Gemm(alpha=1.0,beta=1.0,transA=0,transB=1) float16") for r in report.results)


class _NoSigmoid(OnnxRuntimeBackend):
    """A card compiler that lacks one op of the list."""

    def load(self, artifact, device):
        import onnx
        if any(n.op_type == "Sigmoid" for n in onnx.load_from_string(bytes(artifact.payload)).graph.node):
            raise BackendError("mycard compiler: unsupported op Sigmoid")
        return super().load(artifact, device)


class _LeakyRelu(OnnxRuntimeBackend):
    """A card whose Relu leaks negatives (wrong numbers on one op only)."""

    def load(self, artifact, device):
        import dataclasses

        import onnx
        model = onnx.load_from_string(bytes(artifact.payload))
        for node in model.graph.node:
            if node.op_type == "Relu":
                node.op_type = "LeakyRelu"
        return super().load(dataclasses.replace(artifact, payload=model.SerializeToString()), device)


@pytest.mark.parametrize(("backend", "check", "op"), [(_NoSigmoid, "load", "Sigmoid"), (_LeakyRelu, "op", "Relu")])
def test_the_default_kit_run_names_the_op_a_backend_gets_wrong(backend, check, op):
    report = run_conformance(backend(), models=("rm2",), max_batch=4, timeout_s=5.0)
    fails = [r for r in report.results if r.outcome == "fail" and r.case.startswith("op ")]
    assert fails and all(r.case.startswith(f"op {op} ") for r in fails), [r.case for r in fails]
    assert {r.check for r in fails} == {check}
    assert "rm2" in {r.case for r in report.failures}  # the whole model fails too, less precisely
    json.dumps(report.to_dict())


class _Fp32Only(OnnxRuntimeBackend):
    """A card that computes in fp32 only, and says so in supports()."""

    def supports(self, artifact):
        return artifact.dtype == "fp32" and super().supports(artifact)


def test_a_backend_that_declines_fp16_passes_with_the_fp16_cases_declined():
    assert {c.artifact.dtype for c in op_cases()} == {"fp32", "fp16"}  # each op case labelled as it is
    report = run_conformance(_Fp32Only(), models=("rm2", "rm2@fp16", "rm2@int8"), max_batch=4, timeout_s=5.0)
    assert report.passed, [(r.case, r.check, r.detail) for r in report.failures]
    assert {r.outcome for r in report.results if r.case in ("rm2@fp16", "rm2@int8")} == {"declined"}
    declined = [r for r in report.results if r.outcome == "declined"]
    assert declined and all(f"supports() is False for {'int8' if r.case == 'rm2@int8' else 'fp16'}" in r.detail
                            for r in declined)
    assert {r.case for r in declined} >= {r.case for r in report.results if r.case.endswith("float16")}
    assert "declined by supports()" in report.summary() and not any(r.outcome == "skip" for r in report.results)
    assert any(r.outcome == "pass" and r.case.startswith("op ") and "float32" in r.case for r in report.results)
    assert any(r.outcome == "pass" and r.case == "rm2" for r in report.results)


def test_a_backend_that_declines_fp32_fails():
    class _Fp16Only(OnnxRuntimeBackend):
        def supports(self, artifact):
            return artifact.dtype == "fp16" and super().supports(artifact)

    report = run_conformance(_Fp16Only(), models=(), max_batch=4, timeout_s=5.0)
    assert not report.passed
    assert all("float32" in r.case for r in report.failures if r.check == "load")


def test_the_int8_and_fp16_partitions_serving_sends_pass_the_items_check_on_onnxruntime():
    report = run_conformance("onnxruntime", models=("rm2@int8", "rm2@fp16"), max_batch=8, ops=False)
    assert report.passed, [(r.case, r.check, r.detail) for r in report.failures]
    items = report.result("rm2@int8", "items")
    assert items.passed, items.detail  # per-item quantization: a batch cut and rejoined equals the whole
