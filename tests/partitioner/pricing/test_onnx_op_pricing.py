"""ONNX stages are priced op by op on a calibrated spec (partitioner/pricing/onnx_ops.py): an ONNX export's host
stage of index arithmetic was priced by the roofline at a thirtieth to a fiftieth of what --measure timed."""

from __future__ import annotations

import onnx
import pytest

from sixfold.backends.host.calibrate import calibrate_host
from sixfold.partitioner.frontends.onnx_frontend import _example, cut_onnx, partition_onnx
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.pricing.measure import host_as_card, measure_plan
from sixfold.partitioner.pricing.onnx_ops import ORT_LAUNCHES, onnx_op_profile
from tests.server.test_onnx_heads import ClickAndConversion, export

TABLES, DIM, DENSE_IN = 3, 8, 4


@pytest.fixture(scope="module")
def two_heads(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("onnx_pricing") / "heads.onnx")
    export(ClickAndConversion().eval(), path, dynamo=False)
    return path


def test_the_profiles_hold_the_lookups_and_the_dense_flops(two_heads) -> None:
    split = cut_onnx(onnx.load(two_heads))
    example = _example(split)  # canonical requests at the pooling the cut observed
    host = onnx_op_profile(split.host, example(4), 4, example(64), 64)
    gathers = [op for op in host if op.kind == "gather"]
    assert len(gathers) == TABLES and all(op.row_bytes == DIM * 4 and op.ids[1] > 0 for op in gathers), gathers
    assert all(op.launches == ORT_LAUNCHES for op in host) and len(host) == len(split.host.graph.node)

    import onnxruntime as ort
    session = ort.InferenceSession(split.host.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {}
    for rows in (4, 64):
        request = example(rows)
        crossing = session.run(split.boundary, {n: request[n] for n in split.host_inputs})
        feeds[rows] = {**request, **dict(zip(split.boundary, crossing))}
    dense = onnx_op_profile(split.dense, feeds[4], 4, feeds[64], 64)
    per_item = sum(op.flops[1] for op in dense if op.kind == "matmul")
    width = DIM * (TABLES + 1)
    assert per_item == pytest.approx(2 * (DENSE_IN * DIM + width * 1 + width * 2))  # bottom, click, conversion


def test_an_onnx_host_stage_is_estimated_within_reach_of_its_measurement(two_heads) -> None:
    """Bound loose for a busy 2-core host (best run / estimate in 0.3..2.5); before this, 33-47x."""
    spec = calibrate_host(2.0, threads=1, name="host-calibrated-1t")
    partitioned = partition_onnx(two_heads, cards=[host_as_card(spec)], host=spec)
    report = measure_plan(partitioned, lambda host, card: partition_onnx(two_heads, cards=[card], host=host),
                          spec=spec, runs=5, batches=5)
    stages = {s.stage: s for s in report.stages}
    for name in (HOST_PARTITION, DENSE_PARTITION):
        assert 0.3 < stages[name].best_s / stages[name].estimate_s < 2.5, stages[name]
