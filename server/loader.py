"""Turn a model name into a ServedModel: partition it, load its partitions on backends."""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

from backends import registry
from backends.api import Backend, PartitionArtifact
from backends.spec import DeviceSpec
from partitioner.compile import DENSE_PARTITION, HOST_PARTITION, partition_builtin
from partitioner.plan import PartitionPlan

from .batcher import BatchingConfig, DynamicBatcher
from .metrics import ServerMetrics
from .model import ServedModel
from .repository import ModelRepository
from .runtime import PlanRuntime

__all__ = ["load_partitioned", "load_builtin", "load_from_repository"]

log = logging.getLogger(__name__)

# The host (sparse) stage runs on the backend that takes its artifact's format.
_HOST_BACKENDS = {"torch-fx": "torch", "tables": "host-embedding", "onnx": "onnxruntime"}


class Loadable(Protocol):
    """A plan and its artifacts: a fresh PartitionedModel or a version read from a repository."""

    plan: PartitionPlan
    artifacts: dict[str, PartitionArtifact]

    def artifact_for(self, partition: str, backend: Backend) -> PartitionArtifact: ...


def load_partitioned(partitioned: Loadable, *, backend: str, metrics: ServerMetrics,
                     batching: BatchingConfig, version: str = "1", name: str | None = None,
                     backend_options: dict | None = None, max_card_rows: int | None = None) -> ServedModel:
    """Load the host stage on the torch backend and a dense replica on every placed card."""
    plan = partitioned.plan
    host_device = plan.device(plan.devices_of(HOST_PARTITION)[0]).spec
    host_artifact = partitioned.artifacts[HOST_PARTITION]
    host_backend = _HOST_BACKENDS.get(host_artifact.format)
    if host_backend is None:
        raise ValueError(f"no host backend takes {host_artifact.format!r} partitions")
    host = registry.get_backend(host_backend).load(host_artifact, host_device)
    card_backend = registry.get_backend(backend, **(backend_options or {}))
    dense = partitioned.artifact_for(DENSE_PARTITION, card_backend)
    cards, card_specs = [], []
    for device_id in plan.devices_of(DENSE_PARTITION):
        spec: DeviceSpec = plan.device(device_id).spec
        # Each card is its own device (memory budget, queue), even when all share one spec.
        card = dataclasses.replace(spec, name=f"{spec.name}/{device_id}")
        card_specs.append(card)
        cards.append(card_backend.load(dense, card))
    runtime = PlanRuntime(host, cards, reload_card=lambda i: card_backend.load(dense, card_specs[i]),
                          max_card_rows=max_card_rows)
    inflight = batching.max_inflight_batches or len(cards) + 1
    served = ServedModel(name=name or plan.model, version=version, plan=plan, runtime=runtime,
                         batcher=None, metrics=metrics)  # type: ignore[arg-type]
    served.batcher = DynamicBatcher(served.run_batch, batching, max_inflight=inflight)
    tables = plan.tables
    if tables.get("rows"):
        served.parameters["sixfold.table_rows"] = ",".join(str(r) for r in tables["rows"])
    if tables.get("pooling"):
        served.parameters["sixfold.pooling"] = ",".join(str(p) for p in tables["pooling"])
    if tables.get("zipf"):
        served.parameters["sixfold.zipf"] = str(tables["zipf"])
    served.parameters["sixfold.cards"] = str(len(cards))
    served.parameters["sixfold.backend"] = backend
    return served


def load_builtin(name: str, *, max_rows: int | None, seed: int, cards: int, backend: str,
                 card_spec: str, metrics: ServerMetrics, batching: BatchingConfig,
                 table_precision: str = "fp32", backend_options: dict | None = None,
                 max_card_rows: int | None = None) -> ServedModel:
    _, partitioned = partition_builtin(name, max_rows=max_rows, seed=seed, cards=cards, card_spec=card_spec,
                                       table_precision=table_precision)
    return load_partitioned(partitioned, backend=backend, metrics=metrics, batching=batching,
                            backend_options=backend_options, max_card_rows=max_card_rows)


def load_from_repository(repository: ModelRepository, name: str, version: str, *, backend: str,
                         metrics: ServerMetrics, batching: BatchingConfig, backend_options: dict | None = None,
                         max_card_rows: int | None = None) -> ServedModel:
    """Load version ``version`` of repository model ``name`` (served under the folder's name)."""
    read = repository.read(name, version)
    return load_partitioned(read, backend=backend, metrics=metrics, batching=batching, version=version, name=name,
                            backend_options=backend_options, max_card_rows=max_card_rows)
