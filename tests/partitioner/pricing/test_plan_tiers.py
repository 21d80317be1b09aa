"""plan.json carries the tier pricing of `sixfold-partition --table-memory`; `show` prints it; old plans still load."""

from __future__ import annotations

import json

import pytest

from sixfold.partitioner.cli import main
from sixfold.partitioner.plan import PartitionPlan
from sixfold.partitioner.pricing.tiers import DiskSpec, TierPricing


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm1")
    disk = out.parent / "disk.json"
    disk.write_text(DiskSpec("test-disk", read_latency_s=1e-4, iops=50_000, depth=8).to_json())
    assert main(["--model", "rm1", "--max-rows", "300", "--cards", "1", "--plan-only", "--out", str(out),
                 "--table-memory", "50%", "--table-memory", "100KiB", "--zipf", "1.2", "--disk-spec", str(disk)]) == 0
    return out / "plan.json"


def test_the_plan_stores_the_tier_estimates(priced):
    raw = json.loads(priced.read_text())["tiers"]
    assert raw["budgets"] == ["50%", "100KiB"] and raw["alpha"] == 1.2 and raw["disk"]["name"] == "test-disk"
    plan = PartitionPlan.load(priced)
    tiers = plan.tiers
    assert isinstance(tiers, TierPricing) and tiers.disk == DiskSpec("test-disk", 1e-4, 50_000, 8)
    assert tiers.items == plan.estimates.batch_rows
    rows, dim = plan.tables["rows"], plan.tables["dim"]
    assert tiers.table_bytes == sum(rows) * dim * 4 and tiers.row_bytes == dim * 4
    half, small = tiers.estimates
    assert half.budget_bytes == tiers.table_bytes // 2 and small.budget_bytes == 100 * 1024
    assert 0 < small.hit_rate < half.hit_rate <= 1 and half.reads_per_batch < small.reads_per_batch
    host = next(d for d in plan.estimates.per_device if d.device == "host")
    assert tiers.resident_seconds == pytest.approx(host.batch_seconds)
    for e in tiers.estimates:  # host time = resident + distinct misses / IOPS + one read latency
        assert e.read_seconds == pytest.approx(e.reads_per_batch / 50_000 + (1e-4 if e.reads_per_batch > 0 else 0))
        assert e.host_seconds == pytest.approx(tiers.resident_seconds + e.read_seconds)


def test_a_priced_plan_round_trips(priced, tmp_path):
    plan = PartitionPlan.load(priced)
    plan.save(tmp_path / "again.json")
    again = PartitionPlan.load(tmp_path / "again.json")
    assert again == plan and again.to_dict() == plan.to_dict()


@pytest.mark.parametrize("old", ["absent", "null"])
def test_a_plan_without_tiers_still_loads(priced, tmp_path, old):
    data = json.loads(priced.read_text())
    if old == "absent":
        del data["tiers"]  # a plan written before the field existed
    else:
        data["tiers"] = None
    (tmp_path / "plan.json").write_text(json.dumps(data))
    plan = PartitionPlan.load(tmp_path / "plan.json")
    assert plan.tiers is None and plan.tables == data["tables"]
    plan.save(tmp_path / "saved.json")
    assert json.loads((tmp_path / "saved.json").read_text())["tiers"] is None


def test_show_prints_the_saved_plan_with_its_tier_table(priced, tmp_path, capsys):
    assert main(["show", str(priced.parent)]) == 0  # the version folder
    out = capsys.readouterr().out
    assert "rm1: replicate" in out and "bottleneck" in out
    assert "table tiers (priced with the plan)" in out and "Zipf 1.2" in out and "test-disk" in out
    assert "50%" in out and "100.0 KiB" in out
    data = json.loads(priced.read_text())
    del data["tiers"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert main(["show", str(tmp_path / "old.json")]) == 0
    out = capsys.readouterr().out
    assert "bottleneck" in out and "table tiers" not in out


def test_show_refuses_a_missing_or_unreadable_plan(tmp_path, capsys):
    assert main(["show", str(tmp_path / "absent")]) == 2
    assert "no plan at" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("{}")
    assert main(["show", str(tmp_path / "bad.json")]) == 2
    assert "is not a readable plan" in capsys.readouterr().err


def test_measure_puts_the_measured_hit_rate_and_host_time_beside_the_tier_estimate(tmp_path, capsys):
    out = tmp_path / "measured"
    assert main(["--model", "rm1", "--max-rows", "300", "--cards", "1", "--batch-rows", "16", "--measure",
                 "--measure-seconds", "0.3", "--out", str(out), "--table-memory", "100%", "--table-memory", "100KiB",
                 "--zipf", "1.2"]) == 0
    text = capsys.readouterr().out
    assert "table tiers, plan estimate vs measured on this host" in text
    report = json.loads((out / "measure.json").read_text())
    plan = PartitionPlan.load(out / "plan.json")
    big, small = report["tiers"]
    assert [big["budget"], small["budget"]] == ["100%", "100KiB"] and report["tier_notes"] == []
    for t, priced in zip((big, small), plan.tiers.estimates):
        assert t["estimate_hit_rate"] == priced.hit_rate and t["estimate_reads"] == priced.reads_per_batch
        assert 0 < t["measured_hit_rate"] < 1 and t["measured_s"] > 0 and t["estimate_s"] > priced.read_seconds
        assert t["hit_ratio"] == pytest.approx(t["measured_hit_rate"] / t["estimate_hit_rate"])
        assert t["ratio"] == pytest.approx(t["measured_s"] / t["estimate_s"])
        assert t["items"] == 16
    # the whole table memory caches most rows; 100 KiB leaves ~70 slots after the row index and one item staged
    assert big["measured_hit_rate"] > small["measured_hit_rate"] + 0.2
    assert big["reads_per_batch"] < small["reads_per_batch"]
    # the estimate counts the slots as the store makes them: 100 KiB is mostly the row index and one item staged
    assert plan.tiers.estimates[1].cache_rows < 100
