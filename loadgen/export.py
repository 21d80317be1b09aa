"""``--export-perf-analyzer``: the loadgen's queries as perf_analyzer ``--input-data`` JSON.

So Triton's own perf_analyzer can send exactly the queries sixfold-loadgen
would (same seed, sizes, ids, pooling): one ``data`` entry per request of the
schedule, in order, the first ``count`` of them. perf_analyzer cycles through
the entries, one per inference. Format::

    {"data": [{"dense_features": {"content": [...flat...], "shape": [N, D]},
               "sparse_lengths": {"content": [...], "shape": [N, T]},
               "sparse_indices": {"content": [...], "shape": [sum(lengths)]}}, ...]}

Use as ``perf_analyzer -m MODEL -i grpc -u HOST:PORT --input-data FILE``
(the shapes come from the file). The model's shape is asked from the server,
unless ``--table-rows`` lists one value per table and ``--dense-dim`` is given:
then no server is needed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from sixfold.loadgen.config import LoadConfig
from sixfold.loadgen.runner import ClientFactory, Target, plan_run, resolve_config
from sixfold.loadgen.target import DEFAULT_POOLING, DEFAULT_ZIPF, ModelShape

__all__ = ["write_perf_analyzer_json", "export_perf_analyzer_async", "offline_shape"]


def _content(array: np.ndarray) -> str:
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.dtype.kind == "f":
        # NOTE: repr of float32 via float64 is exact enough and round-trips to the same float32.
        return ",".join(map(repr, flat.astype(np.float64).tolist()))
    return ",".join(map(str, flat.tolist()))


def write_perf_analyzer_json(queries: Iterable[Mapping[str, np.ndarray]], path: str | Path) -> tuple[Path, int]:
    """Stream ``queries`` (canonical tensors) to ``path`` as perf_analyzer input data; (path, entries)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"data": [')
        for query in queries:
            f.write(",\n" if count else "\n")
            parts = [f'"{name}": {{"content": [{_content(a)}], "shape": {list(map(int, a.shape))}}}'
                     for name, a in query.items()]
            f.write("{" + ", ".join(parts) + "}")
            count += 1
        f.write("\n]}\n")
    return path, count


def offline_shape(config: LoadConfig) -> ModelShape | None:
    """The model shape from flags alone (one --table-rows value per table and --dense-dim), else None."""
    if config.table_rows is None or len(config.table_rows) < 2 or config.dense_dim is None:
        return None
    tables = len(config.table_rows)
    pooling = config.pooling or (DEFAULT_POOLING,)
    if len(pooling) not in (1, tables):
        raise ValueError(f"--pooling has {len(pooling)} values for {tables} tables")
    zipf = config.zipf if config.zipf is not None else DEFAULT_ZIPF
    if isinstance(zipf, tuple):
        if len(zipf) not in (1, tables):
            raise ValueError(f"--zipf has {len(zipf)} values for {tables} tables")
        zipf = zipf[0] if len(zipf) == 1 else zipf
    return ModelShape(config.dense_dim, config.table_rows, pooling * tables if len(pooling) == 1 else pooling,
                      zipf, {"table_rows": "flag", "dense_dim": "flag"})


async def export_perf_analyzer_async(config: LoadConfig, path: str | Path, *, count: int | None = None,
                                     client_factory: ClientFactory | None = None) -> tuple[Path, int]:
    """Write the first ``count`` queries of ``config``'s schedule (default: ``max_requests`` or ``pool``)."""
    config = resolve_config(config)
    shape = offline_shape(config)
    if shape is None:
        async with Target(config, client_factory) as target:
            shape = target.shape
    assert shape is not None
    schedule = plan_run(config, shape, lambda q: q)
    wanted = min(len(schedule), count or config.max_requests or config.pool)
    return write_perf_analyzer_json((schedule.pool.payloads[int(k)] for k in schedule.query[:wanted]), path)
