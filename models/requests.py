"""Synthetic but production-like requests: query sizes, pooling and power-law ids.

Used by the load generator and the tests. Everything takes a numpy Generator so
that a seed reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sixfold.models.configs import ModelConfig
from sixfold.models.signature import DENSE, INDICES, LENGTHS

__all__ = [
    "QuerySizes", "FixedQuerySizes", "MLPerfQuerySizes", "parse_query_sizes",
    "UniformQuerySizes", "LognormalQuerySizes", "EmpiricalQuerySizes", "QUERY_SIZE_FORMS", "MAX_QUERY_ITEMS",
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


MAX_QUERY_ITEMS = 100_000
"""Upper clip for drawn query sizes, so one heavy-tail draw cannot ask for gigabytes."""


@dataclass(frozen=True)
class UniformQuerySizes:
    """Items uniform on the integers ``low..high`` (inclusive)."""

    low: int
    high: int

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.integers(self.low, self.high + 1, size=count, dtype=np.int64)


@dataclass(frozen=True)
class LognormalQuerySizes:
    """Heavy-tailed sizes as in DeepRecInfra: lognormal with the given MEAN (items) and log-space SIGMA.

    ``mu`` is chosen so the mean of the continuous distribution is ``mean``;
    draws are rounded and clipped to [1, MAX_QUERY_ITEMS].
    """

    mean: float
    sigma: float

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        mu = np.log(self.mean) - self.sigma ** 2 / 2
        draws = np.rint(rng.lognormal(mu, self.sigma, size=count))
        return np.clip(draws, 1, MAX_QUERY_ITEMS).astype(np.int64)


@dataclass(frozen=True)
class EmpiricalQuerySizes:
    """Sizes resampled (with replacement) from observed query sizes, e.g. from production logs.

    File format: integers >= 1 separated by whitespace, commas or newlines;
    lines starting with ``#`` are comments.
    """

    samples: tuple[int, ...]
    path: str = ""

    @classmethod
    def from_file(cls, path: str) -> "EmpiricalQuerySizes":
        try:
            text = open(path, encoding="utf-8").read()
        except OSError as exc:
            raise ValueError(f"bad query size spec 'file:{path}': cannot read it ({exc.strerror})") from None
        words = [w for line in text.splitlines() if not line.lstrip().startswith("#")
                 for w in line.replace(",", " ").split()]
        try:
            values = tuple(int(float(w)) for w in words)
        except ValueError:
            raise ValueError(f"bad query size file {path!r}: expected integers (items per query)") from None
        if not values or min(values) < 1 or max(values) > MAX_QUERY_ITEMS:
            raise ValueError(f"bad query size file {path!r}: needs at least one value, each in "
                             f"1..{MAX_QUERY_ITEMS}")
        return cls(values, path)

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        return rng.choice(np.asarray(self.samples, dtype=np.int64), size=count)


QUERY_SIZE_FORMS = "'mlperf', 'fixed:N', 'uniform:A-B', 'lognormal:MEAN,SIGMA' or 'file:PATH'"


def parse_query_sizes(spec: str) -> QuerySizes:
    """``mlperf``, ``fixed:N``, ``uniform:A-B``, ``lognormal:MEAN,SIGMA``, ``file:PATH``.

    The error lists the forms that exist.
    """
    if spec == "mlperf":
        return MLPerfQuerySizes()
    kind, _, arg = spec.partition(":")
    if kind == "fixed" and arg.isdigit() and int(arg) >= 1:
        return FixedQuerySizes(int(arg))
    if kind == "uniform":
        low, _, high = arg.partition("-")
        if low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high) <= MAX_QUERY_ITEMS:
            return UniformQuerySizes(int(low), int(high))
    if kind == "lognormal":
        try:
            mean, sigma = (float(x) for x in arg.split(","))
        except ValueError:
            pass
        else:
            if 1 <= mean <= MAX_QUERY_ITEMS and 0 <= sigma <= 5:
                return LognormalQuerySizes(mean, sigma)
    if kind == "file" and arg:
        return EmpiricalQuerySizes.from_file(arg)
    raise ValueError(f"bad query size spec {spec!r}: expected {QUERY_SIZE_FORMS} "
                     f"(N, A <= B and MEAN >= 1, 0 <= SIGMA <= 5)")


_HASH_PRIME = 2_654_435_761  # larger than any table, so id -> rank is a bijection per table


class RequestGenerator:
    """Makes canonical requests for a model: dense features, pooling lengths, power-law ids.

    Popular ids follow a bounded power law of exponent ``zipf`` (one value, or one
    per table) per table; ranks
    are scattered over the table by a fixed multiplicative hash so hot rows are
    not all at the top of the table.
    """

    def __init__(self, table_rows: tuple[int, ...], dense_dim: int, pooling: tuple[int, ...],
                 *, zipf: float | tuple[float, ...] = 1.05, seed: int = 0, fixed_pooling: bool = False) -> None:
        if len(pooling) != len(table_rows):
            raise ValueError(f"{len(pooling)} pooling factors for {len(table_rows)} tables")
        self.table_rows = np.asarray(table_rows, dtype=np.int64)
        self.dense_dim = dense_dim
        self.pooling = np.asarray(pooling, dtype=np.int64)
        if not isinstance(zipf, (int, float)) and len(zipf) not in (1, len(table_rows)):
            raise ValueError(f"{len(zipf)} zipf exponents for {len(table_rows)} tables")
        self.zipf = zipf
        self.fixed_pooling = fixed_pooling
        """Exactly ``pooling`` ids per (item, table): a model traced at one pooling may reshape by it."""
        self.rng = np.random.default_rng(seed)

    @classmethod
    def for_config(cls, config: ModelConfig, *, seed: int = 0) -> "RequestGenerator":
        return cls(config.table_rows, config.dense_dim, config.pooling, zipf=config.zipf, seed=seed)

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def lengths(self, items: int) -> np.ndarray:
        """Ids per (sample, table): exactly 1 for one-hot tables, else uniform in [p/2, 3p/2]
        (exactly p with ``fixed_pooling``)."""
        if self.fixed_pooling:
            return np.tile(self.pooling.astype(np.int32), (items, 1))
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
        if not isinstance(s, (int, float)):
            # Per-table exponents: s = 1 is the limit of the general formula, so nudge it.
            per_table = np.broadcast_to(np.asarray(s, dtype=np.float64), (self.num_tables,))
            e = per_table[table]
            e = np.where(np.abs(e - 1.0) < 1e-9, 1.0 + 1e-6, e)
            x = ((rows.astype(np.float64) ** (1 - e) - 1) * u + 1) ** (1 / (1 - e))
        elif abs(s - 1.0) < 1e-9:
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
