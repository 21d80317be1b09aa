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
    ``model/stageKofN`` (``rm2/stage1of3``) is stage K of the N-stage pipeline ``--strategy pipeline --stages N``
    makes, fed what the stages before it answer: a stage may take inputs it only passes on to a later one.
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

        model, stage, stages = _parse(model)
        model, _, precision = model.partition("@")
        if precision and precision not in DENSE_PRECISIONS:
            raise ValueError(f"{model}@{precision}: unknown dense precision; known: {', '.join(DENSE_PRECISIONS)}")
        options = {"strategy": "pipeline", "stages": stages, "cards": stages} if stages else {"cards": 1}
        zoo, partitioned = partition_builtin(model, max_rows=max_rows, seed=seed, **options)
        if precision and precision != "fp32":
            apply_dense_precision(partitioned, precision)
        host = partitioned.artifacts[HOST_PARTITION]
        chain = ([partitioned.artifacts[f"{DENSE_PARTITION}.{k}"] for k in range(stages)] if stages
                 else [partitioned.artifacts[DENSE_PARTITION]])
        dense = chain[stage - 1] if stages else chain[0]
        earlier = [_session(a) for a in chain[:stage - 1]] if stages else []
        generator = models.RequestGenerator.for_config(zoo.config, seed=seed + 1)

        def feed(rows: int) -> Arrays:
            request = generator.make(rows)
            with torch.inference_mode():
                out = partitioned.split.host(*[torch.from_numpy(np.ascontiguousarray(request[n])) for n in host.input_names])
            env = {**request, **{n: t.numpy().copy() for n, t in zip(host.output_names, out)}}
            for artifact, session in earlier:  # the stages before this one, as serving runs them
                env.update(zip(artifact.output_names, session.run(list(artifact.output_names),
                                                                  {n: env[n] for n in artifact.input_names})))
            return {n: env[n] for n in dense.input_names}

        return dense, feed


def _parse(name: str) -> tuple[str, int, int]:
    """``rm2/stage2of3@int8`` -> (``rm2@int8``, 2, 3); no ``/stage``: (name, 0, 0)."""
    import re

    base, _, rest = name.partition("/")
    if not rest:
        return name, 0, 0
    precision = ""
    if "@" in rest:
        rest, _, precision = rest.partition("@")
    match = re.fullmatch(r"stage(\d+)of(\d+)", rest)
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)) or int(match.group(2)) < 2:
        raise ValueError(f"{name}: a pipeline stage is MODEL/stageKofN with 1 <= K <= N and N >= 2, e.g. rm2/stage1of3")
    return base + (f"@{precision}" if precision else ""), int(match.group(1)), int(match.group(2))


def _session(artifact: PartitionArtifact) -> tuple[PartitionArtifact, object]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return artifact, ort.InferenceSession(bytes(artifact.payload), options, providers=["CPUExecutionProvider"])
