"""Embedding tables on cards: shard planning, the plan's round trip, and the sharded stage's outputs and timing."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sixfold import models
from sixfold.backends.api import DoesNotFit
from sixfold.backends.host.host_embedding import HostEmbeddingStage
from sixfold.backends.builtin.sharded_embedding import ShardedEmbeddingStage, load_sharded_stage
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.plan import DeviceInfo, PartitionPlan
from sixfold.partitioner.placement.sharding import (MODES, hot_row_share, host_table_arrays, lookup_seconds, plan_shards,
                                  shard_tables)
from sixfold.partitioner.placement.strategy import ACTIVATION_HEADROOM, PlanError

CARD = load_spec("m2-card")
HOST_SPEC = load_spec("host-cpu")
HOST = DeviceInfo(id="host", spec=HOST_SPEC)


@pytest.fixture(scope="module")
def rm1():
    """rm1 capped at 2000 rows: 8 tables x 2000 x 32 fp32 (250 KiB each), pooling 80, on 6 cards."""
    return partition_builtin("rm1", max_rows=2000, cards=6)


def _copy(partitioned, **card_changes):
    """The partitioned model with a fresh copy of its plan (cards' specs changed by ``card_changes``)."""
    plan = PartitionPlan.from_dict(partitioned.plan.to_dict())
    if card_changes:
        plan.devices = [d if d.id == "host" else DeviceInfo(d.id, dataclasses.replace(d.spec, **card_changes))
                        for d in plan.devices]
    return dataclasses.replace(partitioned, plan=plan)


def _request(config, rows: int, seed: int = 3) -> dict[str, np.ndarray]:
    r = models.RequestGenerator.for_config(config, seed=seed).make(rows)
    return {"sparse_lengths": r["sparse_lengths"], "sparse_indices": r["sparse_indices"]}


def _stage(partitioned, **kwargs) -> ShardedEmbeddingStage:
    plan = partitioned.plan
    specs = {d.id: d.spec for d in plan.devices if d.id != "host"}
    return load_sharded_stage(plan, host_table_arrays(partitioned), plan.device("host").spec, specs, **kwargs)


def _covered_once(shards, rows: list[int], dim: int) -> bool:
    counts = [np.zeros((r, dim), np.int32) for r in rows]
    for s in shards:
        counts[s.table][s.row_start:s.row_end, s.col_start:s.col_end] += 1
    return all((c == 1).all() for c in counts)


# ---- planning ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, max_ratio", [("table", 2.0), ("row", 1.05), ("column", 1.25)])
def test_each_mode_fits_card_memory_and_balances_lookup_cost(rm1, mode, max_ratio) -> None:
    model, partitioned = rm1
    partitioned = _copy(partitioned)
    result = shard_tables(partitioned, mode)
    plan = partitioned.plan
    assert result.mode == mode and plan.shards == result.shards
    assert {s.kind for s in plan.shards} == {mode} and not result.host_tables
    assert _covered_once(plan.shards, plan.tables["rows"], plan.tables["dim"])
    dense_need = plan.partition(DENSE_PARTITION).param_bytes * ACTIVATION_HEADROOM
    for device, used in result.bytes_used.items():
        assert used + dense_need <= plan.device(device).spec.memory_bytes
    loads = [result.loads[f"card{i}"] for i in range(6)]
    # 8 equal tables on 6 cards: table-wise is 2 vs 1 at best; row-wise splits every table 6 ways.
    assert max(loads) / min(loads) <= max_ratio
    if mode != "table":
        # A table's blocks are on distinct cards.
        for t in range(8):
            devices = [s.device for s in plan.shards if s.table == t]
            assert len(devices) == len(set(devices)) > 1
    # The plan now says the cards hold the tables and the host does not.
    per_device = {d.device: d for d in plan.estimates.per_device}
    assert HOST_PARTITION in per_device["card0"].partitions
    assert per_device["card0"].memory_bytes >= result.bytes_used["card0"]
    assert per_device["host"].batch_seconds == 0.0


def test_balance_over_many_tables_is_tight() -> None:
    # rm2's shape (32 tables x 500K x 64, pooling 120) as plain data: no model needed.
    facts = {"rows": [500_000] * 32, "dim": 64, "pooling": [120] * 32, "zipf": 1.05}
    cards = [DeviceInfo(f"card{i}", CARD) for i in range(6)]
    result = plan_shards(facts, cards, {c.id: CARD.memory_bytes for c in cards}, "table", host=HOST)
    loads = [result.loads[c.id] for c in cards]
    assert max(loads) / min(loads) <= 6 / 5 + 1e-9  # 32 tables: 6, 6, 5, 5, 5, 5
    assert sum(result.bytes_used.values()) == 32 * 500_000 * 64 * 4


def test_skew_makes_row_shards_cost_more_than_their_row_share() -> None:
    assert hot_row_share(2000, 1.05) == pytest.approx((2 ** -0.05 - 1) / (2000 ** -0.05 - 1))
    assert hot_row_share(1000, 0.0) == pytest.approx(1e-3)
    cards = [DeviceInfo(f"card{i}", CARD) for i in range(4)]
    free = {c.id: CARD.memory_bytes for c in cards}
    flat = plan_shards({"rows": [100_000], "dim": 32, "pooling": [50], "zipf": 0.0}, cards, free, "row")
    skewed = plan_shards({"rows": [100_000], "dim": 32, "pooling": [50], "zipf": 1.2}, cards, free, "row")
    assert skewed.bottleneck_seconds > flat.bottleneck_seconds
    # Uniform ids: a quarter of the rows gets a quarter of the lookups.
    quarter = lookup_seconds(CARD, 256 * 50 / 4, 32, 256)
    assert flat.shards[0].est_seconds == pytest.approx(quarter, rel=1e-3)


def test_leftovers_stay_on_the_host_when_cards_are_small(rm1) -> None:
    model, partitioned = rm1
    dense = partitioned.plan.partition(DENSE_PARTITION).param_bytes
    # Room for the dense replica and one 250 KiB table per card: 6 tables on cards, 2 on the host.
    small = _copy(partitioned, memory_bytes=int(dense * ACTIVATION_HEADROOM) + 300 * 1024)
    result = shard_tables(small, "table")
    assert len(result.host_tables) == 2
    assert sum(1 for s in result.shards if s.device != "host") == 6
    assert any("stays on the host" in n and "KiB" in n for n in result.notes)
    assert small.plan.estimates.per_device[0].batch_seconds > 0  # the host still looks up 2 tables
    # The stage serves the mix: host tables and card tables, the same bags as the all-host stage.
    stage = _stage(small)
    request = _request(model.config, 33)
    expected = HostEmbeddingStage(host_table_arrays(small)).run_numpy(*request.values())
    np.testing.assert_allclose(stage.run(request)["host_embedding_bag"], expected, rtol=0, atol=1e-6)
    assert stage.memory_bytes() == 2 * 2000 * 32 * 4
    stage.close()


def test_auto_picks_the_lowest_bottleneck(rm1) -> None:
    _, partitioned = rm1
    plans = {m: shard_tables(_copy(partitioned), m) for m in MODES}
    auto = shard_tables(_copy(partitioned), "auto")
    assert auto.bottleneck_seconds == pytest.approx(min(p.bottleneck_seconds for p in plans.values()))
    assert auto.notes[-1].startswith("auto: bottleneck table")


def test_impossible_requests_raise_plan_errors_with_numbers() -> None:
    cards = [DeviceInfo(f"card{i}", CARD) for i in range(6)]
    free = {c.id: 1 << 30 for c in cards}
    with pytest.raises(PlanError, match="dim 7 and there are 6 card"):
        plan_shards({"rows": [10], "dim": 7, "pooling": [1]}, cards, free, "column")
    with pytest.raises(PlanError, match="at least one card"):
        plan_shards({"rows": [10], "dim": 8, "pooling": [1]}, [], {}, "table")
    # 2M rows x 4 B over 6 cards: row ranges of 1.3 MiB, cards with 1 MiB free.
    with pytest.raises(PlanError, match=r"no table fits.*needs 1\.3 MiB; the most free card, card0, has 1\.0 MiB"):
        plan_shards({"rows": [2_000_000], "dim": 1, "pooling": [1]}, cards, {c.id: 1 << 20 for c in cards}, "row")
    with pytest.raises(PlanError, match="auto: no mode"):
        plan_shards({"rows": [10], "dim": 8, "pooling": [1]}, cards, {c.id: 0 for c in cards}, "auto")
    with pytest.raises(PlanError, match="lack 'pooling'"):
        plan_shards({"rows": [10], "dim": 8}, cards, free, "table")


def test_quantized_tables_are_refused_for_cards(rm1) -> None:
    _, partitioned = rm1
    partitioned = _copy(partitioned)
    partitioned.plan.tables["precision"] = "int8"
    with pytest.raises(ValueError, match="fp32 or fp16 tables; these are int8"):
        shard_tables(partitioned, "table")


# ---- the plan on disk ----------------------------------------------------------------------------


def test_plan_with_shards_round_trips_and_old_plans_still_load(rm1, tmp_path) -> None:
    _, partitioned = rm1
    partitioned = _copy(partitioned)
    shard_tables(partitioned, "row")
    plan = partitioned.plan
    assert PartitionPlan.from_json(plan.to_json()) == plan
    old = json.loads(plan.to_json())
    del old["shards"]
    assert PartitionPlan.from_dict(old).shards == []


def test_cli_writes_and_explains_the_shards(tmp_path, capsys) -> None:
    rc = partition_main(["--model", "rm1", "--max-rows", "2000", "--cards", "4", "--sparse-on-cards", "column",
                         "--out", str(tmp_path)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "column-wise on cards" in text and "t0[c0:8]" in text and "table lookups bottleneck" in text
    plan = PartitionPlan.load(tmp_path / "plan.json")
    assert len(plan.shards) == 8 * 4 and {s.device for s in plan.shards} == {f"card{i}" for i in range(4)}


# ---- the sharded stage ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_sharded_stage_equals_the_host_stage(rm1, mode) -> None:
    model, partitioned = rm1
    partitioned = _copy(partitioned)
    shard_tables(partitioned, mode)
    stage = _stage(partitioned)
    reference = HostEmbeddingStage(host_table_arrays(partitioned))
    for rows in (1, 40):
        request = _request(model.config, rows, seed=rows)
        expected = reference.run_numpy(*request.values())
        out = stage.run(request)["host_embedding_bag"]
        assert out.shape == expected.shape == (rows * 8, 32)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)
    assert sum(stage.card_memory_bytes().values()) == 8 * 2000 * 32 * 4
    stage.close()


async def test_cards_are_occupied_for_their_modelled_lookup_time(rm1) -> None:
    model, partitioned = rm1
    partitioned = _copy(partitioned)
    result = shard_tables(partitioned, "table")
    now = [0.0]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    stage = _stage(partitioned, clock=lambda: now[0], sleep=sleep)
    request = _request(model.config, 256)
    out = await stage.infer(request)
    expected = HostEmbeddingStage(host_table_arrays(partitioned)).run_numpy(*request.values())
    np.testing.assert_allclose(out["host_embedding_bag"], expected, rtol=0, atol=1e-6)
    stats = stage.card_stats()
    lengths = request["sparse_lengths"]
    for device, blocks in stage.card_blocks.items():
        ids = int(sum(lengths[:, b.table].sum() for b in blocks))
        # simcard's formula on this batch's real traffic: ids and lengths in, gather, pooled blocks out.
        link_in = CARD.transfer_seconds(ids * 8 + 256 * len(blocks) * 4)
        link_out = CARD.transfer_seconds(256 * 32 * 4 * len(blocks))
        gather = CARD.compute_seconds(ids * 32, ids * (32 * 4 + 8))
        assert stats[device].modelled_busy_s == pytest.approx(link_in + gather + link_out, rel=1e-9)
        # ... which the plan's estimate predicts (pooling is random around its mean of 80).
        assert stats[device].modelled_busy_s == pytest.approx(result.loads[device], rel=0.15)
    assert max(waits) == pytest.approx(max(s.modelled_busy_s for s in stats.values()))
    stage.close()


def test_sharded_stage_refuses_blocks_beyond_card_memory(rm1) -> None:
    _, partitioned = rm1
    partitioned = _copy(partitioned)
    shard_tables(partitioned, "table")
    with pytest.raises(DoesNotFit, match=r"card0 need 500\.0 KiB; device m2-card has 100\.0 KiB free"):
        _stage(partitioned, card_free_bytes={f"card{i}": 100 * 1024 for i in range(6)})


def test_fp16_card_blocks_match_the_fp16_host_stage() -> None:
    rng = np.random.default_rng(0)
    tables = [rng.standard_normal((r, 8)).astype(np.float32) for r in (30, 7, 50)]
    blocks = [{"table": 0, "device": "card0", "row_start": 0, "row_end": 12, "col_start": 0, "col_end": 8},
              {"table": 0, "device": "card1", "row_start": 12, "row_end": 30, "col_start": 0, "col_end": 8},
              {"table": 2, "device": "card0", "row_start": 0, "row_end": 50, "col_start": 0, "col_end": 4},
              {"table": 2, "device": "card1", "row_start": 0, "row_end": 50, "col_start": 4, "col_end": 8}]
    stage = ShardedEmbeddingStage(tables, blocks, HOST_SPEC, {"card0": CARD, "card1": CARD}, precision="fp16")
    lengths = rng.integers(0, 5, size=(9, 3)).astype(np.int32)
    ids = np.concatenate([rng.integers(0, (30, 7, 50)[t], size=n) for n, t in
                          zip(lengths.reshape(-1), np.tile(np.arange(3), 9))]).astype(np.int64)
    expected = HostEmbeddingStage(tables, "fp16").run_numpy(lengths, ids)
    out = stage.run({"sparse_lengths": lengths, "sparse_indices": ids})["host_embedding_bag"]
    np.testing.assert_allclose(out, expected, rtol=2e-3, atol=2e-3)
    stage.close()


def test_blocks_that_do_not_tile_a_table_are_refused() -> None:
    tables = [np.zeros((10, 4), np.float32)]
    gap = [{"table": 0, "device": "card0", "row_start": 0, "row_end": 4, "col_start": 0, "col_end": 4},
           {"table": 0, "device": "card1", "row_start": 5, "row_end": 10, "col_start": 0, "col_end": 4}]
    with pytest.raises(ValueError, match=r"cover rows 0:10 once each.*\(0, 4\), \(5, 10\)"):
        ShardedEmbeddingStage(tables, gap, HOST_SPEC, {"card0": CARD, "card1": CARD})


# ---- property: any tables, any cards -------------------------------------------------------------


@st.composite
def _cases(draw):
    t_count = draw(st.integers(1, 5))
    dim = draw(st.sampled_from([2, 4, 6, 8, 12]))
    rows = draw(st.lists(st.integers(1, 60), min_size=t_count, max_size=t_count))
    pooling = draw(st.lists(st.integers(0, 6), min_size=t_count, max_size=t_count))
    zipf = draw(st.sampled_from([0.0, 0.9, 1.0, 1.05, 1.5]))
    n_cards = draw(st.integers(1, 4))
    free = draw(st.lists(st.integers(0, 60 * 12 * 4), min_size=n_cards, max_size=n_cards))
    mode = draw(st.sampled_from([*MODES, "auto"]))
    items = draw(st.integers(0, 6))
    seed = draw(st.integers(0, 2**16))
    return {"rows": rows, "dim": dim, "pooling": pooling, "zipf": zipf}, free, mode, items, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_any_plan_covers_every_table_once_fits_and_serves_the_same_bags(case) -> None:
    facts, free_list, mode, items, seed = case
    cards = [DeviceInfo(f"card{i}", CARD) for i in range(len(free_list))]
    free = {c.id: f for c, f in zip(cards, free_list)}
    try:
        result = plan_shards(facts, cards, free, mode, host=HOST, batch_rows=16)
    except PlanError:
        assume(False)
        return
    assert _covered_once(result.shards, facts["rows"], facts["dim"])
    for device, used in result.bytes_used.items():
        if device != "host":
            assert used <= free[device]
            assert used == sum(s.bytes for s in result.shards if s.device == device)
    rng = np.random.default_rng(seed)
    tables = [rng.standard_normal((r, facts["dim"])).astype(np.float32) for r in facts["rows"]]
    lengths = rng.integers(0, 5, size=(items, len(tables))).astype(np.int32)
    ids = np.concatenate([np.zeros(0, np.int64)] + [
        rng.integers(0, facts["rows"][t], size=n) for n, t in zip(lengths.reshape(-1), np.tile(np.arange(len(tables)), items))
    ]).astype(np.int64)
    stage = ShardedEmbeddingStage(tables, result.shards, HOST_SPEC, {c.id: CARD for c in cards},
                                  card_free_bytes=free)
    expected = HostEmbeddingStage(tables).run_numpy(lengths, ids)
    out = stage.run({"sparse_lengths": lengths, "sparse_indices": ids})["host_embedding_bag"]
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-6)
    stage.close()
