"""Dense fp16 partitions (real ONNX Runtime) and the accuracy report (real served path)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import onnx
import pytest
import torch

from sixfold.backends import registry
from sixfold.server.loading.loader import load_host_stage
from sixfold.models import RequestGenerator
from sixfold.models.signature import DENSE, INDICES, LENGTHS, SCORES
from sixfold.partitioner.precision.accuracy import accuracy_report, reference_artifacts, score_metrics
from sixfold.partitioner.cli import main as cli_main
from sixfold.partitioner.compile import partition_builtin, quantize_tables
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.precision.dense import apply_dense_precision, onnx_param_bytes

MAX_ROWS = 400


@pytest.fixture(scope="module")
def rm2():
    """rm2 (32 tables, dim 64) with small tables, partitioned at fp32: (model, partitioned)."""
    return partition_builtin("rm2", max_rows=MAX_ROWS, cards=2)


def _fresh(partitioned):
    """An independent copy to convert (the fixture stays fp32)."""
    return dataclasses.replace(partitioned, plan=copy.deepcopy(partitioned.plan),
                               artifacts=dict(partitioned.artifacts),
                               variants={k: list(v) for k, v in partitioned.variants.items()})


def _dense_feed(model, partitioned, rows=128, seed=3):
    request = RequestGenerator.for_config(model.config, seed=seed).make(rows)
    host = load_host_stage(partitioned, partitioned.plan.device("host").spec)
    return {**request, **host.run(request)}


def _assert_fp32_io(graph) -> None:
    assert [i.type.tensor_type.elem_type for i in graph.input] == [onnx.TensorProto.FLOAT] * 2
    assert [o.type.tensor_type.elem_type for o in graph.output] == [onnx.TensorProto.FLOAT]


def _scores(model, fp32, converted):
    """(feed, fp32 scores, ``converted`` partition's scores) on ONNX Runtime, one 256-item feed."""
    card = converted.plan.device("card0").spec
    ort = registry.get_backend("onnxruntime")
    feed = _dense_feed(model, fp32, rows=256)
    want = ort.load(fp32.artifacts[DENSE_PARTITION], card).run(feed)[SCORES]
    got = ort.load(converted.artifacts[DENSE_PARTITION], card).run(feed)[SCORES]
    assert got.dtype == np.float32 and got.shape == want.shape
    return feed, want, got


def test_fp16_dense_runs_on_onnxruntime_with_fp32_io_and_stays_close(rm2):
    model, fp32 = rm2
    fp16 = _fresh(fp32)
    apply_dense_precision(fp16, "fp16")
    art = fp16.artifacts[DENSE_PARTITION]
    graph = onnx.load_from_string(art.payload).graph
    _assert_fp32_io(graph)
    weights = [i for i in graph.initializer if i.dims and np.prod(i.dims) > 1000]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)

    feed, want, got = _scores(model, fp32, fp16)
    diff = float(np.abs(got - want).max())
    assert 0 < diff < 1e-2, diff  # not bit-identical (it really is fp16), but close

    # The torch-fx variant is converted too, same interface.
    fx = fp16.variants[DENSE_PARTITION][0]
    assert fx.dtype == "fp16"
    with torch.inference_mode():
        out = fx.payload(*[torch.from_numpy(feed[n]) for n in fx.input_names])
    scores = (out[0] if isinstance(out, tuple) else out).numpy()
    assert scores.dtype == np.float32 and float(np.abs(scores - want).max()) < 1e-2


def test_fp16_halves_weights_and_reprices_the_plan(rm2):
    _, fp32 = rm2
    fp16 = _fresh(fp32)
    apply_dense_precision(fp16, "fp16")
    old, new = fp32.plan.partition(DENSE_PARTITION), fp16.plan.partition(DENSE_PARTITION)
    assert new.dtype == "fp16" and old.dtype == "fp32"
    assert new.param_bytes == onnx_param_bytes(fp16.artifacts[DENSE_PARTITION].payload)
    assert 0.45 < new.param_bytes / old.param_bytes < 0.55, (new.param_bytes, old.param_bytes)
    assert fp16.artifacts[DENSE_PARTITION].param_bytes == new.param_bytes

    rows = fp16.plan.estimates.batch_rows
    before = {d.device: d for d in fp32.plan.estimates.per_device}
    for d in fp16.plan.estimates.per_device:
        if DENSE_PARTITION not in d.partitions:
            assert d.batch_seconds == before[d.device].batch_seconds
            continue
        spec = fp16.plan.device(d.device).spec
        compute = lambda p, dt: spec.compute_seconds(p.flops_per_item * rows,  # noqa: E731
                                                     p.param_bytes + p.bytes_per_item * rows, dt)
        transfers = before[d.device].batch_seconds - compute(old, "fp32")
        assert d.batch_seconds == pytest.approx(transfers + compute(new, "fp16"), rel=1e-9)
        assert d.batch_seconds < before[d.device].batch_seconds
        assert d.memory_bytes == new.param_bytes
    assert fp16.plan.estimates.latency_ms < fp32.plan.estimates.latency_ms


