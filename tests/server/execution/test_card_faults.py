"""A card that crashes or hangs leaves rotation, its batch is retried elsewhere, and it is restarted."""

from __future__ import annotations

import asyncio
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
from sixfold.server.errors import Unavailable
from sixfold.server.loading.loader import load_host_stage
from sixfold.server.execution.runtime import PlanRuntime


@pytest.fixture(scope="module")
def rm1():
    return partition_builtin("rm1", max_rows=300, cards=2)


def _runtime(rm1, faults: list[dict], card_timeout_s: float = 5.0, reload_faults: dict | None = None,
             **kwargs) -> PlanRuntime:
    _, partitioned = rm1
    spec = load_spec("m2-card")
    dense = partitioned.artifacts[DENSE_PARTITION]
    host = load_host_stage(partitioned, load_spec("host-cpu"))
    cards = [SimCardBackend(faults=f).load(dense, dataclasses.replace(spec, name=f"m2/card{i}"))
             for i, f in enumerate(faults)]
    healthy = SimCardBackend(faults=reload_faults or {})
    return PlanRuntime(host, cards, card_timeout_s=card_timeout_s,
                       reload_card=lambda i: healthy.load(dense, dataclasses.replace(spec, name=f"m2/new{i}")),
                       **kwargs)


def _batches(count: int):
    gen = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=2)
    return [gen.make(5 + i) for i in range(count)]


def _expected(rm1, batch) -> np.ndarray:
    model, _ = rm1
    with torch.inference_mode():
        return model(*[torch.from_numpy(batch[k]) for k in ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()


async def _until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


async def test_a_crashing_card_is_retried_elsewhere_taken_out_and_restarted(rm1) -> None:
    runtime = _runtime(rm1, [{"crash_after": 1}, {}])
    for batch in _batches(6):  # every answer is right although card0 crashes from its 2nd batch on
        out = await runtime.run(batch, BatchInfo())
        np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert runtime.router.loads[0].failures == 1
    await _until(lambda: runtime.router.loads[0].healthy)  # restarted and back in rotation
    for batch in _batches(4):
        await runtime.run(batch, BatchInfo())
    assert runtime.router.loads[0].failures == 1  # the restarted card serves again without failing
    runtime.close()


async def test_a_hung_card_times_out_and_its_batch_is_answered_by_another(rm1) -> None:
    # No hedging and no host fallback: the batch waits out card0's deadline (the 0.3 s cap), then card1 answers.
    runtime = _runtime(rm1, [{"hang": True}, {}], card_timeout_s=0.3, hedge_fraction=0, dense_fallback=False)
    runtime.router.loads[1].last_used = 10  # make card0 the first pick
    batch = _batches(1)[0]
    out = await asyncio.wait_for(runtime.run(batch, BatchInfo()), 10)
    np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    assert runtime.router.loads[0].failures == 1 and runtime.fault_counts == {(0, "hang"): 1}
    assert [load.outstanding_rows for load in runtime.router.loads] == [0, 0]
    runtime.close()


async def test_when_every_card_fails_the_batch_gets_unavailable_not_a_hang(rm1) -> None:
    runtime = _runtime(rm1, [{"crash_after": 0}, {"crash_after": 0}], reload_faults={"crash_after": 0})
    with pytest.raises(Unavailable, match="batch failed on 2 card\\(s\\): card. failed .*card. failed") as info:
        await asyncio.wait_for(runtime.run(_batches(1)[0], BatchInfo()), 10)
    assert info.value.reason == "card_error"  # the metrics label, apart from hangs
    runtime.close()


async def test_a_card_whose_backend_says_it_is_lost_leaves_rotation_for_good(rm1) -> None:
    from sixfold.backends import DeviceLost

    _, partitioned = rm1
    spec = load_spec("m2-card")
    dense = partitioned.artifacts[DENSE_PARTITION]
    cards = [SimCardBackend().load(dense, dataclasses.replace(spec, name=f"m2/card{i}")) for i in range(2)]

    class _OffTheBus(type(cards[0])):
        def run(self, feed):
            raise DeviceLost("card0 fell off the PCIe bus")

    cards[0].__class__ = _OffTheBus
    reloads = []

    def reload(index: int):
        reloads.append(index)
        return SimCardBackend().load(dense, dataclasses.replace(spec, name=f"m2/new{index}"))

    runtime = PlanRuntime(load_host_stage(partitioned, load_spec("host-cpu")), cards, card_timeout_s=5.0,
                          reload_card=reload)
    runtime.router.loads[1].last_used = 10  # card0 is picked first
    for batch in _batches(4):  # answered by card1 (the batch retried there), card0 never again
        out = await runtime.run(batch, BatchInfo())
        np.testing.assert_allclose(out["scores"], _expected(rm1, batch), atol=1e-5)
    await asyncio.sleep(0.3)
    assert not runtime.router.loads[0].healthy and reloads == []  # no close-reload-probe for a lost device
    assert runtime.card_state[0].startswith("lost for good: failed (DeviceLost: card0 fell off the PCIe bus)")
    assert runtime.router.loads[0].failures == 1
    runtime.close()
