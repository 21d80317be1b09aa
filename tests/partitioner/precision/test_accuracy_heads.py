"""--accuracy-report reads every output head (issue 31), not only ``scores``: a click + conversion ONNX export with
int8 tables gets numbers for both heads, and the conversion head's reference numbers are those of the original
file under ONNX Runtime on the report's own traffic."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.frontends.onnx_frontend import partition_onnx
from sixfold.partitioner.precision.accuracy import (_head_metrics, accuracy_report, plan_requests,
                                                    reference_artifacts, score_metrics)
from tests.server.test_onnx_heads import HEADS, ClickAndConversion, export


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("accuracy_heads") / "heads.onnx")
    export(ClickAndConversion().eval(), path, dynamo=False)
    return path


def test_the_cli_report_has_both_heads_and_int8_moves_each(two_heads, tmp_path) -> None:
    out = tmp_path / "heads" / "1"
    assert partition_main([two_heads, "--cards", "1", "--table-precision", "int8", "--accuracy-report",
                           "--accuracy-items", "256", "--out", str(out)]) == 0
    report = json.loads((out / "accuracy.json").read_text())
    assert list(report["heads"]) == HEADS
    click, conversion = report["heads"]["click"], report["heads"]["conversion"]
    assert report["max_abs_diff"] == click["max_abs_diff"] and report["ne_variant"] == click["ne_variant"]
    for numbers in (click, conversion):
        assert 0 < numbers["max_abs_diff"] < 0.05 and numbers["ne_reference"] > 0
    assert conversion["max_abs_diff"] != click["max_abs_diff"]


def test_the_conversion_heads_reference_is_the_original_files(two_heads) -> None:
    partitioned = partition_onnx(two_heads, cards=[load_spec("m2-card")], host=load_spec("host-cpu"))
    ref = reference_artifacts(partitioned)
    report = accuracy_report(ref, ref, partitioned.plan, items=300, batch_rows=128, seed=4)
    assert report.items == 300
    assert all(report.heads[h]["max_abs_diff"] == 0 for h in HEADS)
    # The same traffic through the original file: the conversion head's labels come from seed [4, 1].
    make, original = plan_requests(partitioned.plan, 4).make, ort.InferenceSession(two_heads)
    values = np.concatenate([original.run(["conversion"], make(rows))[0] for rows in (128, 128, 44)]).reshape(-1)
    labels = np.random.default_rng([4, 1]).random(values.shape[0]) < values
    want = score_metrics(labels, values, values)
    assert report.heads["conversion"]["base_rate"] == want["base_rate"]
    assert report.heads["conversion"]["logloss_reference"] == pytest.approx(want["logloss_reference"], rel=1e-5)


def test_a_head_that_is_not_a_probability_gets_only_its_differences() -> None:
    logits = np.array([-2.0, 0.5, 3.0], dtype=np.float32)
    numbers = _head_metrics(logits, logits + np.float32(0.25), np.random.default_rng(0))
    assert numbers["max_abs_diff"] == pytest.approx(0.25) and numbers["ne_reference"] is None
