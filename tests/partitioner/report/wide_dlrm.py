"""A DLRM with one ``nn.EmbeddingBag`` per table, looked up table by table, as users write it (26 tables)."""

from __future__ import annotations

import torch

TABLES, DIM, DENSE_DIM, ROWS = 26, 8, 13, 40


class PerTableDLRM(torch.nn.Module):
    """Each table's offsets and ids sliced out of the canonical request: 26 parallel lookup chains."""

    def __init__(self, tables: int = TABLES) -> None:
        super().__init__()
        self.tables = torch.nn.ModuleList(torch.nn.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(tables))
        self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE_DIM, DIM), torch.nn.ReLU())
        self.top = torch.nn.Sequential(torch.nn.Linear(DIM * (tables + 1), 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1), torch.nn.Sigmoid())

    def forward(self, dense_features: torch.Tensor, sparse_lengths: torch.Tensor,
                sparse_indices: torch.Tensor) -> torch.Tensor:
        n = dense_features.shape[0]
        lengths = sparse_lengths.long()
        table_of = torch.arange(lengths.shape[1]).repeat(n).repeat_interleave(lengths.reshape(-1))
        pooled = []
        for t, bag in enumerate(self.tables):
            ids = sparse_indices[table_of == t]
            offsets = lengths[:, t].cumsum(0) - lengths[:, t]
            pooled.append(bag(ids, offsets))
        x = torch.cat([self.bottom(dense_features), *pooled], dim=1)
        return self.top(x)


def example(rows: int, tables: int = TABLES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    lengths = torch.randint(0, 3, (rows, tables), generator=g, dtype=torch.int32)
    return {"dense_features": torch.randn(rows, DENSE_DIM, generator=g), "sparse_lengths": lengths,
            "sparse_indices": torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)}
