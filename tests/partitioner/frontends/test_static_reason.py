"""The static-export refusal for a facebookresearch DLRM_Net-style wrapper quotes the real reason (the ops the
example's batch is baked into, with the model's own source line), not an unrelated torch error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sixfold.partitioner.compile import partition_file
from sixfold.partitioner.frontends.torch_frontend import StaticExportError

T, D, E = 3, 4, 8


class DLRMNet(nn.Module):
    """DLRM_Net's shape: per-table bags on (offsets, ids) lists, and its interaction's ``view((batch_size, -1, d))``
    and ``torch.tensor`` index lists (exported as lift_fresh_copy + detach_)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb_l = nn.ModuleList(nn.EmbeddingBag(20, E, mode="sum") for _ in range(T))
        self.bot_l = nn.Sequential(nn.Linear(D, E), nn.ReLU())
        self.top_l = nn.Sequential(nn.Linear(E + (T + 1) * T // 2, 1), nn.Sigmoid())

    def interact_features(self, x, ly):
        (batch_size, d) = x.shape
        t = torch.cat([x] + ly, dim=1).view((batch_size, -1, d))
        z = torch.bmm(t, torch.transpose(t, 1, 2))
        _, ni, nj = z.shape
        li = torch.tensor([i for i in range(ni) for j in range(i)])
        lj = torch.tensor([j for i in range(nj) for j in range(i)])
        return torch.cat([x, z[:, li, lj]], dim=1)

    def forward(self, dense_x, offsets, indices):
        x = self.bot_l(dense_x)
        return self.top_l(self.interact_features(x, [bag(indices[k], offsets[k]) for k, bag in enumerate(self.emb_l)]))


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = DLRMNet()

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        n = dense_features.shape[0]
        indices = sparse_indices.view(n, T).t().contiguous()
        offsets = torch.arange(n).unsqueeze(0).repeat(T, 1)
        return self.net(dense_features, offsets, indices)


def test_the_refusal_quotes_the_baked_batch_and_the_line_not_an_unrelated_torch_error(tmp_path) -> None:
    n = 4
    example = (torch.randn(n, D), torch.ones(n, T, dtype=torch.int32), torch.zeros(n * T, dtype=torch.int64))
    path = tmp_path / "dlrm_net.pt2"
    torch.export.save(torch.export.export(Wrapper().eval(), example), str(path))  # no dynamic_shapes
    with pytest.raises(StaticExportError) as err:
        partition_file(str(path), cards=1)
    text = str(err.value)
    assert "the example's 4 items are baked into view([4, 3]) at test_static_reason.py line" in text, text
    assert "sparse_indices.view(n, T)" in text and "arange(4)" in text
    assert "detach" not in text  # before: "Can't detach views in-place", a torch.tensor constant re-exported
