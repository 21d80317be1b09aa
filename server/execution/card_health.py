"""Card health: how long a card should take on a batch, and when it is late or hung.

A card's batch is priced by the same roofline the partitioner's plan and the
simulated card use (``DeviceSpec``: transfers in and out plus compute on FLOPs
and bytes). From that expected time ``E`` (the card's queued work included):

    hang deadline  D = min(cap, max(floor, multiple x E))
    hedge point    H = hedge_fraction x D       (0: never hedge)

A batch still running at ``H`` is copied to an idle healthy card (first answer
wins); a card still running a batch at ``D`` is hung: taken out of rotation,
restarted, and probed with a one-item batch before it rejoins. The floor
absorbs what the model does not price (the host's own scheduling, a simulated
card's lag on a busy host); the multiple scales with big batches on slow cards.

Failures carry a metrics reason of their own (``card_hang``, ``card_error``,
``no_healthy_card``, ``host_fallback_error``), all UNAVAILABLE to the client.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sixfold.backends.api import Executable

from sixfold.server.errors import InvalidInput, Unavailable

__all__ = ["CardDeadlines", "expected_card_seconds", "CardHang", "CardError", "NoHealthyCardLeft",
           "HostFallbackError", "one_item", "lane_card_ids", "lane_name", "same_failure", "BatchRefusedByEveryPath"]


@dataclass(frozen=True)
class CardDeadlines:
    """When a card's batch is late (hedge) and when the card is hung, from its expected time."""

    multiple: float = 10.0
    """Hang deadline as a multiple of the expected card time (0: the floor alone)."""
    floor_s: float = 0.5
    """Shortest hang deadline: covers host-side delays the cost model does not price."""
    cap_s: float = 30.0
    """Longest hang deadline, whatever the estimate (``card_timeout_s``)."""
    hedge_fraction: float = 0.25
    """Hedge point as a fraction of the hang deadline (0: no hedged copies)."""

    def __post_init__(self) -> None:
        for name, said in (("multiple", "card_timeout_multiple (--card-timeout-multiple)"),
                           ("floor_s", "card_timeout_floor_s (--card-timeout-floor-ms)"), ("cap_s", "card_timeout_s")):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{said} must be a finite number >= 0, got {value!r}")
        if self.cap_s <= 0 or (self.floor_s <= 0 and self.multiple <= 0):
            raise ValueError(f"card hang deadline would be 0 (floor {self.floor_s} s, multiple {self.multiple}, "
                             f"cap {self.cap_s} s): set a floor or a multiple > 0")
        if not 0 <= self.hedge_fraction < 1:
            raise ValueError(f"hedge_fraction must be in [0, 1) (0: off), got {self.hedge_fraction}")

    def hang_after(self, expected_s: float) -> float:
        """Seconds a batch expected to take ``expected_s`` may run before its card counts as hung."""
        return min(self.cap_s, max(self.floor_s, self.multiple * expected_s))

    def hedge_after(self, expected_s: float) -> float | None:
        """Seconds after which a copy goes to another card (None: never)."""
        return self.hedge_fraction * self.hang_after(expected_s) if self.hedge_fraction > 0 else None


def _stage_seconds(executable: Executable, rows: int, in_bytes: float, out_bytes: float) -> float:
    # NOTE: an executable that models its own time (the simulated card, a vendor's calibrated
    # model) says so with ``expected_seconds(rows, in_bytes, out_bytes)``; else the spec's roofline.
    own = getattr(executable, "expected_seconds", None)
    if callable(own):
        return float(own(rows, in_bytes, out_bytes))
    device, artifact = executable.device, executable.artifact
    return (device.transfer_seconds(in_bytes)
            + device.compute_seconds(artifact.flops_per_item * rows,
                                     artifact.param_bytes + artifact.bytes_per_item * rows, artifact.dtype)
            + device.transfer_seconds(out_bytes))


def expected_card_seconds(executable: Executable, rows: int, inputs: Mapping[str, np.ndarray]) -> float:
    """Modelled time of one batch on this executable's card (each stage of a pipeline lane, summed).

    The spec's roofline, as the partitioner's plan priced it and the simulated card charges it
    (``sixfold.backends.builtin.simcard.service_seconds``, times a throttled simcard's ``slow_factor``).
    """
    in_bytes = float(sum(inputs[n].nbytes for n in executable.input_names if n in inputs))
    out_bytes = 4.0 * rows * max(1, len(executable.output_names))  # fp32 scores: the outputs are small
    stages: Sequence[Executable] = getattr(executable, "stages", None) or [executable]
    return sum(_stage_seconds(stage, rows, in_bytes, out_bytes) for stage in stages)


def lane_card_ids(lane: Executable, index: int) -> tuple[str, ...]:
    """The plan's ids of the physical cards serving lane ``index`` (``cardK``; a pipeline lane: one per stage).

    A card's executable is loaded on a DeviceSpec named ``SPEC/cardK`` (``CardRef.device_name``); one
    loaded on a bare spec (a test, a tool) is named ``card<lane>``.
    """
    stages: Sequence[Executable] = getattr(lane, "stages", None) or [lane]
    ids = []
    for stage in stages:
        name = str(getattr(getattr(stage, "device", None), "name", ""))
        ids.append(name.rsplit("/", 1)[1] if "/" in name else f"card{index}")
    return tuple(ids)


def lane_name(lane: Executable, index: int) -> str:
    """How texts name lane ``index``: ``cardK`` for a one-card lane, ``replica R (cards a,b,c)`` for a pipeline's.

    NOTE: a pipeline lane is a replica spanning several cards; naming it ``card<lane>`` made
    "card1" mean replica 1 in texts and plan card 1 on /metrics.
    """
    ids = lane_card_ids(lane, index)
    if getattr(lane, "stages", None) is None:
        return ids[0]
    return f"replica {index} (cards {','.join(i.removeprefix('card') for i in ids)})"


def _root(exc: BaseException) -> BaseException:
    """The innermost cause of ``exc`` (wrappers such as a pipeline stage's BackendError add the card's name)."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def same_failure(a: BaseException, b: BaseException) -> bool:
    """Whether two paths failed a batch the same way: the same innermost error type and text.

    A card-specific fault names its card or differs in kind (a crash, a lost device); an error the
    batch itself causes (ONNX Runtime's INVALID_ARGUMENT on a dimension) reads the same on every path.
    """
    ra, rb = _root(a), _root(b)
    return type(ra) is type(rb) and str(ra) == str(rb)


def one_item(inputs: Mapping[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """The first item of a batch (each input keeps its rows per item): a restarted card's probe."""
    return {n: np.ascontiguousarray(a[:a.shape[0] // rows]) for n, a in inputs.items()}


class BatchRefusedByEveryPath(InvalidInput):
    """Every path the batch took (two cards, or a card and the host fallback) failed it the same way:
    the error is the request's (its shape), not a card's, so no card leaves rotation."""


class CardHang(Unavailable):
    """The batch's cards did not answer within their hang deadlines."""

    reason = "card_hang"


class CardError(Unavailable):
    """The batch's cards failed it (an error from the backend)."""

    reason = "card_error"


class NoHealthyCardLeft(Unavailable):
    """Every card is out of rotation (hung, failed, restarting) and no host fallback exists."""

    reason = "no_healthy_card"


class HostFallbackError(Unavailable):
    """The cards could not answer and the host's dense fallback failed too."""

    reason = "host_fallback_error"