def test_dense_precision_errors(rm2):
    _, fp32 = rm2
    with pytest.raises(ValueError, match="unknown dense precision 'bf16'"):
        apply_dense_precision(_fresh(fp32), "bf16")
    fp16 = _fresh(fp32)
    apply_dense_precision(fp16, "fp16")
    with pytest.raises(ValueError, match="already fp16"):
        apply_dense_precision(fp16, "fp16")
    with pytest.raises(ValueError, match="already fp16"):
        reference_artifacts(fp16)


def test_score_metrics_by_hand():
    labels = np.array([1, 0, 1, 0])
    half = np.full(4, 0.5)
    sharp = np.array([0.75, 0.25, 0.75, 0.25])
    m = score_metrics(labels, half, sharp)
    # base rate 1/2: entropy ln 2; the 0.5 model's log-loss is ln 2 too, so its NE is 1.
    assert m["base_rate"] == 0.5
    assert m["logloss_reference"] == pytest.approx(math.log(2))
    assert m["ne_reference"] == pytest.approx(1.0)
    assert m["logloss_variant"] == pytest.approx(-math.log(0.75))
    assert m["ne_variant"] == pytest.approx(-math.log(0.75) / math.log(2))
    assert m["ne_change_pct"] == pytest.approx((-math.log(0.75) / math.log(2) - 1) * 100)
    assert m["max_abs_diff"] == pytest.approx(0.25) and m["mean_abs_diff"] == pytest.approx(0.25)
    same = score_metrics(labels, sharp, sharp)
    assert same["max_abs_diff"] == 0 and same["ne_change_pct"] == 0
    with pytest.raises(ValueError, match="all 3 labels are 1"):
        score_metrics(np.ones(3), half[:3], half[:3])
    with pytest.raises(ValueError, match="one length; got 4, 4, 3"):
        score_metrics(labels, half, half[:3])


def test_identical_paths_report_zero_and_labels_follow_the_model(rm2):
    model, fp32 = rm2
    ref = reference_artifacts(fp32)
    report = accuracy_report(ref, ref, fp32.plan, items=700, batch_rows=256, seed=5)
    assert report.items == 700
    assert report.max_abs_diff == 0 and report.mean_abs_diff == 0 and report.ne_change_pct == 0
    assert report.reference == report.variant == "fp32 tables + fp32 dense"

    # The reference is the fp32 model itself, and labels are Bernoulli(p) with the documented seed:
    # recompute the log-loss from the unsplit torch model on the same traffic.
    gen = RequestGenerator(tuple(fp32.plan.tables["rows"]), model.config.dense_dim,
                           tuple(fp32.plan.tables["pooling"]), zipf=fp32.plan.tables["zipf"], seed=5)
    scores = []
    with torch.inference_mode():
        for rows in (256, 256, 188):
            r = gen.make(rows)
            scores.append(model(*(torch.from_numpy(r[k]) for k in (DENSE, LENGTHS, INDICES))).reshape(-1).numpy())
    p = np.concatenate(scores)
    labels = np.random.default_rng(5).random(p.shape[0]) < p
    want = score_metrics(labels, p, p)
    assert report.base_rate == want["base_rate"]
    assert report.logloss_reference == pytest.approx(want["logloss_reference"], rel=1e-5)


def test_int4_tables_cost_more_than_fp16_tables(rm2):
    model, fp32 = rm2
    ref = reference_artifacts(fp32)
    reports = {}
    for precision in ("fp16", "int4"):
        variant = _fresh(fp32)
        quantize_tables(variant, model, precision)
        assert variant.artifacts[HOST_PARTITION].format == "tables"
        reports[precision] = accuracy_report(ref, variant, fp32.plan, items=1024, seed=2)
        assert reports[precision].variant == f"{precision} tables + fp32 dense"
    assert 0 < reports["fp16"].max_abs_diff < reports["int4"].max_abs_diff
    assert reports["fp16"].mean_abs_diff < reports["int4"].mean_abs_diff
    assert abs(reports["fp16"].ne_change_pct) < abs(reports["int4"].ne_change_pct)


