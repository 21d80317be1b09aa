"""A partitioned model: the plan and the artifacts it names, the partitioner's result type.

Below every stage of the partitioner (frontends, precision, tables, placement all hand one on),
so that none of them needs the entry point (``compile``) that produces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sixfold.backends.api import Backend, PartitionArtifact, pick_artifact
from sixfold.partitioner.cut.graph_cut import SplitGraph
from sixfold.partitioner.plan import PartitionPlan
from sixfold.partitioner.pricing.cost import PartitionCost

__all__ = ["PartitionedModel", "HOST_PARTITION", "DENSE_PARTITION"]

HOST_PARTITION = "sparse"
DENSE_PARTITION = "dense"


@dataclass
class PartitionedModel:
    """A plan and the artifacts it names, ready for backends to load."""

    plan: PartitionPlan
    artifacts: dict[str, PartitionArtifact]
    split: SplitGraph | None = None
    """The torch cut (None for an ONNX model, whose halves are already ONNX artifacts)."""
    graph: Any = None
    """The exported graph module the cut was made on (for drawing); an onnx.ModelProto for ONNX models."""
    labels: dict = field(default_factory=dict)
    """Its node -> partition labels (node names for ONNX models)."""
    variants: dict[str, list[PartitionArtifact]] = field(default_factory=dict)
    """Other formats of the same partition (the dense part as a torch FX module, say)."""
    costs: dict[str, PartitionCost] = field(default_factory=dict)
    """The cost model's inputs per partition (op profiles included), as the estimates priced them."""
    io_bytes: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Bytes in and out per item of each partition over its device's link (host stage: none)."""

    def artifact_for(self, partition: str, backend: "Backend") -> PartitionArtifact:
        """The partition in a format ``backend`` takes; ValueError naming the formats when none fits."""
        return pick_artifact(partition, [self.artifacts[partition], *self.variants.get(partition, [])], backend)

