"""Placement strategies: given partition costs and devices, decide which device runs what.

Policy only: no graph, no tensors.

- ``replicate`` puts the dense partition on every card that fits it (data
  parallel) and the sparse partition on the host.
- ``pipeline`` splits the dense partition into S contiguous stages of its
  units (``GraphCosts``, measured by ``pipeline.node_costs``), one stage per
  card, and makes floor(C / S) pipeline replicas of C cards. For each S it
  finds the cut points minimising the bottleneck stage time by dynamic
  programming over the topological order::

      best[s][j] = min over i < j of max(best[s-1][i], time(i, j))
      time(i, j) = link(in bytes) + roofline(FLOPs, weights) + link(out bytes)

  subject to weights(i, j) x ACTIVATION_HEADROOM <= card memory, a learned weight in
  every stage (no stage of only weightless ops: a lone concat rides with its neighbour) and a cut
  only where every crossing value is a batch-major tensor. It keeps the S with the
  highest throughput bound, floor(C / S) x rows / bottleneck (ties: fewer
  stages, i.e. lower latency).
- ``choose`` resolves "auto": replicate when the dense partition fits a card,
  else pipeline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sixfold.backends.memory import format_bytes
from sixfold.backends.spec import DeviceSpec

from sixfold.partitioner.pricing.cost import PartitionCost, stage_seconds
from sixfold.partitioner.plan import DeviceInfo, Placement

if TYPE_CHECKING:
    from sixfold.partitioner.cut.pipeline import GraphCosts

__all__ = ["PlanError", "ACTIVATION_HEADROOM", "STRATEGIES", "replicate", "pipeline", "choose",
           "auto_refusal", "PipelineChoice", "stage_name"]

ACTIVATION_HEADROOM = 1.10
"""A card must hold the weights plus this fraction for activations and runtime."""

STRATEGIES = ("auto", "replicate", "pipeline")


class PlanError(ValueError):
    """The model cannot be placed; the message quotes the numbers."""


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _two(a: float, b: float) -> tuple[str, str]:
    # NOTE: "needs 0.3 MiB; has 0.3 MiB" helps nobody: when both round alike, add the bytes.
    fa, fb = format_bytes(a), format_bytes(b)
    return (f"{fa} ({int(a)} B)", f"{fb} ({int(b)} B)") if fa == fb else (fa, fb)


def _need(param_bytes: int) -> int:
    return int(param_bytes * ACTIVATION_HEADROOM)


def stage_name(dense_partition: str, index: int) -> str:
    """The plan name of pipeline stage ``index`` ("dense.0", "dense.1", ...)."""
    return f"{dense_partition}.{index}"


def _fits(dense_cost: PartitionCost, cards: list[DeviceInfo]) -> list[DeviceInfo]:
    return [c for c in cards if c.spec.memory_bytes >= _need(dense_cost.param_bytes)]


def _too_big(dense_cost: PartitionCost, cards: list[DeviceInfo]) -> str:
    largest = max(cards, key=lambda c: c.spec.memory_bytes)
    return (f"dense partition needs {_gib(_need(dense_cost.param_bytes))} (weights {_gib(dense_cost.param_bytes)} + "
            f"{ACTIVATION_HEADROOM - 1:.0%} headroom); largest card {largest.id} "
            f"({largest.spec.name}) has {_gib(largest.spec.memory_bytes)}")


def auto_refusal(dense_cost: PartitionCost, cards: list[DeviceInfo], pipeline_error: PlanError) -> PlanError:
    """Why "auto" placed nothing: the dense part fits no card, and the pipeline's own reason."""
    return PlanError(f"{_too_big(dense_cost, cards)}, and it cannot be pipelined either: {pipeline_error}")


def replicate(host_partition: str, dense_partition: str, dense_cost: PartitionCost,
              host: DeviceInfo, cards: list[DeviceInfo]) -> list[Placement]:
    """Host runs the sparse partition; every card that fits the dense partition gets a replica."""
    if not cards:
        raise PlanError("no cards to place the dense partition on (need --cards >= 1)")
    fitting = _fits(dense_cost, cards)
    if not fitting:
        raise PlanError(f"{_too_big(dense_cost, cards)}; try --strategy pipeline")
    placements = [Placement(partition=host_partition, device=host.id)]
    placements += [Placement(partition=dense_partition, device=c.id, replica=i) for i, c in enumerate(fitting)]
    return placements


