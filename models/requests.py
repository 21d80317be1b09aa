"""Synthetic but production-like requests: query sizes, pooling and power-law ids.

Used by the load generator and the tests. Everything takes a numpy Generator so
that a seed reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .configs import ModelConfig
from .signature import DENSE, INDICES, LENGTHS

__all__ = [
    "QuerySizes", "FixedQuerySizes", "MLPerfQuerySizes", "parse_query_sizes",
    "RequestGenerator", "MLPERF_QUANTILES",
]

# MLPerf DLRM: items per query drawn uniformly from these 20 quantiles.
MLPERF_QUANTILES: tuple[int, ...] = (100, 100) + (200,) * 12 + (300, 300, 400, 500, 600, 700)


class QuerySizes(Protocol):
    """Items per query, drawn from some distribution."""

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray: ...


@dataclass(frozen=True)
class FixedQuerySizes:
    items: int

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return np.full(count, self.items, dtype=np.int64)


@dataclass(frozen=True)
class MLPerfQuerySizes:
    """MLPerf DLRM's heavy-tailed query sizes (100..700 items, median 200)."""

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.choice(np.asarray(MLPERF_QUANTILES, dtype=np.int64), size=count)


def parse_query_sizes(spec: str) -> QuerySizes:
    """``mlperf`` or ``fixed:N``; the error says which forms exist."""
    if spec == "mlperf":
        return MLPerfQuerySizes()
    kind, _, arg = spec.partition(":")
    if kind == "fixed" and arg.isdigit() and int(arg) >= 1:
        return FixedQuerySizes(int(arg))
    raise ValueError(f"bad query size spec {spec!r}: expected 'mlperf' or 'fixed:N' with N >= 1")


_HASH_PRIME = 2_654_435_761  # larger than any table, so id -> rank is a bijection per table


class RequestGenerator:
    """Makes canonical requests for a model: dense features, pooling lengths, power-law ids.

    Popular ids follow a bounded power law of exponent ``zipf`` per table; ranks
    are scattered over the table by a fixed multiplicative hash so hot rows are
    not all at the top of the table.
    """

    def __init__(self, table_rows: tuple[int, ...], dense_dim: int, pooling: tuple[int, ...],
                 *, zipf: float = 1.05, seed: int = 0) -> None:
        if len(pooling) != len(table_rows):
            raise ValueError(f"{len(pooling)} pooling factors for {len(table_rows)} tables")
        self.table_rows = np.asarray(table_rows, dtype=np.int64)
        self.dense_dim = dense_dim
        self.pooling = np.asarray(pooling, dtype=np.int64)
        self.zipf = zipf
        self.rng = np.random.default_rng(seed)

    @classmethod
    def for_config(cls, config: ModelConfig, *, seed: int = 0) -> "RequestGenerator":
        return cls(config.table_rows, config.dense_dim, config.pooling, zipf=config.zipf, seed=seed)

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def lengths(self, items: int) -> np.ndarray:
        """Ids per (sample, table): exactly 1 for one-hot tables, else uniform in [p/2, 3p/2]."""
        low = np.maximum(1, self.pooling // 2)
        high = np.maximum(low, self.pooling + self.pooling // 2)
        lengths = self.rng.integers(low, high + 1, size=(items, self.num_tables))
        return lengths.astype(np.int32)

    def ids(self, lengths: np.ndarray) -> np.ndarray:
        """Sample-major ids for the given lengths: sample 0 table 0, sample 0 table 1, ..."""
        per_bag_table = np.tile(np.arange(self.num_tables), lengths.shape[0])
        table = np.repeat(per_bag_table, lengths.reshape(-1))
        rows = self.table_rows[table]
        u = self.rng.random(table.shape[0])
        s = self.zipf
        if abs(s - 1.0) < 1e-9:
            x = np.exp(u * np.log(rows))
        else:
            x = ((rows.astype(np.float64) ** (1 - s) - 1) * u + 1) ** (1 / (1 - s))
        rank = np.minimum(np.floor(x).astype(np.int64) - 1, rows - 1)
        return (rank * _HASH_PRIME + table * 7919) % rows

    def make(self, items: int) -> dict[str, np.ndarray]:
        """One query of ``items`` candidate items, as the canonical input tensors."""
        if items < 1:
            raise ValueError(f"a query needs at least 1 item, got {items}")
        dense = np.log1p(self.rng.exponential(4.0, size=(items, self.dense_dim))).astype(np.float32)
        lengths = self.lengths(items)
        return {DENSE: dense, LENGTHS: lengths, INDICES: self.ids(lengths)}
