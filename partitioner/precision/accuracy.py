"""How much accuracy a reduced-precision plan costs: scores of the served path, fp32 vs variant.

Recommendation models have no labelled data here, so the labels are synthetic
and fair to the reference by construction: requests come from the model's own
traffic generator (``models.RequestGenerator``), the fp32 reference scores each
item ``p``, and the item's label is drawn ~ Bernoulli(``p``) with a fixed seed.
The fp32 model is then calibrated on this data, and any precision loss can
only show up as a worse log-loss.

Both sides run the real served path: the host stage on the backend that takes
its artifact (``host-embedding`` for row-wise tables, ``torch`` for the fp32
graph) and the dense stage through ONNX Runtime, as ``sixfold.server.loading.loader`` loads
them. Reported:

- ``max_abs_diff``, ``mean_abs_diff``: |score_variant - score_reference| per item;
- ``logloss_*``: mean binary cross-entropy against the labels (scores clipped to
  [1e-7, 1 - 1e-7]);
- ``ne_*``: normalized entropy, log-loss / entropy of the labels' base rate
  (He et al., "Practical lessons from predicting clicks on ads at Facebook");
- ``ne_change_pct``: (NE_variant / NE_reference - 1) x 100.

Every output head of the model is scored (a click and a conversion head, say): the
top-level numbers are the first head's (the plan's first output), and ``heads`` holds
each head's numbers. A head whose reference values are not all probabilities in [0, 1]
(a logit, a regression) gets only the |diff| numbers, since log-loss needs probabilities.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.backends import registry
from sixfold.backends.api import Executable, PartitionArtifact
from sixfold.models import RequestGenerator
from sixfold.models.signature import DENSE, LENGTHS

from sixfold.partitioner.partitioned import HOST_PARTITION, PartitionedModel
from sixfold.partitioner.pricing.cost import module_param_bytes
from sixfold.partitioner.plan import PartitionPlan

__all__ = ["AccuracyReport", "accuracy_report", "score_metrics", "reference_artifacts", "plan_requests",
           "describe", "print_accuracy"]

Stages = Mapping[str, PartitionArtifact]
"""The two artifacts of a served path: {"sparse": host artifact, "dense": dense artifact}."""

_EPS = 1e-7
_HOST_BACKENDS = {"torch-fx": "torch", "tables": "host-embedding", "onnx": "onnxruntime"}  # as sixfold.server.loading.loader picks them
_DENSE_BACKENDS = {"onnx": "onnxruntime", "torch-fx": "torch"}


@dataclass(frozen=True)
class AccuracyReport:
    """Reference (fp32) vs variant scores on the same synthetic labelled items."""

    model: str
    reference: str
    """What the reference path is, e.g. "fp32 tables + fp32 dense"."""
    variant: str
    items: int
    seed: int
    base_rate: float
    """Share of positive labels."""
    max_abs_diff: float
    mean_abs_diff: float
    logloss_reference: float
    logloss_variant: float
    ne_reference: float
    ne_variant: float
    ne_change_pct: float
    heads: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Per output head, in plan order: the same numbers for that head (None where they do not apply)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


def _logloss(labels: np.ndarray, scores: np.ndarray) -> float:
    p = np.clip(scores.astype(np.float64), _EPS, 1 - _EPS)
    y = labels.astype(np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def score_metrics(labels: np.ndarray, reference: np.ndarray, variant: np.ndarray) -> dict[str, float]:
    """The report's numbers from labels and two score vectors (all 1-D, same length)."""
    labels, reference, variant = (np.asarray(a).reshape(-1) for a in (labels, reference, variant))
    if not (labels.shape == reference.shape == variant.shape) or labels.size == 0:
        raise ValueError(f"labels, reference and variant scores must be non-empty and of one length; got "
                         f"{labels.size}, {reference.size}, {variant.size}")
    base = float(labels.mean())
    if base in (0.0, 1.0):
        raise ValueError(f"all {labels.size} labels are {int(base)}: the base rate's entropy is 0, NE is undefined")
    entropy = -(base * math.log(base) + (1 - base) * math.log(1 - base))
    diff = np.abs(variant.astype(np.float64) - reference.astype(np.float64))
    ll_ref, ll_var = _logloss(labels, reference), _logloss(labels, variant)
    ne_ref, ne_var = ll_ref / entropy, ll_var / entropy
    return {"base_rate": base, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "logloss_reference": ll_ref, "logloss_variant": ll_var, "ne_reference": ne_ref,
            "ne_variant": ne_var, "ne_change_pct": (ne_var / ne_ref - 1.0) * 100.0}


