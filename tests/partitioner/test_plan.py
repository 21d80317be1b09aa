"""Plans: placement, estimates, JSON round trip, artifacts on disk, errors that quote numbers."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from sixfold import models
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.plan import PartitionPlan
from sixfold.partitioner.placement.strategy import PlanError


@pytest.fixture(scope="module")
def rm2():
    return partition_builtin("rm2", max_rows=500, cards=6)


def test_replicate_puts_the_sparse_part_on_the_host_and_dense_on_every_card(rm2) -> None:
    _, partitioned = rm2
    plan = partitioned.plan
    assert plan.devices_of(HOST_PARTITION) == ["host"]
    assert plan.devices_of(DENSE_PARTITION) == [f"card{i}" for i in range(6)]
    assert plan.tables["rows"] == [500] * 32


def test_estimates_follow_the_device_specs(rm2) -> None:
    _, partitioned = rm2
    est = partitioned.plan.estimates
    dense = partitioned.plan.partition(DENSE_PARTITION)
    # rm2's dense part: bottom 256-128-64, interaction of 33 vectors of 64, top 592-128-64-1.
    expected = 2 * (256 * 128 + 128 * 64 + 592 * 128 + 128 * 64 + 64) + 2 * 33 * 33 * 64
    assert dense.flops_per_item == pytest.approx(expected, rel=0.05)
    assert est.bottleneck in (HOST_PARTITION, DENSE_PARTITION)
    assert est.throughput_items_per_s > 0 and est.latency_ms > 0
    assert {d.device for d in est.per_device} == {"host", *(f"card{i}" for i in range(6))}


def test_plan_round_trips_through_json(rm2) -> None:
    _, partitioned = rm2
    text = partitioned.plan.to_json()
    assert PartitionPlan.from_json(text) == partitioned.plan
    assert json.loads(text)["partitions"][1]["format"] == "onnx"


def test_a_plan_from_another_format_version_is_refused(rm2) -> None:
    data = json.loads(rm2[1].plan.to_json())
    data["format_version"] = 99
    with pytest.raises(ValueError, match="format_version"):
        PartitionPlan.from_dict(data)


def test_written_artifacts_reproduce_the_model(rm2, tmp_path) -> None:
    model, partitioned = rm2
    write_artifacts(partitioned, tmp_path)
    plan = PartitionPlan.load(tmp_path / "plan.json")
    assert plan.partition(DENSE_PARTITION).artifact == "dense.onnx"
    tables = sorted((tmp_path / "tables").glob("table_*.npy"))
    assert len(tables) == 32
    table5 = np.load(tables[5], mmap_mode="r")
    torch.testing.assert_close(torch.from_numpy(np.array(table5)), model.embeddings.weight[5 * 500:6 * 500])
    # The dense partition in ONNX Runtime equals the torch model end to end.
    request = models.RequestGenerator.for_config(model.config, seed=4).make(11)
    split = partitioned.split
    with torch.inference_mode():
        pooled = split.host(*[torch.from_numpy(request[n]) for n in split.host_inputs])[0].numpy()
    session = ort.InferenceSession(str(tmp_path / "dense.onnx"))
    scores = session.run(None, {"dense_features": request["dense_features"], split.boundary[0]: pooled})[0]
    expected = model(*[torch.from_numpy(request[k]) for k in ("dense_features", "sparse_lengths", "sparse_indices")])
    np.testing.assert_allclose(scores, expected.detach().numpy(), atol=1e-5)


def test_a_dense_part_too_big_for_every_card_is_refused_with_numbers() -> None:
    tiny = dataclasses.replace(load_spec("m2-card"), name="tiny", memory_bytes=100_000)
    with pytest.raises(PlanError, match=r"dense partition needs .*MiB.*largest card card0 \(tiny\) has 0.1 MiB"):
        partition_builtin("rm2", max_rows=50, cards=2, card_spec=tiny)


def test_cli_writes_the_plan_and_explains_it(tmp_path, capsys) -> None:
    assert partition_main(["--model", "rm1", "--max-rows", "100", "--cards", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "card2" in out and "bottleneck" in out and "sparse" in out
    assert (tmp_path / "plan.json").is_file() and (tmp_path / "dense.onnx").is_file()


def test_cli_reports_a_bad_model_name_cleanly(tmp_path, capsys) -> None:
    assert partition_main(["--model", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_cli_draws_the_cut(tmp_path, capsys) -> None:
    png = tmp_path / "plan.png"
    assert partition_main(["--model", "rm1", "--max-rows", "50", "--cards", "2", "--out", str(tmp_path / "p"),
                           "--draw", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"drew {png}" in capsys.readouterr().out
