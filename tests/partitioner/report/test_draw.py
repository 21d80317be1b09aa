"""--draw shows the devices (which card holds what), table shards and pipeline stages; --stages sets the count."""

from __future__ import annotations

import json

import pytest

from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import HOST_PARTITION
from sixfold.partitioner.report.draw import device_lines, draw_partitioned, stage_labels
from sixfold.partitioner.placement.sharding import shard_tables
from sixfold.partitioner.cut.sparse_dense import HOST


@pytest.fixture(scope="module")
def pipelined():
    _, partitioned = partition_builtin("rm1", max_rows=1000, cards=5, strategy="pipeline", stages=2, compile=False)
    return partitioned


def test_stages_sets_the_pipeline_stage_count(pipelined) -> None:
    plan = pipelined.plan
    assert plan.dense_stages() == ["dense.0", "dense.1"]
    on = {p.device: (p.partition, p.replica) for p in plan.placements if p.partition != HOST_PARTITION}
    assert on == {"card0": ("dense.0", 0), "card1": ("dense.1", 0), "card2": ("dense.0", 1), "card3": ("dense.1", 1)}


def test_devices_panel_says_which_card_holds_which_stage(pipelined, tmp_path) -> None:
    lines = device_lines(pipelined.plan)
    assert lines["host"][1] == "sparse: host stage (lookups)"
    assert lines["card1"][1] == "dense.1: pipeline stage 2 of 2, replica 0"
    assert lines["card2"][1] == "dense.0: pipeline stage 1 of 2, replica 1"
    assert lines["card4"][-1] == "idle"  # 5 cards, 2 stages: one left over
    labels = stage_labels(pipelined)
    assert {"dense.0", "dense.1", HOST} <= set(labels.values())  # dense nodes coloured by stage
    png = draw_partitioned(pipelined, tmp_path / "pipeline.png", title="rm1")
    assert png.stat().st_size > 10_000


def test_devices_panel_lists_table_shards(tmp_path) -> None:
    _, partitioned = partition_builtin("rm2", max_rows=2000, cards=3, compile=False)
    shard_tables(partitioned, "row")
    lines = device_lines(partitioned.plan)
    card = lines["card0"]
    assert card[1] == "dense: replica 0" and any(line.endswith("table shard(s):") for line in card)
    assert any(line.strip().startswith("table ") and " rows " in line for line in card)
    assert draw_partitioned(partitioned, tmp_path / "shards.png").stat().st_size > 10_000


def test_cli_stages_and_draw(tmp_path, capsys) -> None:
    assert partition_main(["--model", "rm1", "--max-rows", "1000", "--cards", "4", "--stages", "2",
                           "--plan-only"]) == 2
    assert "--stages 2 needs --strategy pipeline" in capsys.readouterr().err
    out = tmp_path / "rm1"
    assert partition_main(["--model", "rm1", "--max-rows", "1000", "--cards", "4", "--strategy", "pipeline",
                           "--stages", "2", "--plan-only", "--out", str(out), "--draw", str(tmp_path / "p.png")]) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert sorted(p["name"] for p in plan["partitions"] if p["kind"] == "dense") == ["dense.0", "dense.1"]
    assert (tmp_path / "p.png").is_file()
