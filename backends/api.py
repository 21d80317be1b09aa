"""The vendor interface: a Backend loads a partition onto a device and returns an Executable.

Few required methods, the rest defaulted (like Glow's Backend and vLLM's
Platform). Tensors cross this boundary as ``dict[str, numpy.ndarray]``, so a
backend needs no torch. ``Executable.run`` is blocking and is called from one
worker thread per executable (a card runs one batch at a time);
``Executable.infer`` is the async entry the server awaits.

``BACKEND_API_VERSION`` versions this interface; a plug-in declares the version
it was written against in ``Backend.api_version`` and the registry refuses one
whose major differs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from sixfold.backends.os_threads import os_thread_name, start_worker_thread
from sixfold.backends.spec import DeviceSpec

__all__ = ["BACKEND_API_VERSION", "PartitionArtifact", "TensorLayout", "CardRef", "Backend", "Executable", "BackendError", "DoesNotFit",
           "Arrays", "parse_api_version", "api_version_problem"]

BACKEND_API_VERSION = "1.3"
"""The version of the vendor interface (``sixfold.backends``' ``__all__``), "MAJOR.MINOR".

MINOR goes up when something is added and every plug-in written against an
earlier minor of the same major keeps working unchanged (1.1 added
``PartitionArtifact.layouts`` and ``TensorLayout``; 1.2 ``DeviceLost``; 1.3
``PartitionArtifact.card`` and ``CardRef``) (a new optional method
with a default, a new field with a default, a new name in ``__all__``). MAJOR
goes up when a plug-in may have to change: a name removed or renamed, a required
method added, a signature, a tensor contract or a threading rule changed. A
plug-in states the version it was written against in ``Backend.api_version``;
the registry refuses (status "failed") one whose MAJOR differs from this one.
"""

Arrays = dict[str, np.ndarray]


class BackendError(RuntimeError):
    """A backend failed to load or run a partition; the message goes to the client."""


class DoesNotFit(BackendError):
    """The partition needs more device memory than is free; the message quotes both numbers."""


class DeviceLost(BackendError):
    """The device is gone for good (off the bus, fused off, a fatal ECC error): raised from ``run`` or ``load``,
    it takes the card out of rotation without the close-reload-probe restarts any other error gets."""


@dataclass(frozen=True)
class TensorLayout:
    """How one input or output of a partition is laid out over a batch's items, so that nobody guesses.

    A batch of N items is split into sub-batches (and their outputs rejoined) on these facts only,
    never on a tensor's length being divisible by N.
    """

    rows_per_item: int | None = None
    """Rows per item: item i's rows are ``[i*k, (i+1)*k)`` (1 for ``dense_features``, T for pooled
    bags laid out ``[N*T, E]``). None: the rows per item vary (ragged) or are unknown."""
    ragged_by: str | None = None
    """Ragged rows (one per id): the model input whose per-item sums count each item's rows
    (``sparse_lengths``). None with ``rows_per_item`` None: the layout is unknown."""
    consumed: bool = True
    """An input the partition reads. False: it only passes the input on, unchanged, to a later
    pipeline stage (it is also in ``PartitionArtifact.metadata["passthrough"]``)."""
    passed_on: bool = False
    """An input a later pipeline stage reads too: the executor carries it past this partition."""

    @property
    def per_item(self) -> bool:
        """Whether a batch can be cut between any two items on this tensor."""
        return self.rows_per_item is not None

    def to_dict(self) -> dict[str, Any]:
        return {"rows_per_item": self.rows_per_item, "ragged_by": self.ragged_by, "consumed": self.consumed,
                "passed_on": self.passed_on}


@dataclass(frozen=True)
class CardRef:
    """The physical card a load is for (Backend API 1.3), so a backend knows which device to compile for.

    One naming scheme everywhere: card ``index`` K is the K-th card of the server (``--cards N``: 0..N-1),
    the plan's device id ``cardK`` (plan.json ``devices`` and ``placements``), the ``card`` label ``cardK`` on
    /metrics and in logs, and the ``DeviceSpec`` given to ``load`` is named ``SPEC/cardK``. A pipeline replica
    spans several cards; each of its stages is loaded with its own card.
    """

    index: int
    """0-based index of the physical card among the server's cards."""
    spec: str
    """The name of that card's DeviceSpec as given (``m2-card``, ``mycard-x1``), without the ``/cardK`` suffix."""

    def __post_init__(self) -> None:
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"CardRef.index must be an int >= 0, got {self.index!r}")
        if not self.spec or "/" in self.spec:
            raise ValueError(f"CardRef.spec must be a device spec name without '/', got {self.spec!r}")

    @property
    def name(self) -> str:
        """``cardK``: the plan's device id and the metrics label."""
        return f"card{self.index}"

    @property
    def device_name(self) -> str:
        """``SPEC/cardK``: the name of the DeviceSpec ``load`` receives, and of the card's memory ledger."""
        return f"{self.spec}/{self.name}"


