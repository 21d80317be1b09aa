"""Write a partitioned model to a model-repository version folder.

    DIR/plan.json           the plan (plain data)
    DIR/dense.onnx          the dense partition (pipelined: dense.0.onnx, dense.1.onnx, ... per stage)
    DIR/tables/table_NNN.npy  a table-batched host stage: one file per table, memory-mappable
    DIR/host.pt2            any other torch host stage, as a torch.export archive
    DIR/host.onnx           an ONNX model's host stage (tables, lookups, pooling), for onnxruntime

DIR is written whole or not at all (``sixfold.partitioner.tables.staging``): into a temporary
sibling renamed into place, so a full disk or a kill leaves the old folder or none, never half.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sixfold.backends.host.derived_cache import write_npy
from sixfold.partitioner.tables.checksums import table_checksums
from sixfold.partitioner.tables.staging import staged
from sixfold.partitioner.partitioned import HOST_PARTITION, PartitionedModel
from sixfold.partitioner.frontends.host_export import export_host_program
from sixfold.partitioner.tables.probe import table_batched

__all__ = ["write_artifacts"]


def write_artifacts(partitioned: PartitionedModel, out: str | Path) -> Path:
    """Write plan, ONNX and tables under ``out`` (whole or not at all); returns the plan's path.

    OSError (a full disk: naming ``out`` and the file) leaves ``out`` as it was.
    """
    out = Path(out)
    with staged(out) as tmp:
        _write(partitioned, tmp)
    return out / "plan.json"


def _write(partitioned: PartitionedModel, out: Path) -> Path:
    plan = partitioned.plan
    for stage in plan.dense_stages():  # "dense", or pipeline stages "dense.0", "dense.1", ...
        (out / f"{stage}.onnx").write_bytes(partitioned.artifacts[stage].payload)
        plan.partition(stage).artifact = f"{stage}.onnx"

    if partitioned.artifacts[HOST_PARTITION].format == "onnx":
        # An ONNX model's host stage (tables, lookups, pooling) is one ONNX graph for onnxruntime.
        (out / "host.onnx").write_bytes(partitioned.artifacts[HOST_PARTITION].payload)
        plan.partition(HOST_PARTITION).artifact = "host.onnx"
        plan.save(out / "plan.json")
        return out / "plan.json"
    host_module = partitioned.split.host  # the fp32 tables; other precisions are derived at load
    rows = plan.tables.get("rows")
    host_artifact = partitioned.artifacts[HOST_PARTITION]
    # NOTE: a user's host graph is written as tables only if it computes what the tables backend does.
    tables = None if host_artifact.format == "tables" else table_batched(
        host_module, host_artifact.input_names, host_artifact.output_names, rows)
    if host_artifact.format == "tables" or tables is not None:
        # One table-batched lookup: one file per table, so a table can be mapped, sharded or replaced alone.
        (out / "tables").mkdir(parents=True, exist_ok=True)
        for t, table in enumerate(tables if tables is not None else _fused_tables(host_module, rows)):
            # NOTE: allocated before written, no memory map: a full disk is an OSError naming the file and bytes
            write_npy(out / "tables" / f"table_{t:03d}.npy", table.dtype, table.shape, [table])
        plan.partition(HOST_PARTITION).artifact = "tables/"
        plan.partition(HOST_PARTITION).format = "tables"
        plan.tables["checksums"] = table_checksums(out / "tables")  # checked at load (sixfold.partitioner.tables.checksums)
    else:  # any other host graph is saved whole and runs on the torch backend
        if host_artifact.format == "torch-fx" and host_artifact.metadata.get("precision", "fp32") != "fp32":
            host_module = host_artifact.payload  # its lookups rewritten to fp16/int8/int4 rows (lookup_precision)
        export_host_program(host_module, plan, list(host_artifact.input_names), out / "host.pt2")
        plan.partition(HOST_PARTITION).artifact = "host.pt2"
    path = out / "plan.json"
    plan.save(path)
    return path


def _fused_tables(host_module, rows) -> list[np.ndarray]:
    """The per-table views of a table-batched host stage's one [sum(rows), dim] weight (the zoo's)."""
    weights = {**dict(host_module.named_parameters()), **dict(host_module.named_buffers())}
    fused = [t for n, t in weights.items() if n.endswith("weight") and t.shape[0] == sum(rows)]
    array = fused[0].detach().cpu().numpy()
    starts = np.cumsum([0, *rows])
    return [array[a:b] for a, b in zip(starts[:-1], starts[1:])]
