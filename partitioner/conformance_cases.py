"""Real dense partitions of the zoo models, for the backend conformance kit.

The kit lives in ``backends`` and depends on nothing of ours; it finds this
source through the ``sixfold.conformance_cases`` entry point, the same way
sixfold finds backends. The source partitions a zoo model and feeds the dense
partition the host stage's real outputs for generated requests.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from sixfold.backends.api import Arrays, PartitionArtifact

__all__ = ["ZooCases"]


class ZooCases:
    """``names()`` and ``build(model, max_rows, seed) -> (dense artifact, feed(rows) -> inputs)``.

    ``model@precision`` (``rm2@int8``, ``rm2@fp16``) is the dense partition served at that precision
    (``sixfold-serve --dense-precision``), its artifact labelled with it: what serving sends a card.
    """

    @staticmethod
    def names() -> list[str]:
        from sixfold import models
        return models.names()

    @staticmethod
    def build(model: str, max_rows: int, seed: int) -> tuple[PartitionArtifact, Callable[[int], Arrays]]:
        import torch

        from sixfold import models

        from sixfold.partitioner.compile import partition_builtin
        from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION

        from sixfold.partitioner.precision.dense import DENSE_PRECISIONS, apply_dense_precision

        model, _, precision = model.partition("@")
        if precision and precision not in DENSE_PRECISIONS:
            raise ValueError(f"{model}@{precision}: unknown dense precision; known: {', '.join(DENSE_PRECISIONS)}")
        zoo, partitioned = partition_builtin(model, max_rows=max_rows, seed=seed, cards=1)
        if precision and precision != "fp32":
            apply_dense_precision(partitioned, precision)
        host, dense = partitioned.artifacts[HOST_PARTITION], partitioned.artifacts[DENSE_PARTITION]
        generator = models.RequestGenerator.for_config(zoo.config, seed=seed + 1)

        def feed(rows: int) -> Arrays:
            request = generator.make(rows)
            with torch.inference_mode():
                out = partitioned.split.host(*[torch.from_numpy(np.ascontiguousarray(request[n])) for n in host.input_names])
            env = {**request, **{n: t.numpy().copy() for n, t in zip(host.output_names, out)}}
            return {n: env[n] for n in dense.input_names}

        return dense, feed
