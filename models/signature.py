"""The canonical recommendation request (docs/architecture.md, "The tensor convention").

Every layer (server validation, loadgen, partitioner) agrees on these names,
dtypes and shapes; -1 is a dimension that varies per request.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TensorSpec", "Signature", "signature_for", "DENSE", "LENGTHS", "INDICES", "SCORES"]

DENSE = "dense_features"
LENGTHS = "sparse_lengths"
INDICES = "sparse_indices"
SCORES = "scores"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    """KServe v2 datatype name (FP32, INT32, INT64)."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        raise KeyError(name)


def signature_for(dense_dim: int, num_tables: int) -> Signature:
    """The request signature of a model with ``dense_dim`` features and ``num_tables`` tables."""
    return Signature(
        inputs=(
            TensorSpec(DENSE, "FP32", (-1, dense_dim)),
            TensorSpec(LENGTHS, "INT32", (-1, num_tables)),
            TensorSpec(INDICES, "INT64", (-1,)),
        ),
        outputs=(TensorSpec(SCORES, "FP32", (-1, 1)),),
    )
