"""Every output of a model is served under the model's own name: a dict's keys, ``scores`` for a lone tensor,
torch.export's names for a tuple; a nested container is refused naming the output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_model
from sixfold.partitioner.frontends.torch_frontend import export_model, output_names


class Heads(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.a, self.b = nn.Linear(6, 1), nn.Linear(6, 3)
        self.kind = kind

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        flat = sparse_lengths.reshape(-1).long()
        x = torch.cat([dense_features, self.bag(sparse_indices, flat.cumsum(0) - flat)], dim=1)
        a, b = torch.sigmoid(self.a(x)), torch.relu(self.b(x))
        return {"dict": {"ctr": a, "cvr": b}, "one": a, "tuple": (a, b), "nested": {"ctr": a, "more": (b,)},
                "flat": {"ctr": a, "cvr": b.reshape(-1)}}[self.kind]


def _example(rows: int) -> dict[str, torch.Tensor]:
    return {"dense_features": torch.randn(rows, 2), "sparse_lengths": torch.ones(rows, 1, dtype=torch.int32),
            "sparse_indices": torch.zeros(rows, dtype=torch.int64)}


@pytest.mark.parametrize(("kind", "names"), [("dict", ["ctr", "cvr"]), ("one", ["scores"]),
                                             ("tuple", ["sigmoid", "relu"])])
def test_outputs_are_named_as_the_model_names_them(kind, names) -> None:
    program = export_model(Heads(kind).eval(), tuple(_example(4).values()))
    assert output_names(program) == names
    partitioned = partition_model("m", Heads(kind).eval(), _example, cards=[load_spec("m2-card")],
                                  host=load_spec("host-cpu"), compile=False)
    assert [(t.name, t.shape, t.rows_per_item) for t in partitioned.plan.outputs] == [
        (n, [-1, 1 if i == 0 else 3], 1) for i, n in enumerate(names)]
    assert partitioned.artifacts["dense"].output_names == tuple(names)


def test_a_nested_output_is_refused_naming_it() -> None:
    program = export_model(Heads("nested").eval(), tuple(_example(4).values()))
    with pytest.raises(ValueError, match="output 'more' is a nested container"):
        output_names(program)


def test_an_output_that_is_not_item_major_is_refused_naming_it() -> None:
    from sixfold.partitioner.placement.strategy import PlanError
    with pytest.raises(PlanError, match=r"output 'cvr' came out \[192\] for a 64-item request: every output must be "
                                        r"item-major"):
        partition_model("m", Heads("flat").eval(), _example, cards=[load_spec("m2-card")], host=load_spec("host-cpu"),
                        compile=False)
