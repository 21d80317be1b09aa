"""Recommendation models: DLRM family and DCNv2, with production-like configs and requests."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from sixfold.models.configs import CONFIGS, ModelConfig, get_config
from sixfold.models.requests import (FixedQuerySizes, MLPerfQuerySizes, QuerySizes, RequestGenerator,
                       parse_query_sizes)
from sixfold.models.signature import DENSE, INDICES, LENGTHS, SCORES, Signature, TensorSpec, signature_for

__all__ = [
    "build", "names", "example_inputs", "CONFIGS", "ModelConfig", "get_config", "DLRM",
    "RequestGenerator", "QuerySizes", "FixedQuerySizes", "MLPerfQuerySizes", "parse_query_sizes",
    "Signature", "TensorSpec", "signature_for", "DENSE", "LENGTHS", "INDICES", "SCORES",
]


if TYPE_CHECKING:
    import torch

    from sixfold.models.dlrm import DLRM


def __getattr__(name: str) -> Any:
    # NOTE: torch loads only when a model is built, so the load generator starts in a blink.
    if name == "DLRM":
        from sixfold.models.dlrm import DLRM
        return DLRM
    raise AttributeError(f"module 'models' has no attribute {name!r}")


def names() -> list[str]:
    return list(CONFIGS)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 1 << 62


def build(name: str, *, max_rows: int | None = None, seed: int = 0) -> "DLRM":
    """Build a built-in model with deterministic synthetic weights for ``seed``.

    Refuses, with the numbers, a model whose tables would not fit in this
    machine's memory: pass ``max_rows`` to cap every table.
    """
    config = get_config(name, max_rows=max_rows)
    need = config.embedding_bytes()
    have = _physical_memory()
    if need > have * 0.6:
        raise MemoryError(
            f"{name}: embedding tables need {need / 2**30:.1f} GiB but this machine has "
            f"{have / 2**30:.1f} GiB; pass max_rows (e.g. --max-rows 100000) to cap each table")
    import torch

    from sixfold.models.dlrm import DLRM
    torch.manual_seed(seed)
    model = DLRM(config, seed=seed)
    return model.eval()


def example_inputs(config: ModelConfig, items: int = 4, seed: int = 0) -> tuple["torch.Tensor", ...]:
    """A small real request as torch tensors, in forward() argument order."""
    import torch

    request = RequestGenerator.for_config(config, seed=seed).make(items)
    return tuple(torch.from_numpy(request[k]) for k in (DENSE, LENGTHS, INDICES))
