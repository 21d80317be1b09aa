"""Test cases for the conformance kit: a dense partition, real inputs for every batch size, ONNX Runtime's answers.

A ``Case`` is plain data (an artifact, feeds by batch size, expected outputs by
batch size), so a vendor can also build cases from their own partitions with
``case_from_artifact``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sixfold.backends.api import Arrays, PartitionArtifact

__all__ = ["Case", "Reference", "case_from_artifact", "builtin_case", "builtin_cases", "case_source", "DEFAULT_MODELS"]

DEFAULT_MODELS: tuple[str, ...] = ("rm2", "dlrm-mlperf", "rm2@fp16", "rm2@int8", "rm2/stage1of3", "rm2/stage2of3")
"""The zoo models whose dense partitions the kit runs by default; ``@fp16`` and ``@int8`` are the same partition
at the precision ``sixfold-serve --dense-precision`` serves (a backend may decline one in ``supports()``);
``/stage1of3`` is the first stage of a 3-stage pipeline (``--strategy pipeline --stages 3``), which takes an
input it only passes on to the next stage."""
"""Models the kit checks when none are named: the two dense-partition shapes of the zoo, fast to build."""


@dataclass
class Case:
    """One dense partition and what ONNX Runtime answers for it at every batch size."""

    name: str
    artifact: PartitionArtifact
    feeds: dict[int, Arrays]
    """Batch size (rows) -> the partition's inputs for that many rows."""
    expected: dict[int, Arrays]
    """Batch size -> ONNX Runtime's outputs for ``feeds[size]``."""
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(self.feeds)


class Reference:
    """ONNX Runtime on the CPU: the ground truth. Quiet: the kit makes it fail on purpose (bad inputs)."""

    def __init__(self, artifact: PartitionArtifact) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.log_severity_level = 4  # fatal only: refusals are expected, the exception is what counts
        payload = artifact.payload
        source = bytes(payload) if isinstance(payload, (bytes, bytearray, memoryview)) else str(payload)
        self.session = ort.InferenceSession(source, sess_options=options, providers=["CPUExecutionProvider"])
        self.inputs, self.outputs = artifact.input_names, list(artifact.output_names)

    def run(self, feed: Mapping[str, np.ndarray]) -> Arrays:
        values = self.session.run(self.outputs, {n: feed[n] for n in self.inputs})
        return {n: np.asarray(v).copy() for n, v in zip(self.outputs, values)}

    def refuses(self, feed: Mapping[str, np.ndarray]) -> bool:
        """Whether ONNX Runtime raises on ``feed``."""
        try:
            self.run(feed)
        except Exception:
            return True
        return False


def _reference(artifact: PartitionArtifact, feeds: Mapping[int, Arrays]) -> dict[int, Arrays]:
    """ONNX Runtime's outputs for every feed (the ground truth the kit compares against)."""
    reference = Reference(artifact)
    return {rows: reference.run(feed) for rows, feed in feeds.items()}


def case_from_artifact(name: str, artifact: PartitionArtifact, make_feed: Callable[[int], Arrays],
                       batch_sizes: Iterable[int]) -> Case:
    """A case for any ONNX ``artifact``: ``make_feed(rows)`` gives its inputs; ONNX Runtime gives the answers."""
    feeds = {rows: {n: np.ascontiguousarray(a) for n, a in make_feed(rows).items()} for rows in batch_sizes}
    return Case(name=name, artifact=artifact, feeds=feeds, expected=_reference(artifact, feeds))


def builtin_case(model: str, *, max_batch: int = 64, max_rows: int = 200, seed: int = 0) -> Case:
    """The dense partition of zoo model ``model`` with host-stage outputs of generated requests as inputs.

    Cached per arguments within a process (building one takes seconds).
    """
    return _builtin_case(model, max_batch, max_rows, seed)


CASES_GROUP = "sixfold.conformance_cases"


def case_source() -> Any:
    """The installed source of model cases (entry point ``sixfold.conformance_cases``).

    NOTE: found at run time, like backends, so this package imports nothing
    above it; the sixfold distribution registers its zoo (sixfold.partitioner.conformance_cases).
    """
    from importlib.metadata import entry_points
    for entry in entry_points(group=CASES_GROUP):
        return entry.load()
    raise ValueError(f"no conformance case source is installed (entry point group {CASES_GROUP!r}); "
                     "install sixfold itself, or pass your own cases (case_from_artifact)")


@functools.lru_cache(maxsize=16)
def _builtin_case(model: str, max_batch: int, max_rows: int, seed: int) -> Case:
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    dense, feed = case_source().build(model, max_rows, seed)
    case = case_from_artifact(model, dense, feed, range(1, max_batch + 1))
    case.notes["max_rows"] = str(max_rows)
    return case


def builtin_cases(names: Iterable[str], *, max_batch: int = 64, max_rows: int = 200, seed: int = 0) -> list[Case]:
    return [builtin_case(n, max_batch=max_batch, max_rows=max_rows, seed=seed) for n in names]
