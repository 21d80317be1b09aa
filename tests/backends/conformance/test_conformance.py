"""The conformance kit passes the built-ins and fails each kind of broken backend on the right check."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator, Mapping

import numpy as np
import pytest

from sixfold.backends import DeviceSpec, OnnxRuntimeBackend, PartitionArtifact, SimCardBackend
from sixfold.backends.api import Arrays, Executable
from sixfold.backends.conformance import CHECKS, builtin_case, case_from_artifact, run_conformance
from sixfold.backends.conformance.cli import main, parse_option
from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeExecutable
from tests.backends.factories import batch, mlp

# NOTE: small and cached in-process: every test below reuses one built rm2 partition.
FAST = {"models": ("rm2",), "max_batch": 12, "timeout_s": 5.0}


class _Wrapped(Executable):
    """Delegates to a real ONNX Runtime executable; subclasses break one thing."""

    def __init__(self, inner: OnnxRuntimeExecutable) -> None:
        super().__init__(inner.artifact, inner.device)
        self.inner = inner

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return self.inner.run(inputs)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def close(self) -> None:
        super().close()
        self.inner.close()


class _Broken(OnnxRuntimeBackend):
    executable: type[_Wrapped] = _Wrapped

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        return self.executable(super().load(artifact, device))


class _AddsOnePercent(_Wrapped):
    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return {k: v + np.float32(1e-2) for k, v in self.inner.run(inputs).items()}


class _DropsRowAbove8(_Wrapped):
    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        out = self.inner.run(inputs)
        return {k: v[:-1] if len(v) > 8 else v for k, v in out.items()}


class _BatchesEveryInputByDim0(_Wrapped):
    """Micro-batches of 8 rows, cutting every input at the same dim-0 row: "dim 0 is the batch for every
    input", as the docs once said. Pooled embeddings are items x tables on dim 0, so the pieces mismatch."""

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        total = max(v.shape[0] for v in inputs.values())
        parts = [self.inner.run({k: v[a:a + 8] for k, v in inputs.items()}) for a in range(0, total, 8)
                 if all(v[a:a + 8].shape[0] for v in inputs.values())]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


class _ReportsNoMemory(_Wrapped):
    def memory_bytes(self) -> int:
        return 0


class _AnswersAfterClose(_Wrapped):
    """Keeps a private session alive after close: a use-after-free on a real card."""

    def close(self) -> None:
        super(_Wrapped, self).close()  # stops the worker, keeps self.inner


RELEASE = threading.Event()


class _HangsOnBadInput(_Wrapped):
    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        try:
            return self.inner.run(inputs)
        except Exception as exc:
            if "closed" not in str(exc):  # bad inputs wedge the "driver"; the test releases it at teardown
                RELEASE.wait(60)
            raise


class _NeverRefuses(OnnxRuntimeBackend):
    """Loads anything: its device spec's memory is ignored."""

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        roomy = dataclasses.replace(device, memory_bytes=1 << 40)
        return super().load(artifact, roomy)


class _RefusesWithoutNumbers(OnnxRuntimeBackend):
    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        from sixfold.backends import DoesNotFit
        if artifact.param_bytes > device.memory_bytes:
            raise DoesNotFit("too big")
        return super().load(artifact, device)


def broken(executable: type[_Wrapped]) -> _Broken:
    backend = _Broken()
    backend.executable = executable
    return backend


@pytest.fixture
def release_hung() -> Iterator[None]:
    RELEASE.clear()
    yield
    RELEASE.set()


@pytest.mark.parametrize("name", ["onnxruntime", "simcard"])
def test_builtins_pass_by_name(name: str) -> None:
    report = run_conformance(name, **FAST)
    assert report.passed, report.summary() + "\n" + "\n".join(f"{r.check}: {r.detail}" for r in report.failures)
    assert [r.check for r in report.results if r.case == "rm2"] == [c for c in CHECKS if c != "op"]
    ops = [r for r in report.results if r.case.startswith("op ")]  # every op use of the dense partitions
    assert ops and {r.check for r in ops} == {"load", "op"}
    assert not report.hung


def test_onnxruntime_passes_the_default_run() -> None:
    report = run_conformance("onnxruntime")
    assert report.passed, report.failures
    assert {r.case for r in report.results if not r.case.startswith("op ")} == {
        "rm2", "dlrm-mlperf", "rm2@fp16", "rm2@int8", "rm2/stage1of3", "rm2/stage2of3"}
    assert "batch sizes 1..64" in report.result("dlrm-mlperf", "outputs").detail


@pytest.mark.parametrize(("backend", "check", "words"), [
    (lambda: broken(_AddsOnePercent), "outputs", "differs from onnxruntime by up to 0.01"),
    (lambda: broken(_DropsRowAbove8), "outputs", "batch sizes wrong (9-12); first: batch 9: scores shape (8, 1)"),
    (lambda: broken(_ReportsNoMemory), "memory", "memory_bytes() returned 0"),
    (lambda: broken(_BatchesEveryInputByDim0), "items",
     "(dense_features 1 row, host_embedding_bag 32 rows per item)"),
    (lambda: broken(_AnswersAfterClose), "close", "infer() after close() answered"),
    (lambda: _NeverRefuses(), "does-not-fit", "must raise DoesNotFit"),
    (lambda: _RefusesWithoutNumbers(), "does-not-fit", "quotes no sizes"),
], ids=["adds-1e-2", "drops-row-above-8", "no-memory", "dim0-is-batch", "answers-after-close", "never-refuses",
        "refuses-without-numbers"])