def reference_artifacts(partitioned: PartitionedModel) -> dict[str, PartitionArtifact]:
    """The fp32 served path of ``partitioned``: its fp32 host graph and its (fp32) dense artifacts.

    Call before ``apply_dense_precision``; the host side is the exported fp32
    graph whatever the table precision (an ONNX model's host artifact as is).
    """
    stages = dict(partitioned.artifacts)
    for name, art in stages.items():
        if art.dtype != "fp32":
            raise ValueError(f"partition {name} is already {art.dtype}; take the reference before converting it")
    host = stages[HOST_PARTITION]
    split = partitioned.split
    if host.format == "tables" or host.metadata.get("precision", "fp32") != "fp32":
        fp32 = [v for v in partitioned.variants.get(HOST_PARTITION, []) if v.metadata.get("precision", "fp32") == "fp32"]
        if split is None and fp32:  # an ONNX host converted in place keeps its fp32 self as a variant
            stages[HOST_PARTITION] = fp32[0]
            return stages
        if split is None:
            raise ValueError("the host partition is quantized tables and there is no fp32 host graph to compare with")
        stages[HOST_PARTITION] = PartitionArtifact(
            name=HOST_PARTITION, format="torch-fx", payload=split.host, input_names=tuple(split.host_inputs),
            output_names=tuple(split.boundary), param_bytes=module_param_bytes(split.host),
            bytes_per_item=host.bytes_per_item)
    return stages


def describe(stages: Stages) -> str:
    """"int8 tables + fp16 dense" style label of a served path."""
    host = stages[HOST_PARTITION]
    tables = host.metadata.get("precision", "fp32")
    dense = sorted({a.dtype for n, a in stages.items() if n != HOST_PARTITION})
    return f"{tables} tables + {'/'.join(dense)} dense"


def plan_requests(plan: PartitionPlan, seed: int) -> RequestGenerator:
    """A traffic generator for the plan's model: its tables' rows, pooling and zipf, its dense width."""
    shapes = {t.name: t.shape for t in plan.inputs}
    tables = int(shapes[LENGTHS][1])
    rows = plan.tables.get("rows") or [1] * tables  # unknown row counts: id 0, valid in any table
    pooling = plan.tables.get("pooling") or [1] * tables
    return RequestGenerator(tuple(int(r) for r in rows), int(shapes[DENSE][1]), tuple(int(p) for p in pooling),
                            zipf=plan.tables.get("zipf", 1.05), seed=seed,
                            fixed_pooling=bool(plan.tables.get("fixed_pooling")))


class _Path:
    """One served path (the host stage, then each dense partition in plan order) on real backends."""

    def __init__(self, stages: Stages, plan: PartitionPlan) -> None:
        self.executables: list[Executable] = []
        try:
            for info in plan.partitions:
                art = stages[info.name]
                table = _HOST_BACKENDS if info.kind == "sparse" else _DENSE_BACKENDS
                if art.format not in table:
                    raise ValueError(f"partition {info.name}: no backend here for format {art.format!r}")
                device = plan.device(plan.devices_of(info.name)[0]).spec
                self.executables.append(registry.get_backend(table[art.format]).load(art, device))
        except BaseException:
            self.close()
            raise

    def __call__(self, request: Mapping[str, np.ndarray], heads: list[str]) -> dict[str, np.ndarray]:
        """Each head's values, one row per item (a head of k columns keeps them in the row)."""
        env = dict(request)
        for executable in self.executables:
            env.update(executable.run(env))
        rows = len(request[DENSE])
        return {h: np.asarray(env[h], dtype=np.float32).reshape(rows, -1) for h in heads}

    def close(self) -> None:
        for executable in self.executables:
            executable.close()


