"""The model zoo: deterministic weights, canonical forward, torch.export with dynamic sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sixfold import models
from sixfold.models import DENSE, INDICES, LENGTHS


def _inputs(config: models.ModelConfig, items: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return models.example_inputs(config, items=items, seed=seed)


@pytest.mark.parametrize("name", models.names())
def test_every_builtin_model_scores_a_request(name: str) -> None:
    model = models.build(name, max_rows=200)
    scores = model(*_inputs(model.config, 5))
    assert scores.shape == (5, 1)
    assert torch.all((scores > 0) & (scores < 1))


def test_same_seed_same_model_other_seed_other_model() -> None:
    a, b = models.build("rm2", max_rows=300, seed=1), models.build("rm2", max_rows=300, seed=1)
    c = models.build("rm2", max_rows=300, seed=2)
    x = _inputs(a.config, 9)
    assert torch.equal(a(*x), b(*x))
    assert not torch.allclose(a(*x), c(*x))


def test_rows_are_capped_and_shapes_follow_the_published_configs() -> None:
    model = models.build("rm2", max_rows=123)
    assert model.config.table_rows == (123,) * 32
    assert model.embeddings.weight.shape == (123 * 32, 64)
    assert models.get_config("dlrm-mlperf").table_rows[0] == 39884406


def test_a_model_that_cannot_fit_is_refused_with_the_numbers() -> None:
    with pytest.raises(MemoryError, match=r"GiB.*max_rows"):
        models.build("dlrm-mlperf")


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match="rm1, rm2"):
        models.build("rm9")


def test_exported_program_has_dynamic_batch_and_id_count() -> None:
    model = models.build("rm1", max_rows=500)
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    program = torch.export.export(model, _inputs(model.config, 4), dynamic_shapes={
        DENSE: {0: batch}, LENGTHS: {0: batch}, INDICES: {0: ids}})
    exported = program.module()
    for items in (1, 13, 70):
        x = _inputs(model.config, items, seed=items)
        torch.testing.assert_close(exported(*x), model(*x))


def test_pooling_matches_a_per_table_reference() -> None:
    """The table-batched lookup equals summing each table's rows sample by sample."""
    model = models.build("rm1", max_rows=50)
    dense, lengths, ids = _inputs(model.config, 3)
    pooled = model.embeddings(lengths, ids).view(3, 8, 32)
    weight, offsets = model.embeddings.weight, model.embeddings.table_offsets
    cursor = 0
    for sample in range(3):
        for table in range(8):
            n = int(lengths[sample, table])
            rows = ids[cursor:cursor + n] + offsets[table]
            torch.testing.assert_close(pooled[sample, table], weight[rows].sum(0))
            cursor += n


class TestRequests:
    def test_lengths_and_ids_agree_and_ids_stay_in_their_table(self) -> None:
        config = models.get_config("dcnv2-mlperf", max_rows=1000)
        gen = models.RequestGenerator.for_config(config, seed=3)
        request = gen.make(40)
        lengths, ids = request[LENGTHS], request[INDICES]
        assert lengths.dtype == np.int32 and ids.dtype == np.int64 and request[DENSE].dtype == np.float32
        assert lengths.sum() == ids.size
        table = np.repeat(np.tile(np.arange(26), 40), lengths.ravel())
        assert np.all(ids >= 0) and np.all(ids < np.asarray(config.table_rows)[table])

    def test_one_hot_tables_get_exactly_one_id(self) -> None:
        gen = models.RequestGenerator.for_config(models.get_config("dlrm-mlperf", max_rows=100))
        assert np.all(gen.make(10)[LENGTHS] == 1)

    def test_ids_follow_a_power_law(self) -> None:
        gen = models.RequestGenerator((100_000,), 4, (1000,), zipf=1.05, seed=0)
        ids = gen.make(50)[INDICES]
        _, counts = np.unique(ids, return_counts=True)
        top = np.sort(counts)[::-1][:1000].sum()  # the hottest 1% of rows
        assert top / ids.size > 0.4, "a few hot rows should take most lookups"

    def test_same_seed_same_requests(self) -> None:
        config = models.get_config("rm2", max_rows=100)
        a = models.RequestGenerator.for_config(config, seed=7).make(5)
        b = models.RequestGenerator.for_config(config, seed=7).make(5)
        assert all(np.array_equal(a[k], b[k]) for k in a)

    def test_query_sizes(self) -> None:
        rng = np.random.default_rng(0)
        sizes = models.parse_query_sizes("mlperf").sample(rng, 5000)
        assert set(np.unique(sizes)) <= set(models.requests.MLPERF_QUANTILES)
        assert 250 < sizes.mean() < 290  # the table's mean is 270
        assert np.all(models.parse_query_sizes("fixed:17").sample(rng, 10) == 17)
        for bad in ("fixed:0", "fixed:x", "lognormal", ""):
            with pytest.raises(ValueError, match="query size"):
                models.parse_query_sizes(bad)
