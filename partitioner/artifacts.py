"""Write a partitioned model to a model-repository version folder.

    DIR/plan.json           the plan (plain data)
    DIR/dense.onnx          the dense partition
    DIR/tables/NAME.npy     each host weight (embedding tables), memory-mappable
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .compile import DENSE_PARTITION, HOST_PARTITION, PartitionedModel

__all__ = ["write_artifacts"]


def write_artifacts(partitioned: PartitionedModel, out: str | Path) -> Path:
    """Write plan, ONNX and tables under ``out``; returns the plan's path."""
    out = Path(out)
    (out / "tables").mkdir(parents=True, exist_ok=True)
    plan = partitioned.plan
    dense = partitioned.artifacts[DENSE_PARTITION]
    (out / "dense.onnx").write_bytes(dense.payload)
    plan.partition(DENSE_PARTITION).artifact = "dense.onnx"

    host_module = partitioned.split.host  # the fp32 tables; other precisions are derived at load
    rows = plan.tables.get("rows")
    for name, tensor in {**dict(host_module.named_parameters()), **dict(host_module.named_buffers())}.items():
        array = tensor.detach().cpu().numpy()
        if name.endswith("weight") and rows and array.shape[0] == sum(rows):
            # One file per table, so a table can be mapped, sharded or replaced alone.
            start = 0
            for t, count in enumerate(rows):
                np.save(out / "tables" / f"table_{t:03d}.npy", array[start:start + count])
                start += count
        else:
            np.save(out / "tables" / f"{name}.npy", array)
    plan.partition(HOST_PARTITION).artifact = "tables/"
    path = out / "plan.json"
    plan.save(path)
    return path