def choose(strategy: str, dense_cost: PartitionCost, cards: list[DeviceInfo]) -> str:
    """The strategy to run: ``strategy`` itself, or for "auto" replicate when the dense part fits a card."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; available: {', '.join(STRATEGIES)}")
    if strategy != "auto":
        return strategy
    return "replicate" if _fits(dense_cost, cards) or not cards else "pipeline"


@dataclass(frozen=True)
class PipelineChoice:
    """The cut points a pipeline policy chose, and why (its modelled stage times)."""

    cuts: tuple[int, ...]
    """Unit index where each stage after the first starts (``GraphCosts.nodes`` order)."""
    stage_names: tuple[str, ...]
    stage_seconds: tuple[float, ...]
    """Modelled time of one batch of ``batch_rows`` per stage, transfers included."""
    stage_param_bytes: tuple[int, ...]
    replicas: int
    batch_rows: int
    placements: tuple[Placement, ...]

    @property
    def bottleneck_seconds(self) -> float:
        return max(self.stage_seconds)

    @property
    def throughput_items_per_s(self) -> float:
        return self.replicas * self.batch_rows / self.bottleneck_seconds if self.bottleneck_seconds > 0 else math.inf


class _StageModel:
    """Stage time and weight bytes of every contiguous unit range, on one card spec."""

    def __init__(self, costs: GraphCosts, spec: DeviceSpec, batch_rows: int) -> None:
        self.costs, self.spec, self.rows = costs, spec, batch_rows
        self.n = len(costs.nodes)
        self.cuttable = [costs.can_cut(i) for i in range(self.n + 1)]
        self.live_bytes = [costs.live_bytes_per_item(i) if self.cuttable[i] else 0.0 for i in range(self.n + 1)]
        self.flops = [0.0]
        for node in costs.nodes:
            self.flops.append(self.flops[-1] + node.flops_per_item)
        self._weights: dict[tuple[int, int], int] = {}
        self._seconds: dict[tuple[int, int], float] = {}
        self.capacity = spec.memory_bytes

    def weights(self, i: int, j: int) -> int:
        key = (i, j)
        if key not in self._weights:
            self._weights[key] = self.costs.stage_param_bytes(i, j)
        return self._weights[key]

    def weighted(self, i: int, j: int) -> bool:
        """A stage holds weights (a lone concat is not worth a card and a transfer), unless no node has any."""
        return self.costs.stage_has_weights(i, j) or not self.costs.stage_has_weights(0, self.n)

    def fits(self, i: int, j: int) -> bool:
        return _need(self.weights(i, j)) <= self.capacity

    def io_per_item(self, i: int, j: int) -> tuple[float, float]:
        return self.live_bytes[i], self.costs.produced_bytes_per_item(i, j)

    def cost(self, i: int, j: int) -> PartitionCost:
        inp, out = self.io_per_item(i, j)
        weights = self.weights(i, j)
        return PartitionCost(param_bytes=weights, flops_per_item=self.flops[j] - self.flops[i],
                             bytes_per_item=inp + out, weight_bytes_per_batch=weights)

    def seconds(self, i: int, j: int) -> float:
        key = (i, j)
        if key not in self._seconds:
            inp, out = self.io_per_item(i, j)
            self._seconds[key] = stage_seconds(self.spec, self.cost(i, j), self.rows, inp * self.rows,
                                               out * self.rows)
        return self._seconds[key]

    def fewest_stages(self) -> int | None:
        """Fewest stages that fit (greedy: each stage as long as fits is optimal), None if none do."""
        i, stages = 0, 0
        while i < self.n:
            j = max((j for j in range(i + 1, self.n + 1) if self.cuttable[j] and self.fits(i, j)), default=None)
            if j is None:
                return None
            i, stages = j, stages + 1
        return stages

    def best_cuts(self, stages: int) -> tuple[float, list[int]] | None:
        """Cut points into ``stages`` stages minimising the slowest stage; None when none fit."""
        inf = math.inf
        best = [[inf] * (self.n + 1) for _ in range(stages + 1)]
        back = [[-1] * (self.n + 1) for _ in range(stages + 1)]
        best[0][0] = 0.0
        for s in range(1, stages + 1):
            for j in range(s, self.n + 1):
                if not self.cuttable[j]:
                    continue
                for i in range(s - 1, j):
                    if best[s - 1][i] == inf or not self.fits(i, j) or not self.weighted(i, j):
                        continue
                    t = max(best[s - 1][i], self.seconds(i, j))
                    if t < best[s][j]:
                        best[s][j], back[s][j] = t, i
        if best[stages][self.n] == inf:
            return None
        cuts, j = [], self.n
        for s in range(stages, 0, -1):
            j = back[s][j]
            cuts.append(j)
        return best[stages][self.n], sorted(cuts)[1:]  # drop the leading 0


def _explain_unfit(model: _StageModel, cards: list[DeviceInfo], smallest: DeviceInfo) -> str:
    costs, memory = model.costs, smallest.spec.memory_bytes
    card = f"smallest card {smallest.id} ({smallest.spec.name})"
    for i, node in enumerate(costs.nodes):
        if not model.fits(i, i + 1):
            w = model.weights(i, i + 1)
            need, have = _two(_need(w), memory)
            return (f"dense node {node.name} alone needs {need} (weights {format_bytes(w)} + "
                    f"{ACTIVATION_HEADROOM - 1:.0%} headroom); {card} has {have}; a pipeline cannot split one node")
    fewest = model.fewest_stages()
    total = format_bytes(costs.stage_param_bytes(0, model.n))
    if fewest is None:
        return (f"dense partition (weights {total}) cannot be cut into stages that fit the {card} "
                f"({format_bytes(memory)}): the values crossing every fitting cut are not batch-major tensors")
    return (f"dense partition (weights {total}) needs at least {fewest} pipeline stages of at most "
            f"{format_bytes(memory / ACTIVATION_HEADROOM)} weights each ({card} has {format_bytes(memory)}); "
            f"there are {len(cards)} cards")


def pipeline(host_partition: str, dense_partition: str, costs: GraphCosts, host: DeviceInfo,
             cards: list[DeviceInfo], *, batch_rows: int, stages: int | None = None) -> PipelineChoice:
    """Split the dense partition into stages across ``cards`` (see the module docstring).

    Stage k of replica r runs on card ``r * S + k``; the C mod S cards left over
    stay idle. Stages are planned for the smallest card (the cards are
    expected to be alike). ``stages`` forces S. PlanError quotes the numbers
    when no split fits.
    """
    if not cards:
        raise PlanError("no cards to place the dense partition on (need --cards >= 1)")
    if not costs.nodes:
        raise PlanError("the dense partition has no computing nodes to pipeline")
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be >= 1, got {batch_rows}")
    smallest = min(cards, key=lambda c: c.spec.memory_bytes)
    model = _StageModel(costs, smallest.spec, batch_rows)
    limit = min(len(cards), model.n)
    if stages is not None and not 1 <= stages <= limit:
        raise PlanError(f"cannot make {stages} pipeline stages: {len(cards)} cards and "
                        f"{model.n} dense nodes allow 1..{limit}")
    options: list[tuple[float, int, list[int]]] = []  # (-throughput, S, cuts)
    for s in [stages] if stages is not None else range(1, limit + 1):
        found = model.best_cuts(s)
        if found is None:
            continue
        bottleneck, cuts = found
        replicas = len(cards) // s
        options.append((-(replicas * batch_rows / bottleneck) if bottleneck > 0 else -math.inf, s, cuts))
    if not options:
        if stages is not None and model.fewest_stages() is not None and model.fewest_stages() <= stages:
            raise PlanError(f"cannot make {stages} pipeline stages that each hold weights: the dense partition's "
                            f"weighted nodes allow fewer (a stage of only weightless ops, a lone concat say, "
                            "is merged with its neighbour); ask for fewer --stages")
        raise PlanError(_explain_unfit(model, cards, smallest))
    _, s, cuts = min(options, key=lambda o: (o[0], o[1]))
    bounds = [0, *cuts, model.n]
    names = tuple(stage_name(dense_partition, k) for k in range(s))
    placements = [Placement(partition=host_partition, device=host.id)]
    for r in range(len(cards) // s):
        placements += [Placement(partition=names[k], device=cards[r * s + k].id, replica=r) for k in range(s)]
    return PipelineChoice(
        cuts=tuple(cuts), stage_names=names,
        stage_seconds=tuple(model.seconds(a, b) for a, b in zip(bounds[:-1], bounds[1:])),
        stage_param_bytes=tuple(model.weights(a, b) for a, b in zip(bounds[:-1], bounds[1:])),
        replicas=len(cards) // s, batch_rows=batch_rows, placements=tuple(placements))
