"""--strategy pipeline never makes a stage of only weightless ops (a lone concat, the interaction's
reshapes): such a stage rides with its neighbour, and a forced stage count that cannot avoid one is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_builtin, partition_model
from sixfold.partitioner.placement.strategy import PlanError


def _learned(partitioned, stage: str) -> list[str]:
    nodes = set(partitioned.plan.partition(stage).nodes)
    return [n.name for n in partitioned.split.dense.graph.nodes if n.name in nodes and "linear" in n.name]


def test_three_stages_of_rm1_each_hold_a_learned_weight() -> None:
    _, partitioned = partition_builtin("rm1", max_rows=1000, cards=6, strategy="pipeline", stages=3, compile=False)
    stages = partitioned.plan.dense_stages()
    assert stages == ["dense.0", "dense.1", "dense.2"]
    for stage in stages:  # before: dense.1 was the interaction alone (view, cat, bmm, index_select)
        assert _learned(partitioned, stage), (stage, partitioned.plan.partition(stage).nodes)


class TwoLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(20, 4, mode="sum")
        self.first, self.second = nn.Linear(6, 4), nn.Linear(8, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        flat = sparse_lengths.reshape(-1).long()
        pooled = self.bag(sparse_indices, flat.cumsum(0) - flat)
        x = torch.relu(self.first(dense_features))
        return torch.sigmoid(self.second(torch.cat([x, pooled], dim=1)))


def _example(rows: int) -> dict[str, torch.Tensor]:
    return {"dense_features": torch.randn(rows, 6), "sparse_lengths": torch.ones(rows, 1, dtype=torch.int32),
            "sparse_indices": torch.zeros(rows, dtype=torch.int64)}


def test_more_stages_than_weighted_parts_is_refused_saying_why() -> None:
    with pytest.raises(PlanError, match="3 pipeline stages that each hold weights"):
        partition_model("two", TwoLinears().eval(), _example, cards=[load_spec("m2-card")] * 3,
                        host=load_spec("host-cpu"), strategy="pipeline", stages=3, compile=False)
    partitioned = partition_model("two", TwoLinears().eval(), _example, cards=[load_spec("m2-card")] * 2,
                                  host=load_spec("host-cpu"), strategy="pipeline", stages=2, compile=False)
    assert all(_learned(partitioned, s) for s in partitioned.plan.dense_stages())
