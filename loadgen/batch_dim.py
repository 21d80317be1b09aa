"""Requests with a leading batch dimension of 1, for servers whose batcher batches whole requests.

Triton's dynamic batcher concatenates requests along their first dimension, which must be the batch
size of every input; a recommendation request's inputs do not share one (``dense_features`` has a row
per item, ``sparse_indices`` one per id). A Triton model with ``max_batch_size > 0`` whose inputs set
``allow_ragged_batch`` takes each request as one batch element instead: every input gets a leading
dimension of 1 and the scores come back ``[1, items, 1]``. ``LoadConfig.batch_dim`` (``--batch-dim``)
wraps the run's transport in this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from sixfold.loadgen.transport import Transport

__all__ = ["BatchDimTransport", "with_batch_dim"]


def with_batch_dim(request: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of ``request`` as one batch element: ``[1, *shape]`` (a view, no copy)."""
    return {name: array[np.newaxis] for name, array in request.items()}


class BatchDimTransport:
    """``inner`` with every request sent as ``with_batch_dim`` of it (the scores check takes ``[1, items, 1]``)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    def prepare(self, request: Mapping[str, np.ndarray]) -> Any:
        return self.inner.prepare(with_batch_dim(request))

    async def connect(self, timeout_s: float) -> None:
        await self.inner.connect(timeout_s)

    async def infer(self, payload: Any, items: int) -> bytes:
        return await self.inner.infer(payload, items)

    async def close(self) -> None:
        await self.inner.close()