def test_broken_backend_fails_the_right_check(backend, check: str, words: str) -> None:
    report = run_conformance(backend(), **FAST)
    assert not report.passed
    assert check in report.failed_checks(), report.summary()
    assert words in report.result("rm2", check).detail
    if check not in ("outputs", "items"):  # wrong numbers also show under concurrency; the others are precise
        assert report.failed_checks() == {check}, [(r.check, r.detail) for r in report.failures]


def test_hang_on_bad_input_fails_bad_input_within_the_timeout(release_hung: None) -> None:
    report = run_conformance(broken(_HangsOnBadInput), models=("rm2",), max_batch=12, timeout_s=1.0)
    assert report.failed_checks() == {"bad-input"}
    assert "hung on bad input" in report.result("rm2", "bad-input").detail
    assert report.hung


def test_a_crashing_simcard_fails_outputs() -> None:
    report = run_conformance("simcard", options={"faults": {"crash_after": 3}}, **FAST)
    detail = report.result("rm2", "outputs").detail
    assert "9 of 12 batch sizes wrong (4-12)" in detail and "injected fault" in detail


def test_load_failure_skips_the_checks_that_need_it() -> None:
    class Refuses(OnnxRuntimeBackend):
        formats = ("torch-fx",)

    report = run_conformance(Refuses(), **FAST)
    assert report.result("rm2", "load").outcome == "fail"
    assert "supports() is False" in report.result("rm2", "load").detail
    assert {r.check for r in report.results if r.outcome == "skip"} == {"memory", "outputs", "items", "concurrency", "close", "op"}


def test_custom_cases_from_any_onnx_artifact() -> None:
    m = mlp()
    case = case_from_artifact("mlp", m.artifact(), lambda rows: batch(m, rows, seed=rows), range(1, 6))
    np.testing.assert_allclose(case.expected[5]["scores"], m.reference(case.feeds[5]), atol=1e-5)
    report = run_conformance(SimCardBackend(), cases=[case], checks=["outputs", "close"])
    assert report.passed and [r.check for r in report.results] == ["load", "outputs", "close"]


def test_builtin_cases_feed_real_host_outputs() -> None:
    case = builtin_case("rm2", max_batch=12)
    assert case.batch_sizes == list(range(1, 13))
    feed = case.feeds[3]
    assert set(feed) == set(case.artifact.input_names) and feed["dense_features"].shape[0] == 3
    assert case.expected[3]["scores"].shape == (3, 1)


def test_cli_exit_codes_and_table(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    out = tmp_path / "report.json"
    assert main(["onnxruntime", "--models", "rm2", "--max-batch", "12", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and "does-not-fit" in text and "PASSED" in text
    assert json.loads(out.read_text())["passed"] is True
    assert main(["simcard", "--models", "rm2", "--max-batch", "12", "--option", 'faults={"crash_after": 2}']) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["no-such-backend", "--models", "rm2"]) == 2
    assert "no backend named 'no-such-backend'" in capsys.readouterr().err
    assert main(["onnxruntime", "--checks", "outputs,bogus"]) == 2


def test_parse_option_reads_json_else_strings() -> None:
    assert parse_option("intra_op_threads=2") == ("intra_op_threads", 2)
    assert parse_option('faults={"hang": true}') == ("faults", {"hang": True})
    assert parse_option("functional=onnxruntime") == ("functional", "onnxruntime")


class _ReadsEveryInput(OnnxRuntimeBackend):
    """A card compiler that insists every input it is given is read by the graph (as OpenVINO's did)."""

    def load(self, artifact, device):
        import onnx

        from sixfold.backends import BackendError

        graph = onnx.load_from_string(bytes(artifact.payload)).graph
        read = {name for node in graph.node for name in node.input}
        unread = [i.name for i in graph.input if i.name not in read]
        if unread:
            raise BackendError(f"mycard compiler: inputs {unread} are not used by the graph")
        return super().load(artifact, device)


def test_pipeline_stage_cases_catch_a_backend_that_cannot_take_a_passed_on_input() -> None:
    report = run_conformance(_ReadsEveryInput(), models=("rm2/stage1of3", "rm2/stage2of3"), max_batch=4, ops=False)
    failed = {r.case for r in report.results if r.outcome == "fail"}
    assert failed == {"rm2/stage1of3"}, [(r.case, r.check, r.detail) for r in report.failures]
    assert "not used by the graph" in report.result("rm2/stage1of3", "load").detail
    with pytest.raises(ValueError, match="MODEL/stageKofN"):
        run_conformance("onnxruntime", models=("rm2/stage4of3",), max_batch=2, ops=False)
