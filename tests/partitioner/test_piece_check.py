"""The partitioner runs its pieces at 1, 2, 3, 7 and 64 items (and a jagged request with empty bags)
against the model before it writes a plan; a size that fails is refused naming the size and the reason."""

from __future__ import annotations

import torch
from torch import nn

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.cli import main as partition_main
from sixfold.partitioner.compile import partition_model
from sixfold.partitioner.piece_check import CHECK_SIZES, PieceCheckError, check_pieces

TABLES, DENSE_DIM, ROWS, DIM = 3, 4, 50, 8
AUTO = torch.export.Dim.AUTO


class Jagged(nn.Module):
    """One bag over every table; ``squeeze=True`` drops the batch dim of a 1-item batch (``squeeze()``)."""

    def __init__(self, squeeze: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag = nn.EmbeddingBag(ROWS, DIM, mode="sum")
        self.top = nn.Linear(DENSE_DIM + TABLES * DIM, 1)
        self.squeeze = squeeze

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        n = dense_features.shape[0]
        flat = sparse_lengths.reshape(-1).long()
        pooled = self.bag(sparse_indices, flat.cumsum(0) - flat).reshape(n, -1)
        logit = self.top(torch.cat([dense_features, pooled], dim=1))
        return torch.sigmoid(logit.squeeze()).unsqueeze(-1) if self.squeeze else torch.sigmoid(logit)


def _example(rows: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return {"dense_features": torch.randn(rows, DENSE_DIM, generator=g),
            "sparse_lengths": torch.full((rows, TABLES), 2, dtype=torch.int32),
            "sparse_indices": torch.randint(0, ROWS, (rows * TABLES * 2,), generator=g)}


def _partition(model: nn.Module):
    return partition_model("m", model.eval(), _example, cards=[load_spec("m2-card")], host=load_spec("host-cpu"),
                           compile=False)


def test_pieces_are_checked_at_every_size_and_on_a_jagged_request_with_empty_bags() -> None:
    model = Jagged()
    partitioned = _partition(model)
    split = partitioned.split

    def card(env):
        return dict(zip(["scores"], split.dense(*[env[n] for n in split.dense_inputs])))
    checked = check_pieces(model, split, ["scores"], _example, {"dense": card})
    assert checked == [f"{n}-item request" for n in CHECK_SIZES] + ["7-item jagged request with empty bags"]


def test_a_model_that_drops_the_batch_dim_at_one_item_is_refused_naming_the_size(tmp_path, capsys) -> None:
    model = Jagged(squeeze=True).eval()
    example = tuple(_example(4).values())
    program = torch.export.export(model, example, dynamic_shapes={
        "dense_features": {0: AUTO}, "sparse_lengths": {0: AUTO}, "sparse_indices": {0: AUTO}}, strict=False)
    path = tmp_path / "squeezed.pt2"
    torch.export.save(program, str(path))
    assert partition_main([str(path), "--cards", "1", "--out", str(tmp_path / "repo" / "1")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "1-item request" in err and "'scores' [1], not [1, 1]" in err and "squeeze(-1)" in err, err
    assert "Traceback" not in err
    assert not (tmp_path / "repo").exists()  # no plan written
    try:
        _partition(model)
    except PieceCheckError as exc:
        assert "1-item request" in str(exc)
    else:
        raise AssertionError("a model answering [1] for a 1-item request was not refused")


def test_a_card_piece_that_disagrees_with_the_model_is_refused_naming_the_size() -> None:
    model = Jagged()
    split = _partition(model).split

    def late_rows(env):  # a piece that only goes wrong past 7 items
        out = split.dense(*[env[n] for n in split.dense_inputs])[0]
        return {"scores": out if out.shape[0] <= 7 else out.flip(0)}
    try:
        check_pieces(model, split, ["scores"], _example, {"dense": late_rows})
    except PieceCheckError as exc:
        assert str(exc).startswith("on a 64-item request, the card piece 'dense' gives 'scores' up to"), exc
    else:
        raise AssertionError("a piece that disagrees with the model at 64 items was not refused")