def accuracy_report(reference: Stages | PartitionedModel, variant: Stages | PartitionedModel,
                    plan: PartitionPlan, *, items: int = 4096, batch_rows: int = 512, seed: int = 1,
                    requests: Callable[[int], Mapping[str, np.ndarray]] | None = None) -> AccuracyReport:
    """Score ``items`` synthetic items through both served paths and compare (module docstring).

    ``reference``/``variant``: {"sparse": ..., "dense": ...} artifacts (or a
    PartitionedModel, whose artifacts are used). ``plan`` gives the devices and
    the traffic's shape; ``requests(rows)`` overrides the traffic (tests).
    Labels are drawn from the reference's scores with ``seed``.
    """
    if items < 1 or batch_rows < 1:
        raise ValueError(f"items and batch_rows must be >= 1, got {items} and {batch_rows}")
    ref_stages = reference.artifacts if isinstance(reference, PartitionedModel) else reference
    var_stages = variant.artifacts if isinstance(variant, PartitionedModel) else variant
    make = requests or plan_requests(plan, seed).make
    ref_path = _Path(ref_stages, plan)
    try:
        var_path = _Path(var_stages, plan)
    except BaseException:
        ref_path.close()
        raise
    heads = [t.name for t in plan.outputs]
    try:
        ref_scores: list[dict[str, np.ndarray]] = []
        var_scores: list[dict[str, np.ndarray]] = []
        done = 0
        while done < items:
            request = make(min(batch_rows, items - done))
            ref_scores.append(ref_path(request, heads))
            var_scores.append(var_path(request, heads))
            done += len(request[DENSE])
    finally:
        ref_path.close()
        var_path.close()
    ref = {h: np.concatenate([r[h] for r in ref_scores])[:items].reshape(-1) for h in heads}
    var = {h: np.concatenate([v[h] for v in var_scores])[:items].reshape(-1) for h in heads}
    first = heads[0]
    labels = (np.random.default_rng(seed).random(ref[first].shape[0]) < ref[first]).astype(np.int8)
    per_head = {first: score_metrics(labels, ref[first], var[first])}
    for i, head in enumerate(heads[1:], start=1):
        per_head[head] = _head_metrics(ref[head], var[head], np.random.default_rng([seed, i]))
    return AccuracyReport(model=plan.model, reference=describe(ref_stages), variant=describe(var_stages),
                          items=min(done, items), seed=seed, **per_head[first],
                          heads=per_head if len(heads) > 1 else {})


def _head_metrics(reference: np.ndarray, variant: np.ndarray, rng: np.random.Generator) -> dict[str, float | None]:
    """A further head's numbers: labels ~ Bernoulli(its reference) where its values are probabilities, else |diff|."""
    diff = np.abs(variant.astype(np.float64) - reference.astype(np.float64))
    only_diff: dict[str, float | None] = {
        "base_rate": None, "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
        "logloss_reference": None, "logloss_variant": None, "ne_reference": None, "ne_variant": None,
        "ne_change_pct": None}
    if reference.size == 0 or reference.min() < 0 or reference.max() > 1:
        return only_diff
    labels = (rng.random(reference.shape[0]) < reference).astype(np.int8)
    try:
        return dict(score_metrics(labels, reference, variant))
    except ValueError:  # every label alike: NE is undefined, the |diff| still says something
        return only_diff


def print_accuracy(report: AccuracyReport, console: Any) -> None:
    """The report as a rich table: one row per metric, reference and variant side by side."""
    from rich.table import Table

    table = Table(title=f"{report.model}: accuracy of {report.variant} vs {report.reference} "
                        f"({report.items} synthetic items, labels ~ Bernoulli(p_fp32), seed {report.seed})"
                        + (f"; the first rows are output {next(iter(report.heads))!r}" if report.heads else ""))
    table.add_column("metric")
    table.add_column("reference", justify="right")
    table.add_column("variant", justify="right")
    table.add_column("change", justify="right")
    table.add_row("log-loss", f"{report.logloss_reference:.6f}", f"{report.logloss_variant:.6f}",
                  f"{report.logloss_variant - report.logloss_reference:+.2e}")
    table.add_row("normalized entropy", f"{report.ne_reference:.6f}", f"{report.ne_variant:.6f}",
                  f"{report.ne_change_pct:+.4f} %")
    table.add_row("max |score diff|", "", f"{report.max_abs_diff:.3e}", "")
    table.add_row("mean |score diff|", "", f"{report.mean_abs_diff:.3e}", "")
    table.add_row("base rate", f"{report.base_rate:.4f}", "", "")
    for head, numbers in list(report.heads.items())[1:]:  # the first head's numbers are the rows above
        if numbers.get("ne_reference") is not None:
            table.add_row(f"{head}: normalized entropy", f"{numbers['ne_reference']:.6f}",
                          f"{numbers['ne_variant']:.6f}", f"{numbers['ne_change_pct']:+.4f} %")
        table.add_row(f"{head}: max |diff|", "", f"{numbers['max_abs_diff']:.3e}", "")
        table.add_row(f"{head}: mean |diff|", "", f"{numbers['mean_abs_diff']:.3e}", "")
    console.print(table)
