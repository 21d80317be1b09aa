"""DLRM-family model in the canonical request layout.

The sparse side is one table-batched embedding (all tables in one weight, like
FBGEMM's TBE), fed directly by the jagged request: ``sparse_lengths`` [N, T]
and sample-major ``sparse_indices``. Everything is written with plain torch ops
so that ``torch.export`` sees a graph the partitioner can cut at the
``embedding_bag``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from sixfold.models.configs import ModelConfig

__all__ = ["DLRM", "TableBatchedEmbedding", "MLP"]


class TableBatchedEmbedding(nn.Module):
    """All tables in one weight; table ``t`` owns rows ``offsets[t] : offsets[t] + rows[t]``."""

    def __init__(self, table_rows: tuple[int, ...], dim: int, generator: torch.Generator) -> None:
        super().__init__()
        self.table_rows = tuple(int(r) for r in table_rows)
        self.dim = dim
        total = sum(self.table_rows)
        weight = torch.empty(total, dim)
        start = 0
        for rows in self.table_rows:
            # DLRM's init: U(-sqrt(1/rows), sqrt(1/rows)) per table.
            bound = math.sqrt(1.0 / rows)
            weight[start:start + rows].uniform_(-bound, bound, generator=generator)
            start += rows
        self.weight = nn.Parameter(weight, requires_grad=False)
        offsets = torch.tensor((0, *self.table_rows[:-1]), dtype=torch.int64).cumsum(0)
        self.register_buffer("table_offsets", offsets, persistent=True)

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def forward(self, sparse_lengths: torch.Tensor, sparse_indices: torch.Tensor) -> torch.Tensor:
        """Sum-pool each (sample, table) bag; returns [N * T, dim], bag-major like the lengths."""
        lengths = sparse_lengths.reshape(-1).to(torch.int64)
        starts = torch.cumsum(lengths, 0) - lengths
        # Each id's table is its bag's column; spread each bag's row offset over its ids.
        # (repeat_interleave is ~6x cheaper here than searching bag ends per id.)
        # Broadcast rather than repeat(N): the host stage then needs no size from dense_features.
        bag_offsets = (torch.zeros_like(sparse_lengths, dtype=torch.int64) + self.table_offsets).reshape(-1)
        rows = sparse_indices + torch.repeat_interleave(bag_offsets, lengths, output_size=sparse_indices.shape[0])
        return F.embedding_bag(rows, self.weight, starts, mode="sum")


class MLP(nn.Sequential):
    """Linear layers with ReLU between them (none after the last when ``last_relu`` is False)."""

    def __init__(self, widths: tuple[int, ...], generator: torch.Generator, last_relu: bool = True) -> None:
        layers: list[nn.Module] = []
        for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
            linear = nn.Linear(fan_in, fan_out)
            with torch.no_grad():
                # DLRM's init: N(0, sqrt(2 / (fan_in + fan_out))) weights, N(0, sqrt(1 / fan_out)) bias.
                linear.weight.normal_(0.0, math.sqrt(2.0 / (fan_in + fan_out)), generator=generator)
                linear.bias.normal_(0.0, math.sqrt(1.0 / fan_out), generator=generator)
            layers.append(linear)
            if last_relu or i < len(widths) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


class CrossNetwork(nn.Module):
    """DCNv2 low-rank cross layers: x_{l+1} = x0 * (V(U x_l) + b) + x_l."""

    def __init__(self, width: int, layers: int, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.down = nn.ModuleList(nn.Linear(width, rank, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(rank, width) for _ in range(layers))
        with torch.no_grad():
            for down, up in zip(self.down, self.up):
                down.weight.normal_(0.0, math.sqrt(2.0 / (width + rank)), generator=generator)
                up.weight.normal_(0.0, math.sqrt(2.0 / (width + rank)), generator=generator)
                up.bias.zero_()

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return x


class DLRM(nn.Module):
    """Bottom MLP + pooled embeddings -> interaction (dot or DCN) -> top MLP -> sigmoid."""

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        if config.bottom_mlp[-1] != config.embedding_dim:
            raise ValueError(
                f"{config.name}: bottom MLP ends at {config.bottom_mlp[-1]} but tables have "
                f"dim {config.embedding_dim}; they must match for the interaction")
        self.config = config
        generator = torch.Generator().manual_seed(seed)
        self.embeddings = TableBatchedEmbedding(config.table_rows, config.embedding_dim, generator)
        self.bottom = MLP(config.bottom_mlp, generator)
        tables, dim = config.num_tables, config.embedding_dim
        if config.interaction == "dot":
            features = tables + 1
            rows, cols = torch.tril_indices(features, features, offset=-1)
            self.register_buffer("pair_index", rows * features + cols, persistent=False)
            top_in = dim + features * (features - 1) // 2
            self.cross = None
        else:
            top_in = dim * (tables + 1)
            self.cross = CrossNetwork(top_in, config.dcn_layers, config.dcn_rank, generator)
        self.top = MLP((top_in, *config.top_mlp), generator, last_relu=False)

    def forward(self, dense_features: torch.Tensor, sparse_lengths: torch.Tensor,
                sparse_indices: torch.Tensor) -> torch.Tensor:
        pooled = self.embeddings(sparse_lengths, sparse_indices)
        x = self.bottom(dense_features)
        emb = pooled.view(-1, self.config.num_tables, self.config.embedding_dim)
        if self.cross is None:
            stacked = torch.cat([x.unsqueeze(1), emb], dim=1)
            pairs = torch.bmm(stacked, stacked.transpose(1, 2)).flatten(1)
            top_in = torch.cat([x, torch.index_select(pairs, 1, self.pair_index)], dim=1)
        else:
            top_in = self.cross(torch.cat([x, emb.flatten(1)], dim=1))
        return torch.sigmoid(self.top(top_in))
