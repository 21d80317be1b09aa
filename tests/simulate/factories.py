"""Platforms with hand-set stage times, so a test knows every simulated latency exactly."""

from __future__ import annotations

from dataclasses import dataclass, field

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.pricing.cost import PartitionCost
from sixfold.simulate.platform import Platform, StageModel

_COST = PartitionCost(param_bytes=0, flops_per_item=0.0, bytes_per_item=0.0, weight_bytes_per_batch=0)


@dataclass(eq=False)
class LinearStage(StageModel):
    """``fixed + per_item x rows`` seconds a batch."""

    fixed: float = 0.0
    per_item: float = 0.0
    _memo: dict = field(default_factory=dict, repr=False)

    def seconds(self, rows: int) -> float:
        return self.fixed + self.per_item * rows


def linear_stage(name: str, fixed: float = 0.0, per_item: float = 0.0) -> LinearStage:
    return LinearStage(name, load_spec("m2-card"), _COST, fixed=fixed, per_item=per_item)


def linear_platform(*, cards: int = 1, host: tuple[float, float] = (0.0, 0.0), card: tuple[float, float] = (1e-3, 0.0),
                    host_dense: tuple[float, float] | None = None, per_request_s: float = 0.0) -> Platform:
    """A platform whose host, card and host-dense stages take ``fixed + per_item x rows`` seconds."""
    return Platform(
        model="linear", plan=None, host=linear_stage("host", *host),
        lanes=[[linear_stage(f"card{i}", *card)] for i in range(cards)],
        host_dense=None if host_dense is None else linear_stage("host-dense", *host_dense),
        card_spec=load_spec("m2-card"), host_spec=load_spec("host-cpu"), cards=cards, ids_per_item=1.0,
        table_bytes=0, per_request_s=per_request_s)