def test_cli_writes_fp16_plan_and_accuracy_json(tmp_path, capsys):
    out = tmp_path / "1"
    rc = cli_main(["--model", "rm2", "--max-rows", str(MAX_ROWS), "--cards", "2", "--dense-precision", "fp16",
                   "--table-precision", "int8", "--accuracy-report", "--accuracy-items", "600", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "accuracy.json").read_text())
    assert report["items"] == 600 and report["variant"] == "int8 tables + fp16 dense"
    assert report["reference"] == "fp32 tables + fp32 dense"
    assert 0 < report["max_abs_diff"] < 5e-2
    assert report["ne_reference"] > 0 and abs(report["ne_change_pct"]) < 1.0
    plan = json.loads((out / "plan.json").read_text())
    dense = next(p for p in plan["partitions"] if p["name"] == DENSE_PARTITION)
    assert dense["dtype"] == "fp16"
    model = onnx.load(str(out / "dense.onnx"))
    assert any(i.data_type == onnx.TensorProto.FLOAT16 for i in model.graph.initializer)
    assert "normalized entropy" in capsys.readouterr().out


def test_int8_dense_quantizes_the_weights_keeps_fp32_io_and_stays_close(rm2):
    model, fp32 = rm2
    int8 = _fresh(fp32)
    assert apply_dense_precision(int8, "int8") == [DENSE_PARTITION]
    art = int8.artifacts[DENSE_PARTITION]
    graph = onnx.load_from_string(art.payload).graph
    _assert_fp32_io(graph)
    ops = {n.op_type for n in graph.node}
    # activations quantized per item (int8_rows), none per batch
    assert "MatMulInteger" in ops and "DynamicQuantizeLinear" not in ops, ops
    big = [i for i in graph.initializer if i.dims and np.prod(i.dims) > 1000]
    assert big and all(i.data_type == onnx.TensorProto.INT8 for i in big)

    _, want, got = _scores(model, fp32, int8)
    diff = np.abs(got - want)
    # really int8 (not bit-identical) and close: at 400 rows a table's random weights are coarse to quantize
    # (at 50k rows: max 3e-3, normalized entropy within 0.02%, `sixfold-partition --accuracy-report`)
    assert 0 < float(diff.max()) < 0.1 and float(diff.mean()) < 1e-2, (diff.max(), diff.mean())

    # a quarter of the weights, repriced at the card's int8 peak; no torch-fx variant to serve it
    old, new = fp32.plan.partition(DENSE_PARTITION), int8.plan.partition(DENSE_PARTITION)
    assert new.dtype == "int8" and 0.2 < new.param_bytes / old.param_bytes < 0.35
    assert int8.plan.estimates.latency_ms < fp32.plan.estimates.latency_ms
    assert int8.variants[DENSE_PARTITION] == []
    with pytest.raises(ValueError, match="takes none of partition dense's formats \\['onnx'\\] at precision int8"):
        int8.artifact_for(DENSE_PARTITION, registry.get_backend("torch"))
    with pytest.raises(ValueError, match="already int8"):
        apply_dense_precision(int8, "fp16")


def test_int8_scores_of_an_item_do_not_depend_on_its_batch_mates(rm2):
    import onnxruntime as ort

    _, fp32 = rm2
    int8 = _fresh(fp32)
    apply_dense_precision(int8, "int8")
    art = int8.artifacts[DENSE_PARTITION]
    session = ort.InferenceSession(art.payload, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    feeds = []
    for n, scale in ((3, 1.0), (5, 60.0), (1, 0.0)):  # quiet items, loud batch-mates, a row of zeros
        feeds.append({i.name: (rng.standard_normal((n * art.layouts[i.name].rows_per_item, i.shape[-1])) * scale
                               ).astype(np.float32) for i in session.get_inputs()})
    alone = session.run(None, feeds[0])[0]
    together = session.run(None, {k: np.concatenate([f[k] for f in feeds]) for k in feeds[0]})[0]
    np.testing.assert_array_equal(together[:3], alone)  # bit for bit
    assert np.isfinite(together).all()
