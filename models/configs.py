"""Production-like model configurations (DeepRecSys RM1-3, MLPerf DLRM and DCNv2).

Row counts are the published ones; ``max_rows`` caps them so that tests and
demos fit a small machine without changing the model's shape elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

__all__ = ["ModelConfig", "CONFIGS", "get_config", "MLPERF_TABLE_ROWS", "DCNV2_MULTI_HOT"]

# Criteo Terabyte table sizes as MLPerf DLRM uses them (hashed down to 40M rows).
MLPERF_TABLE_ROWS: tuple[int, ...] = (
    39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
    2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36,
)
# Multi-hot sizes (ids per table per sample) of MLPerf DLRM-DCNv2.
DCNV2_MULTI_HOT: tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a DLRM-style model: tables, pooling and MLP widths."""

    name: str
    table_rows: tuple[int, ...]
    """Rows of each embedding table (before any ``max_rows`` cap)."""
    embedding_dim: int
    pooling: tuple[int, ...]
    """Typical ids per (sample, table): the synthetic traffic uses it as the mean."""
    bottom_mlp: tuple[int, ...]
    """Bottom MLP widths; the first is the number of dense features."""
    top_mlp: tuple[int, ...]
    """Top MLP output widths; the last is 1 (the click logit)."""
    interaction: Literal["dot", "dcn"] = "dot"
    dcn_layers: int = 0
    dcn_rank: int = 0
    zipf: float = 1.05
    """Power-law exponent of id popularity (a few hot rows take most lookups)."""
    notes: str = field(default="", compare=False)

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    @property
    def dense_dim(self) -> int:
        return self.bottom_mlp[0]

    def capped(self, max_rows: int | None) -> "ModelConfig":
        """The same model with every table cut to at most ``max_rows`` rows."""
        if max_rows is None:
            return self
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        return replace(self, table_rows=tuple(min(r, max_rows) for r in self.table_rows))

    def embedding_bytes(self, bytes_per_value: int = 4) -> int:
        return sum(self.table_rows) * self.embedding_dim * bytes_per_value


CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig("rm1", (4_000_000,) * 8, 32, (80,) * 8, (128, 64, 32), (256, 64, 1),
                    notes="DeepRecSys RM1: few large tables, heavy pooling"),
        ModelConfig("rm2", (500_000,) * 32, 64, (120,) * 32, (256, 128, 64), (128, 64, 1),
                    notes="DeepRecSys RM2: many tables, heaviest pooling (memory-bound)"),
        ModelConfig("rm3", (2_000_000,) * 10, 32, (20,) * 10, (2560, 1024, 256, 32), (512, 256, 1),
                    notes="DeepRecSys RM3: large bottom MLP (compute-bound)"),
        ModelConfig("dlrm-mlperf", MLPERF_TABLE_ROWS, 128, (1,) * 26, (13, 512, 256, 128),
                    (1024, 1024, 512, 256, 1), notes="MLPerf DLRM (Criteo 1TB), one-hot"),
        ModelConfig("dcnv2-mlperf", MLPERF_TABLE_ROWS, 128, DCNV2_MULTI_HOT, (13, 512, 256, 128),
                    (1024, 1024, 512, 256, 1), interaction="dcn", dcn_layers=3, dcn_rank=512,
                    notes="MLPerf DLRM-DCNv2, multi-hot 1..100"),
        ModelConfig("tiny", (100,) * 3, 8, (2,) * 3, (4, 8, 8), (8, 1),
                    notes="trivial DLRM (3 x 100 rows, dim 8): compute ~0, for serving-overhead benchmarks"),
    )
}


def get_config(name: str, *, max_rows: int | None = None) -> ModelConfig:
    """Look a built-in model up by name; the error lists the names that exist."""
    try:
        config = CONFIGS[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; built-in models: {', '.join(CONFIGS)}") from None
    return config.capped(max_rows)
