"""The runtime splits a batch across cards only as the plan's layouts say (issue 31 item 2): a ragged card
input keeps batches whole, a per-item one splits them, a length that disagrees with its layout fails the
batch (never the card), and an artifact without layouts is never split."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import pytest
import torch

from sixfold.backends.api import Arrays, Executable
from sixfold.backends.builtin.torch_backend import TorchBackend
from sixfold.backends.spec_catalog import load_spec
from sixfold.server.errors import InternalError
from sixfold.server.execution.card_split import CardSplit
from sixfold.server.execution.runtime import PlanRuntime
from sixfold.server.loading.loader import load_host_stage
from sixfold.server.scheduling.batcher import BatchInfo
from tests.partitioner.cut.test_cross_cut import IndexAddPool, _partition, _request

ITEMS = 700


@pytest.fixture(scope="module")
def models():
    """(model, partitioned) with the pooling moved to the host, and with it stuck on the cards (ragged)."""
    per_item, ragged = IndexAddPool(), IndexAddPool(pool_last=True)
    return {"per_item": (per_item, _partition(per_item, one_hot=False)),
            "ragged": (ragged, _partition(ragged, one_hot=False))}


class ShortHost(Executable):
    """A real host stage whose boundary tensor loses its last row: a model/plan disagreement."""

    def __init__(self, inner: Executable) -> None:
        super().__init__(inner.artifact, inner.device)
        self.inner = inner

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        return {n: a[:-1] for n, a in self.inner.run(inputs).items()}


def _runtime(partitioned, host: Executable | None = None, cards: int = 2, **options) -> PlanRuntime:
    backend, spec = TorchBackend(), load_spec("m2-card")
    dense = partitioned.artifact_for("dense", backend)
    lanes = [backend.load(dense, dataclasses.replace(spec, name=f"m2/card{i}")) for i in range(cards)]
    host = host or load_host_stage(partitioned, load_spec("host-cpu"))
    return PlanRuntime(host, lanes, host_dense_max_rows=0, min_split_rows=64, card_scheduling="greedy", **options)


def _batch(items: int, seed: int) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in _request(items, seed, one_hot=False).items()}


def _want(model, batch) -> np.ndarray:
    with torch.inference_mode():
        return model(*(torch.from_numpy(batch[k]) for k in batch)).numpy()


async def test_a_per_item_card_input_splits_a_large_batch_over_the_cards(models) -> None:
    model, partitioned = models["per_item"]
    runtime = _runtime(partitioned)
    try:
        assert runtime.card_split.splittable and runtime.parts(ITEMS) == 2
        batch = _batch(ITEMS, seed=1)
        out = await runtime.run(batch, BatchInfo())
        np.testing.assert_allclose(out["scores"], _want(model, batch), rtol=1e-5, atol=1e-6)
        assert [load.batches for load in runtime.router.loads] == [1, 1]
    finally:
        runtime.close()


async def test_a_ragged_card_input_keeps_every_batch_whole_on_one_card(models) -> None:
    model, partitioned = models["ragged"]
    runtime = _runtime(partitioned)
    try:
        assert "'host_embedding' is ragged" in runtime.card_split.why_not and runtime.parts(ITEMS) == 1
        for items, seed in ((ITEMS, 2), (1, 3), (129, 4)):  # 129 items: ids rarely a multiple of 129
            batch = _batch(items, seed)
            out = await runtime.run(batch, BatchInfo())  # was: cannot split card input ... or a wrong split
            np.testing.assert_allclose(out["scores"], _want(model, batch), rtol=1e-5, atol=1e-6)
        assert sum(load.batches for load in runtime.router.loads) == 3
        assert runtime.card_state == ["healthy", "healthy"] and not runtime.fault_counts
    finally:
        runtime.close()


async def test_a_length_that_disagrees_with_its_layout_fails_the_batch_not_the_card(models) -> None:
    _, partitioned = models["per_item"]
    host = ShortHost(load_host_stage(partitioned, load_spec("host-cpu")))
    runtime = _runtime(partitioned, host=host, max_inline_s=0)
    try:
        with pytest.raises(InternalError, match=r"card input 'host_index_add' has 699 rows for a 700-item batch; "
                                                r"its layout says 1 row\(s\) per item"):
            await runtime.run(_batch(ITEMS, seed=5), BatchInfo())
        assert runtime.card_state == ["healthy", "healthy"] and not runtime.fault_counts
        assert all(load.healthy for load in runtime.router.loads)
    finally:
        runtime.close()


def test_an_artifact_without_layouts_is_never_split(models) -> None:
    _, partitioned = models["per_item"]
    bare = dataclasses.replace(partitioned.artifacts["dense"], layouts={})
    split = CardSplit(bare)
    assert not split.splittable and "has no recorded layout" in split.why_not
    with pytest.raises(InternalError, match="batches go to one card whole"):
        split.pieces({"x": np.zeros(4)}, 4, [(0, 2), (2, 4)])
    whole = {"dense_features": np.zeros((4, 5), np.float32)}
    assert split.head(whole, 4, 1)["dense_features"].shape == (4, 5)  # a probe gets the whole batch
