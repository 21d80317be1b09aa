"""The host stage's cost per looked-up id, measured on this host as sixfold-serve runs it, cached.

The cost model prices the host stage from the host spec's gather bandwidth and op profile. Against what
``sixfold-serve`` took for lone queries on the 2-core development VM, the generic ``host-cpu`` spec priced
rm2's 700-item host stage (2.7 M ids) at 7 ms and ``--host-spec auto`` at 30 ms; it took 21 ms. This fit is
that measurement: ``fixed_s + bags x per_bag_s + ids x per_id_s`` (a bag: one table's lookups for one item),
through the host-stage times of lone queries that ``bench/unloaded_latency.py --calibrate`` serves. Two models
with different ids per bag fit both terms: on the development VM dlrm-mlperf (26 bags of 1 id an item) took
~100 ns a bag, rm2 (32 bags of 120 ids) ~7 ns an id. It is written beside the serving path (``host-stage-<machine>.json``); the start-up plan's
lone-query line and ``sixfold-simulate`` (with ``--host-spec auto``) price the host stage with it when the
file exists, and with the host spec otherwise.
"""

from __future__ import annotations

from sixfold.backends.host.native import write_json_atomic
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from sixfold.partitioner.pricing.served_latency import ServedLatency

__all__ = ["HostStageFit", "host_stage_file", "load_host_stage", "save_host_stage", "fit_host_stage",
           "measured_lone_host"]


@dataclass(frozen=True)
class HostStageFit:
    """A lone batch's host stage: ``fixed_s + bags x per_bag_s + ids x per_id_s`` seconds."""

    fixed_s: float
    per_id_s: float
    per_bag_s: float = 0.0
    source: str = ""

    def per_item_s(self, ids_per_item: float, bags_per_item: float) -> float:
        """Seconds an item adds: its bags (one per table) and its ids."""
        return bags_per_item * self.per_bag_s + ids_per_item * self.per_id_s

    def seconds(self, items: float, ids_per_item: float, bags_per_item: float) -> float:
        return self.fixed_s + items * self.per_item_s(ids_per_item, bags_per_item)


def host_stage_file() -> Path:
    """This machine's fit (beside ``--host-spec auto``'s cache and the serving path's)."""
    from sixfold.backends.host.calibrate import cache_dir, machine_key
    return cache_dir() / f"host-stage-{machine_key()}.json"


def load_host_stage(path: Path | None = None) -> HostStageFit | None:
    """This host's fit, or None when none was measured (or the file is damaged)."""
    try:
        data = json.loads((path or host_stage_file()).read_text())
        return HostStageFit(float(data["fixed_s"]), float(data["per_id_s"]), float(data.get("per_bag_s", 0.0)),
                            str(data.get("source", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_host_stage(fit: HostStageFit, path: Path | None = None) -> Path:
    """Write ``fit`` atomically (a concurrent reader sees a whole file)."""
    return write_json_atomic(path or host_stage_file(), asdict(fit))


def fit_host_stage(items: Sequence[float], ids_per_item: Sequence[float], bags_per_item: Sequence[float],
                   seconds: Sequence[float], source: str) -> HostStageFit:
    """Least squares (relative error) through measured host-stage times, every term >= 0; the per-bag term
    only when the points span two ids-per-bag ratios (two models), else the bags count as ids."""
    import numpy as np

    if not len(items) == len(ids_per_item) == len(bags_per_item) == len(seconds) or len(set(items)) < 2:
        raise ValueError(f"fit_host_stage needs times at >= 2 distinct sizes, got {list(items)}")
    n = np.asarray(items, dtype=float)
    ids = n * np.asarray(ids_per_item, dtype=float)
    bags = n * np.asarray(bags_per_item, dtype=float)
    y = np.asarray(seconds, dtype=float)
    w = 1.0 / np.maximum(y, 1e-6)  # relative: a 1-item query's 0.2 ms counts as much as 21 ms
    per_bag = 0.0
    ratios = {round(i / b, 9) for i, b in zip(ids_per_item, bags_per_item) if b}
    if len(ratios) >= 2:
        a = np.column_stack([np.ones_like(n), ids, bags]) * w[:, None]
        (fixed, per_id, per_bag), *_ = np.linalg.lstsq(a, y * w, rcond=None)
        if per_bag < 0 or per_id < 0:
            per_bag = 0.0
    if per_bag == 0.0:
        a = np.column_stack([np.ones_like(n), ids]) * w[:, None]
        (fixed, per_id), *_ = np.linalg.lstsq(a, y * w, rcond=None)
    return HostStageFit(max(0.0, float(fixed)), max(0.0, float(per_id)), max(0.0, float(per_bag)), source)


def measured_lone_host(lone: "ServedLatency", fit: HostStageFit, ids_per_item: float,
                       bags_per_item: float) -> "ServedLatency":
    """``lone`` with its host term priced by ``fit`` (the model's ids and bags, one a table, per item)."""
    import dataclasses

    if ids_per_item <= 0 or bags_per_item <= 0:
        raise ValueError(f"measured_lone_host: ids_per_item and bags_per_item must be > 0, got {ids_per_item}, "
                         f"{bags_per_item}")
    host = tuple((r, fit.seconds(r, ids_per_item, bags_per_item)) for r, _ in lone.host)
    return dataclasses.replace(lone, host=host, host_source=f"measured here per id ({fit.source})")