@dataclass
class PartitionArtifact:
    """One partition, ready to load: its format, its payload and what the cost model knows.

    ``format`` is "onnx" (payload: bytes or a path) or "torch-fx" (payload: a
    callable ``torch.nn.Module`` taking the inputs positionally in
    ``input_names`` order and returning a tuple in ``output_names`` order).
    """

    name: str
    format: str
    payload: Any
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    param_bytes: int = 0
    """Bytes of weights the partition holds on its device."""
    flops_per_item: float = 0.0
    """FLOPs per batch row (item), for the cost model."""
    bytes_per_item: float = 0.0
    """Device-memory bytes touched per batch row beyond the weights (activations, lookups)."""
    dtype: str = "fp32"
    metadata: dict[str, Any] = field(default_factory=dict)
    layouts: dict[str, TensorLayout] = field(default_factory=dict)
    """Per input and output name: its layout over the batch's items (``TensorLayout``). A name
    missing here has an unknown layout: the server never splits a batch on it."""
    card: CardRef | None = None
    """The physical card this load is for (index and DeviceSpec name; ``CardRef``). None: a load that is for
    no one physical card (the host fallback, a tool that loads on a spec alone). Backend API 1.3."""

    def for_card(self, card: CardRef) -> "PartitionArtifact":
        """This artifact, labelled for one card's load (a shallow copy: the payload is shared)."""
        return dataclasses.replace(self, card=card)


class Executable(ABC):
    """A partition loaded on one device. Subclasses implement ``run``; the rest is defaulted."""

    thread_safe: ClassVar[bool] = False
    """Whether ``run`` may be called from several threads at once (the server may then run a
    cheap batch on its event loop while another batch runs on the worker thread)."""

    def __init__(self, artifact: PartitionArtifact, device: DeviceSpec) -> None:
        self.artifact = artifact
        self.device = device
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self.worker_nice = 0
        """How much lower than the server's threads the worker thread runs (``sixfold.backends.os_threads``):
        0 for a card that computes on its own silicon; a simulated card sets it, see ``simcard``."""

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.artifact.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.artifact.output_names

    @abstractmethod
    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """Compute one batch, blocking. Raise BackendError (or any exception) on failure."""

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """Run one batch off the event loop, one at a time per executable (its own worker thread)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker(), self.run, inputs)

    def _worker(self) -> concurrent.futures.ThreadPoolExecutor:
        """This executable's one worker thread, started on first use (for subclasses overriding ``infer``)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self.device.name}-{self.artifact.name}",
                initializer=start_worker_thread,
                initargs=(os_thread_name(self.artifact.name, self.device.name), self.worker_nice))
        return self._executor

    def memory_bytes(self) -> int:
        """Device memory this executable holds (weights by default)."""
        return self.artifact.param_bytes

    def close(self) -> None:
        """Release the device resources; the default stops the worker thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def parse_api_version(text: object) -> tuple[int, int]:
    """("MAJOR.MINOR") -> (major, minor); ValueError quoting ``text`` when it is not that."""
    major, sep, minor = text.partition(".") if isinstance(text, str) else ("", "", "")
    if not (sep and major.isdigit() and minor.isdigit()):
        raise ValueError(f"api_version must be a \"MAJOR.MINOR\" string such as {BACKEND_API_VERSION!r}, "
                         f"got {text!r}")
    return int(major), int(minor)


def api_version_problem(declared: object) -> str:
    """Why a plug-in declaring Backend API ``declared`` cannot run on this sixfold ("" when it can).

    Refused: a malformed version, or a major other than ``BACKEND_API_VERSION``'s.
    A newer minor of the same major is accepted (the registry logs a warning:
    the plug-in may call something this sixfold lacks).
    """
    try:
        major, _ = parse_api_version(declared)
    except ValueError as exc:
        return str(exc)
    ours, _ = parse_api_version(BACKEND_API_VERSION)
    if major != ours:
        return (f"written against Backend API {declared}, but this sixfold provides Backend API "
                f"{BACKEND_API_VERSION} (major versions must match: "
                f"{'update sixfold' if major > ours else 'update the plug-in'})")
    return ""


class Backend(ABC):
    """A kind of device sixfold can run partitions on.

    Required: ``name`` and ``load``. Defaulted: ``formats``/``supports`` (which
    partitions it takes), ``devices`` (what it finds on this machine),
    ``available`` (whether its runtime is importable here), ``api_version``.
    """

    name: ClassVar[str]
    formats: ClassVar[tuple[str, ...]] = ("onnx",)
    api_version: ClassVar[str] = BACKEND_API_VERSION
    """The Backend API ("MAJOR.MINOR", see ``BACKEND_API_VERSION``) this backend was written against.
    A plug-in sets it to the version it was built and tested with; the registry refuses one whose
    major differs from this sixfold's."""

    def __init__(self, **options: Any) -> None:
        self.options = options

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Whether this backend can run here, and why not when it cannot."""
        return True, ""

    def devices(self) -> list[DeviceSpec]:
        """Devices this backend found on this machine (empty: the caller supplies specs)."""
        return []

    def supports(self, artifact: PartitionArtifact) -> bool:
        return artifact.format in self.formats

    @abstractmethod
    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        """Load ``artifact`` on ``device``; raise DoesNotFit when it cannot fit."""


def pick_artifact(partition: str, candidates: list[PartitionArtifact], backend: Backend) -> PartitionArtifact:
    """The first of ``candidates`` (one partition in its formats) that ``backend.supports()``; else ValueError
    naming each format with its precision, since a backend declines either (an fp32-only card, an fp16 plan)."""
    for candidate in candidates:
        if backend.supports(candidate):
            return candidate
    have = [a.format for a in candidates]
    dtypes = sorted({a.dtype for a in candidates})
    raise ValueError(f"backend {backend.name!r} takes none of partition {partition}'s formats {have} at "
                     f"precision {'/'.join(dtypes)} (its supports() declines each: the format, or the precision; "
                     "partition at a precision it takes, e.g. --dense-precision fp32)")
