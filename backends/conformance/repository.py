"""Conformance cases from a model repository: every version's card partitions, as a deployment sends them.

``python -m sixfold.backends.conformance NAME --repository REPO`` checks a backend on
exactly the partitions ``sixfold-serve --model-repository REPO`` would load on its
cards: each version's dense partitions (every pipeline stage), at the precision the
plan records, with the plan's layouts. The kit reads ``plan.json`` as the plain JSON
it is (this package imports nothing of sixfold's above ``backends``).

Inputs are generated from each partition's tensor facts (dtype, width, rows per item,
ragged rows counted by a lengths input); a later pipeline stage is fed what the stages
before it answer on ONNX Runtime, as serving feeds it. The values are random, not a
host stage's outputs: the comparison is against ONNX Runtime on the same inputs.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.backends.api import Arrays, PartitionArtifact, TensorLayout
from sixfold.backends.conformance.cases import Case, Reference, case_from_artifact

__all__ = ["repository_cases", "repository_versions"]

PLAN_FILE = "plan.json"
_DTYPES = {"FP32": np.float32, "FP16": np.float16, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32,
           "INT16": np.int16, "INT8": np.int8, "UINT8": np.uint8, "BOOL": np.bool_}


def repository_versions(root: str | Path) -> list[Path]:
    """Every ``ROOT/NAME/VERSION`` folder holding a plan.json (all versions, not only those a policy serves)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"--repository {root}: no such folder; give a model repository "
                                "(REPO/NAME/VERSION/plan.json, as sixfold-partition --out REPO/NAME/1 writes)")
    found = [v for m in sorted(root.iterdir()) if m.is_dir() and not m.name.startswith(".")
             for v in sorted(m.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1)
             if v.is_dir() and v.name.isdigit() and (v / PLAN_FILE).is_file()]
    if not found:
        raise ValueError(f"--repository {root}: no model version holds a {PLAN_FILE} (expected "
                         f"{root}/NAME/1/{PLAN_FILE}, written by sixfold-partition --out {root}/NAME/1)")
    return found


def _layout(tensor: Mapping[str, Any]) -> TensorLayout:
    return TensorLayout(rows_per_item=tensor.get("rows_per_item"), ragged_by=tensor.get("ragged_by"),
                        consumed=tensor.get("consumed", True), passed_on=tensor.get("passed_on", False))


def _artifact(folder: Path, info: Mapping[str, Any]) -> PartitionArtifact:
    where = folder / str(info.get("artifact") or "")
    if not info.get("artifact") or not where.is_file():
        raise ValueError(f"{folder / PLAN_FILE}: partition {info['name']!r} names no artifact file there "
                         f"({info.get('artifact')!r})")
    tensors = [*info["inputs"], *info["outputs"]]
    passthrough = [t["name"] for t in info["inputs"] if not t.get("consumed", True)]
    return PartitionArtifact(
        name=info["name"], format=info["format"], payload=where.read_bytes(),
        input_names=tuple(t["name"] for t in info["inputs"]), output_names=tuple(t["name"] for t in info["outputs"]),
        param_bytes=int(info.get("param_bytes", 0)), flops_per_item=float(info.get("flops_per_item", 0.0)),
        bytes_per_item=float(info.get("bytes_per_item", 0.0)), dtype=info.get("dtype", "fp32"),
        metadata={"repository_version": str(folder), "passthrough": passthrough},
        layouts={t["name"]: _layout(t) for t in tensors})


class _Feeder:
    """Inputs for one version's dense chain: generated where no stage makes them, else ONNX Runtime's answers."""

    def __init__(self, where: str, chain: list[tuple[PartitionArtifact, Mapping[str, Any]]], seed: int) -> None:
        self.where, self.chain, self.seed = where, chain, seed
        made = {n for art, _ in chain for n in art.output_names}
        self.tensors: dict[str, Mapping[str, Any]] = {}
        for _, info in chain:
            for t in info["inputs"]:
                if t["name"] not in made:
                    self.tensors.setdefault(t["name"], t)
        self.counts = {t.get("ragged_by") for t in self.tensors.values()} - {None}
        self.sessions: dict[str, Reference] = {}

    def _generate(self, rows: int, rng: np.random.Generator) -> Arrays:
        env: Arrays = {}
        for name in sorted(self.tensors, key=lambda n: self.tensors[n].get("rows_per_item") is None):
            t = self.tensors[name]
            dtype = _DTYPES.get(t["datatype"])
            if dtype is None:
                raise ValueError(f"{self.where}: input {name} has datatype {t['datatype']}, which the kit cannot "
                                 f"generate (known: {', '.join(_DTYPES)})")
            k, by = t.get("rows_per_item"), t.get("ragged_by")
            if k is not None:
                count = rows * int(k)
            elif by in env:
                count = int(np.sum(env[by]))
            else:
                raise ValueError(f"{self.where}: input {name} has {'rows counted by ' + by if by else 'an unknown'} "
                                 "rows per item, which no input of the partition gives; the kit cannot size it")
            shape = (count, *[int(d) for d in t["shape"][1:]])
            if np.dtype(dtype).kind == "f":
                env[name] = (0.5 * rng.standard_normal(shape)).astype(dtype)
            elif name in self.counts:  # lengths: 0..3 ids per (item, column)
                env[name] = rng.integers(0, 4, shape).astype(dtype)
            else:
                env[name] = rng.integers(0, 2, shape).astype(dtype)
        return env

    def feed(self, stage: int, rows: int) -> Arrays:
        rng = np.random.default_rng([self.seed, rows, zlib.crc32(self.where.encode())])
        env = self._generate(rows, rng)
        for artifact, _ in self.chain[:stage]:  # the stages before this one, as serving runs them
            session = self.sessions.setdefault(artifact.name, Reference(artifact))
            env.update(session.run(env))
        return {n: env[n] for n in self.chain[stage][0].input_names}


def _version_cases(folder: Path, root: Path, max_batch: int, seed: int) -> list[Case]:
    path = folder / PLAN_FILE
    try:
        plan = json.loads(path.read_text())
        dense = [p for p in plan["partitions"] if p["kind"] == "dense"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a sixfold plan ({type(exc).__name__}: {exc})") from None
    label = str(folder.relative_to(root))
    if not dense:
        raise ValueError(f"{path}: the plan has no dense partition; nothing runs on a card")
    other = [p["name"] for p in dense if p["format"] != "onnx"]
    if other:
        raise ValueError(f"{path}: dense partition(s) {other} are not ONNX; the kit compares ONNX partitions "
                         "with ONNX Runtime")
    chain = [(_artifact(folder, p), p) for p in dense]
    feeder = _Feeder(label, chain, seed)
    cases = []
    for k, (artifact, _) in enumerate(chain):
        case = case_from_artifact(f"{label}/{artifact.name}@{artifact.dtype}", artifact,
                                  lambda rows, k=k: feeder.feed(k, rows), range(1, max_batch + 1))
        case.notes["repository"] = label
        cases.append(case)
    return cases


def repository_cases(root: str | Path, *, max_batch: int = 64, seed: int = 0) -> list[Case]:
    """One case per dense partition of every model version in ``root`` (``NAME/VERSION/PARTITION@PRECISION``).

    ValueError or FileNotFoundError naming the folder or plan when ``root`` is not a repository the kit can read.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    root = Path(root)
    return [case for folder in repository_versions(root) for case in _version_cases(folder, root, max_batch, seed)]
