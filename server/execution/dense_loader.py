"""Load a plan's dense part as the lanes the router picks from: one per card, or one per pipeline.

Replicated plans give one lane per placed card. Pipelined plans give one lane
per pipeline replica: a ``PipelineExecutable`` that runs the replica's stages in
order, each on its own card, and looks like one dense executable to the
runtime (same input and output names, async ``infer``). Because each stage is
its own executable with its own worker, batch k+1 can run stage 0 while batch k
runs stage 1: the cards overlap like a real pipeline.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from sixfold.backends.api import Arrays, Backend, BackendError, CardRef, Executable, PartitionArtifact
from sixfold.backends.spec import DeviceSpec
from sixfold.partitioner.plan import PartitionPlan

__all__ = ["load_dense", "PipelineExecutable", "ReloadLane"]

ReloadLane = Callable[[int], Executable]


def _card(plan: PartitionPlan, device_id: str) -> DeviceSpec:
    # Each card is its own device (memory budget, queue), even when all share one spec.
    spec = plan.device(device_id).spec
    return dataclasses.replace(spec, name=f"{spec.name}/{device_id}")


def _card_ref(plan: PartitionPlan, device_id: str) -> CardRef | None:
    """The physical card a load is for (Backend API 1.3), from the plan's device id ``cardK``."""
    index, spec = device_id.removeprefix("card"), plan.device(device_id).spec.name
    return CardRef(int(index), spec) if index.isdigit() and spec and "/" not in spec else None


class PipelineExecutable(Executable):
    """Stages of one pipeline replica run in order; each reads its inputs from all values seen so far.

    Inputs are the first stage's (the dense partition's), outputs the last
    stage's. Values a stage only passes through are carried here rather than
    sent back by the card. ``run`` is blocking; ``infer`` awaits each stage's
    own ``infer`` so stages of different batches overlap.
    """

    def __init__(self, stages: Sequence[Executable], name: str = "dense") -> None:
        if not stages:
            raise ValueError("a pipeline needs at least one stage")
        first, last = stages[0].artifact, stages[-1].artifact
        artifact = PartitionArtifact(
            name=name, format=first.format, payload=None, input_names=tuple(first.input_names),
            output_names=tuple(last.output_names), param_bytes=sum(s.artifact.param_bytes for s in stages),
            flops_per_item=sum(s.artifact.flops_per_item for s in stages),
            bytes_per_item=sum(s.artifact.bytes_per_item for s in stages), dtype=first.dtype,
            metadata={"stages": [s.artifact.name for s in stages]},
            layouts={**{n: v for n, v in last.layouts.items() if n in last.output_names},
                     **{n: v for n, v in first.layouts.items() if n in first.input_names}})
        super().__init__(artifact, stages[0].device)
        self.stages = list(stages)
        available = set(first.input_names)
        for stage in self.stages:
            missing = [n for n in stage.input_names if n not in available]
            if missing:
                raise ValueError(f"pipeline stage {stage.artifact.name} reads {missing}, which no earlier "
                                 f"stage produces (have {sorted(available)})")
            available |= set(stage.output_names)
        if all(callable(getattr(s, "stats", None)) for s in self.stages):
            self.stats = self._stats  # simulated cards: expose their lag like a single card does

    def _feed(self, stage: Executable, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {n: env[n] for n in stage.input_names}

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        env = dict(inputs)
        for stage in self.stages:
            env.update(stage.run(self._feed(stage, env)))
        return {n: env[n] for n in self.output_names}

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        env = dict(inputs)
        for stage in self.stages:
            try:
                env.update(await stage.infer(self._feed(stage, env)))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - say which card of the pipeline failed
                raise BackendError(f"pipeline stage {stage.artifact.name} on {stage.device.name}: {exc}") from exc
        return {n: env[n] for n in self.output_names}

    def _stats(self):  # noqa: ANN202 - SimCardStats summed over the stages
        snapshots = [s.stats() for s in self.stages]  # type: ignore[attr-defined]
        first = snapshots[0]
        total = {f.name: sum(getattr(s, f.name) for s in snapshots) for f in dataclasses.fields(first)}
        total["max_lag_s"] = max(s.max_lag_s for s in snapshots)
        return dataclasses.replace(first, **total)

    def memory_bytes(self) -> int:
        return sum(s.memory_bytes() for s in self.stages)

    def close(self) -> None:
        """Close every stage (each gives its card's memory back), even when one fails to."""
        errors = []
        for stage in self.stages:
            try:
                stage.close()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        super().close()
        if errors:
            raise errors[0]


def _lanes(plan: PartitionPlan) -> list[list[tuple[str, str]]]:
    """[(partition, device id) per stage] per lane, in replica order."""
    stages = plan.dense_stages()
    if not stages:
        raise ValueError(f"plan {plan.model} has no dense partition")
    if len(stages) == 1:
        return [[(stages[0], d)] for d in plan.devices_of(stages[0])]
    by_replica: dict[int, dict[str, str]] = {}
    for p in plan.placements:
        if p.partition in stages:
            by_replica.setdefault(p.replica, {})[p.partition] = p.device
    lanes = []
    for replica in sorted(by_replica):
        placed = by_replica[replica]
        missing = [s for s in stages if s not in placed]
        if missing:
            raise ValueError(f"plan {plan.model}: pipeline replica {replica} has no card for stage(s) {missing}")
        lanes.append([(s, placed[s]) for s in stages])
    return lanes


def load_dense(plan: PartitionPlan, artifact_for: Callable[[str], PartitionArtifact],
               card_backend: Backend) -> tuple[list[Executable], ReloadLane]:
    """Load every dense lane of ``plan`` on ``card_backend``: (lanes, reload lane i).

    ``artifact_for(partition)`` gives the artifact of a dense partition ("dense"
    or "dense.K") in a format ``card_backend`` takes. A lane that fails to load
    closes what it loaded before the error propagates.
    """
    lanes = _lanes(plan)
    if not lanes:
        raise ValueError(f"plan {plan.model} places its dense part on no card")
    artifacts = {name: artifact_for(name) for name in plan.dense_stages()}

    def load(i: int) -> Executable:
        loaded: list[Executable] = []
        try:
            for partition, device in lanes[i]:
                card = _card_ref(plan, device)
                artifact = artifacts[partition] if card is None else artifacts[partition].for_card(card)
                loaded.append(card_backend.load(artifact, _card(plan, device)))
        except BaseException:
            for executable in loaded:
                executable.close()
            raise
        if len(loaded) == 1:
            return loaded[0]
        return PipelineExecutable(loaded, name=f"dense/pipeline{i}")

    executables: list[Executable] = []
    try:
        for i in range(len(lanes)):
            executables.append(load(i))
    except BaseException:
        for executable in executables:
            executable.close()
        raise
    return executables, load
