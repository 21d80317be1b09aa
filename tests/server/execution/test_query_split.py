"""A batch is split across cards when a card cannot take it, or when cards sit idle; the parts rejoin in order."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sixfold import models
from sixfold.backends.builtin.simcard import SimCardBackend
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION
from sixfold.server.scheduling.batcher import BatchInfo
from sixfold.server.loading.loader import load_host_stage
from sixfold.server.execution.runtime import PlanRuntime


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=300, cards=2)


def _runtime(rm1, cards: int, **options) -> PlanRuntime:
    _, partitioned = rm1
    spec = load_spec("m2-card")
    dense = partitioned.artifacts[DENSE_PARTITION]
    backend = SimCardBackend()
    lanes = [backend.load(dense, dataclasses.replace(spec, name=f"m2/card{i}")) for i in range(cards)]
    return PlanRuntime(load_host_stage(partitioned, load_spec("host-cpu")), lanes, host_dense_max_rows=0, **options)


def _batch(items: int, seed: int) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=seed).make(items)


def _expected(rm1, batch) -> np.ndarray:
    model, _ = rm1
    with torch.inference_mode():
        return model(*[torch.from_numpy(batch[k]) for k in ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


def _rows_per_card(runtime: PlanRuntime) -> list[int]:
    return [load.rows for load in runtime.router.loads]


async def test_a_query_larger_than_a_card_is_split_in_equal_parts_and_reassembled(rm1) -> None:
    runtime = _runtime(rm1, 2, max_card_rows=16, min_split_rows=0)
    batch = _batch(50, seed=5)  # 4 parts of <= 16 items: 13 + 13 + 12 + 12, not 16 + 16 + 16 + 2
    out = await runtime.run(batch, BatchInfo())
    np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert [load.batches for load in runtime.router.loads] == [2, 2]  # both cards took a share
    assert sorted(_rows_per_card(runtime)) == [25, 25]
    runtime.close()


@pytest.mark.parametrize("counted", [True, False], ids=["batcher-counted", "uncounted"])
async def test_a_split_query_counts_items_not_ids_whatever_the_input_order(rm1, counted: bool) -> None:
    """KServe v2 lets a client send sparse_indices first; its length is the ids', not the items'."""
    runtime = _runtime(rm1, 2, max_card_rows=16, min_split_rows=0)
    batch = _batch(40, seed=6)
    ids_first = {name: batch[name] for name in ("sparse_indices", "sparse_lengths", "dense_features")}
    out = await runtime.run(ids_first, BatchInfo(rows=40) if counted else BatchInfo())
    np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert sum(_rows_per_card(runtime)) == 40
    runtime.close()


async def test_idle_cards_share_a_batch_a_card_could_take_alone(rm1) -> None:
    runtime = _runtime(rm1, 4, max_card_rows=256, min_split_rows=16)
    batch = _batch(50, seed=7)  # 4 idle cards, but parts of >= 16 items: 3 parts
    info = BatchInfo()
    out = await runtime.run(batch, info)
    np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert sorted(_rows_per_card(runtime)) == [0, 16, 17, 17]
    assert info.timings["card"] >= 0
    runtime.close()


async def test_without_idle_splitting_a_batch_a_card_can_take_stays_whole(rm1) -> None:
    runtime = _runtime(rm1, 4, max_card_rows=256, min_split_rows=0)
    await runtime.run(_batch(50, seed=8), BatchInfo())
    assert sorted(_rows_per_card(runtime)) == [0, 0, 0, 50]
    runtime.close()


def test_busy_cards_are_not_split_onto_and_small_batches_stay_whole(rm1) -> None:
    runtime = _runtime(rm1, 6, max_card_rows=100, min_split_rows=10, card_scheduling="greedy")
    assert runtime.parts(19) == 1  # under 2 x min_split_rows
    assert runtime.parts(20) == 2
    assert runtime.parts(1000) == 10  # over max_card_rows: as many parts as it takes, idle or not
    assert runtime.parts(600) == 6  # six idle cards
    for load in runtime.router.loads[:4]:
        load.outstanding_rows = 5  # four cards busy: two idle
    assert runtime.parts(600) == 6  # still needs six parts of <= 100
    assert runtime.parts(150) == 2
    runtime.router.mark_down(5)  # an idle card out of rotation does not count
    assert runtime.parts(150) == 2  # max_card_rows needs two
    assert runtime.parts(90) == 1
    runtime.close()


def test_a_negative_min_split_rows_is_refused(rm1) -> None:
    _, partitioned = rm1
    host = load_host_stage(partitioned, load_spec("host-cpu"))
    with pytest.raises(ValueError, match="min_split_rows must be >= 0"):
        PlanRuntime(host, [host], min_split_rows=-1)
    host.close()


async def test_a_pipelined_batch_runs_its_host_stage_in_chunks_and_matches_the_whole(rm1) -> None:
    runtime = _runtime(rm1, 2, max_card_rows=None, min_split_rows=0, host_chunk_rows=16)
    batch = _batch(50, seed=8)  # chunks of 17, 17, 16 items (ids cut where items end)
    info = BatchInfo(rows=50)
    out = await runtime.run(batch, info)
    np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert info.timings["host_chunks"] == 3 and sum(_rows_per_card(runtime)) == 50
    small = BatchInfo(rows=31)  # under twice the chunk size: whole
    out = await runtime.run(_batch(31, seed=9), small)
    assert out["scores"].shape == (31, 1) and "host_chunks" not in small.timings
    runtime.close()
    with pytest.raises(ValueError, match="host_chunk_rows"):
        _runtime(rm1, 1, host_chunk_rows=-1)


async def test_the_card_stage_of_a_chunk_overlaps_the_host_stage_of_the_next(rm1) -> None:
    """Scripted stages: chunk 1's host stage does not finish until chunk 0's card stage has started."""
    import asyncio

    runtime = _runtime(rm1, 2, max_card_rows=None, min_split_rows=0, host_chunk_rows=10)
    events: list[str] = []
    card_started = asyncio.Event()
    real_host = runtime._host_runner.infer

    async def host(inputs, rows):
        k = sum(e.startswith("host") for e in events)
        if k == 1:
            await asyncio.wait_for(card_started.wait(), 5.0)  # would time out if chunks ran one after another
        events.append(f"host{k}")
        return await real_host(inputs, rows)

    async def card(card_inputs, rows, timings=None):
        events.append(f"card{sum(e.startswith('card') for e in events)}")
        card_started.set()
        await asyncio.sleep(0)
        return 0, {"scores": np.zeros((rows, 1), dtype=np.float32)}

    runtime._host_runner.infer = host
    runtime._dense_on_cards = card
    out = await runtime.run(_batch(20, seed=10), BatchInfo(rows=20))
    assert out["scores"].shape == (20, 1)
    assert events == ["host0", "card0", "host1", "card1"]
    runtime.close()


async def test_fifo_cards_split_every_batch_over_all_the_cards_even_when_batches_overlap(rm1) -> None:
    """Two batches at once: each waits its turn for the 4 cards and runs on all of them, not on what is idle."""
    import asyncio

    runtime = _runtime(rm1, 4, max_card_rows=256, min_split_rows=16, card_scheduling="fifo")
    batches = [_batch(64, seed=11), _batch(64, seed=12)]
    infos = [BatchInfo(rows=64), BatchInfo(rows=64)]
    outs = await asyncio.gather(*(runtime.run(b, i) for b, i in zip(batches, infos)))
    for batch, out in zip(batches, outs):
        np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert _rows_per_card(runtime) == [32, 32, 32, 32]  # 4 parts of 16 from each
    assert all("card_wait_s" in info.timings for info in infos)
    assert runtime.card_gate is not None and runtime.card_gate.held == 0
    runtime.close()
    with pytest.raises(ValueError, match="card_scheduling must be one of fifo, greedy"):
        _runtime(rm1, 1, card_scheduling="random")
