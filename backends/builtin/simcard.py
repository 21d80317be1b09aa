"""simcard: a simulated accelerator card that computes real outputs on modelled time.

Each loaded partition is a card worker with its own queue (one thread, one
batch at a time) and a share of its device's memory budget. The outputs are
real: a *functional* backend (ONNX Runtime by default) computes them. The
time is modelled: a batch of ``rows`` rows costs, from its ``DeviceSpec``,

    service = transfer(input bytes)
            + compute(flops_per_item * rows, param_bytes + bytes_per_item * rows, dtype)
            + transfer(output bytes)

and the card serves batches in arrival order::

    start  = max(arrival, busy_until)
    finish = start + service            # busy_until := finish
    result released at max(actual finish, finish)

When the real computation finishes after the modelled finish, the host could
not keep up with the card it simulates: that is *simulation lag*. It is counted
in ``stats()`` (``lagged_batches``, ``total_lag_s``), never hidden, so a
benchmark run on simcard says when its numbers are the host's, not the card's.

Time is injected (``clock``, ``sleep``) so tests are exact with a fake clock.
``faults`` injects failures for server tests: ``crash_after`` (batches served
before every later batch fails), ``hang`` (those batches never finish instead;
with no ``crash_after``, every batch hangs), ``stall_s`` (those batches answer
that many seconds late instead: a stalled card that recovers; with no
``crash_after``, every batch stalls) and ``slow_factor`` (service time
multiplier, e.g. a throttled card). ``shared_timelines`` (a folder) makes the copies of a card in
several processes one card (``sixfold.backends.builtin.shared_timeline``): ``sixfold-serve --workers N`` sets it.

Cards that load the same partition share one functional executable when it is thread-safe
(``share_functional``, default on): the simulation needs the right numbers, not six copies of
the weights. Each card keeps its own worker, queue, timeline, faults and memory budget. On the
2-core host, six threads on 64-117-row parts of dlrm-mlperf's dense partition computed 42.2-50.5k
items/s with one onnxruntime session against 35.5-43.7k with one session each (``bench/shared_session.py``):
each session streams its own 9 MB of weights through the caches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sixfold.backends.api import Arrays, Backend, BackendError, Executable, PartitionArtifact
from sixfold.backends.memory import check_fits, format_bytes
from sixfold.backends.options import bool_option, int_option, reject_unknown
from sixfold.backends.builtin.shared_timeline import SharedTimeline, payload_digest
from sixfold.backends.spec import DeviceSpec

__all__ = ["SimCardBackend", "SimCardExecutable", "SimCardStats", "Faults", "service_seconds"]

DEFAULT_WORKER_NICE = 5
"""Simulated cards' worker threads run this much nicer than the server's (see ``SimCardBackend``).
Measured on dlrm-mlperf at 25 q/s, 3 alternated rounds: host stage p99 19.7 / 17.9 / 21.6 ms against
26.9 / 23.1 / 26.1 at 0, client p99 59.2 / 58.0 / 59.1 against 64.2 / 58.0 / 64.8."""

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]


@dataclass(frozen=True)
class SimCardStats:
    """What one simulated card has done so far."""

    batches: int = 0
    rows: int = 0
    modelled_busy_s: float = 0.0
    """Sum of modelled service times: the card's busy time."""
    actual_compute_s: float = 0.0
    """Sum of the functional backend's real compute times on the host."""
    lagged_batches: int = 0
    """Batches whose real computation finished after their modelled finish."""
    total_lag_s: float = 0.0
    """Sum over lagged batches of (actual finish - modelled finish)."""
    max_lag_s: float = 0.0
    outstanding: int = 0
    """Batches accepted by ``infer`` and not yet returned (queued, computing, or waiting for release)."""


@dataclass(frozen=True)
class Faults:
    """Injected misbehaviour (see the module docstring)."""

    crash_after: int | None = None
    hang: bool = False
    slow_factor: float = 1.0
    stall_s: float = 0.0

    @classmethod
    def parse(cls, faults: Mapping[str, Any] | None) -> "Faults":
        faults = dict(faults or {})
        reject_unknown("simcard (faults)", faults, ("crash_after", "hang", "slow_factor", "stall_s"))
        crash_after = faults.get("crash_after")
        if crash_after is not None:
            crash_after = int_option("simcard", "faults.crash_after", crash_after)
        slow = faults.get("slow_factor", 1.0)
        if isinstance(slow, bool) or not isinstance(slow, (int, float)) or not slow > 0:
            raise BackendError(f"backend simcard: faults.slow_factor must be a number > 0, got {slow!r}")
        stall = faults.get("stall_s", 0.0)
        if isinstance(stall, bool) or not isinstance(stall, (int, float)) or not 0 <= stall < float("inf"):
            raise BackendError(f"backend simcard: faults.stall_s must be a number >= 0 (seconds), got {stall!r}")
        return cls(crash_after=crash_after, hang=bool(faults.get("hang", False)), slow_factor=float(slow),
                   stall_s=float(stall))

    def fails(self, index: int) -> bool:
        """Whether batch number ``index`` (0-based, in arrival order) is hit by crash/hang/stall."""
        if self.crash_after is not None:
            return index >= self.crash_after
        return self.hang or self.stall_s > 0


def _rows(inputs: Mapping[str, np.ndarray], names: tuple[str, ...]) -> int:
    first = np.asarray(inputs[names[0]]) if names else None
    return int(first.shape[0]) if first is not None and first.ndim else 1


def service_seconds(device: DeviceSpec, artifact: PartitionArtifact, rows: int,
                    input_bytes: int, output_bytes: int) -> float:
    """Modelled time for ``device`` to take a batch in, compute it and send it back."""
    return (device.transfer_seconds(input_bytes)
            + device.compute_seconds(artifact.flops_per_item * rows,
                                     artifact.param_bytes + artifact.bytes_per_item * rows, artifact.dtype)
            + device.transfer_seconds(output_bytes))


class SimCardExecutable(Executable):
    """One partition on one simulated card: a FIFO worker on modelled time.

    ``infer`` is the simulated card (queued, timed, counted). ``run`` is the
    functional computation alone, untimed, for callers that only need outputs.
    """

    def __init__(self, artifact: PartitionArtifact, device: DeviceSpec, inner: Executable,
                 backend: "SimCardBackend", slot: int, clock: Clock, sleep: Sleep, faults: Faults,
                 shared_as: tuple[str, str, str] | None = None) -> None:
        super().__init__(artifact, device)
        self.inner = inner
        self._shared_as = shared_as
        """The key of ``inner`` among the backend's shared functional executables (None: this card's own)."""
        self._backend, self._slot = backend, slot
        self._clock, self._sleep, self.faults = clock, sleep, faults
        self._lock = threading.Lock()
        self._busy_until = float("-inf")
        self._accepted = 0
        self._stats = SimCardStats()
        self._closed = False
        self._timeline = SharedTimeline(backend.shared_timelines, device.name, artifact.name,
                                        payload_digest(artifact.payload)) if backend.shared_timelines else None
        self.worker_nice = backend.worker_nice

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """The functional backend's outputs, without the card's timing."""
        if self._closed:
            raise BackendError(f"partition {self.artifact.name} on simcard {self.device.name} is closed")
        return self.inner.run(inputs)

    def expected_seconds(self, rows: int, input_bytes: float, output_bytes: float) -> float:
        """The modelled service time of a batch, throttling (``slow_factor``) included; stalls and hangs not.

        The server derives a batch's hang deadline from it (``sixfold.server.execution.card_health``).
        """
        return service_seconds(self.device, self.artifact, rows, int(input_bytes), int(output_bytes)) * \
            self.faults.slow_factor

    def _serve(self, inputs: Mapping[str, np.ndarray], arrival: float) -> tuple[Arrays, float]:
        """On the worker thread: compute for real, place the batch on the modelled timeline; -> (outputs, finish)."""
        t0 = self._clock()
        outputs = self.run(inputs)
        t1 = self._clock()
        rows = _rows(inputs, self.input_names)
        in_bytes = sum(int(np.asarray(inputs[n]).nbytes) for n in self.input_names)
        out_bytes = sum(int(np.asarray(v).nbytes) for v in outputs.values())
        service = service_seconds(self.device, self.artifact, rows, in_bytes, out_bytes) * self.faults.slow_factor
        with self._lock:
            if self._timeline is not None:  # the card's copies in other processes have their batches on it too
                finish = self._timeline.advance(arrival, service)
            else:
                finish = max(arrival, self._busy_until) + service
            self._busy_until = finish
            lag = max(0.0, t1 - finish)
            s = self._stats
            self._stats = dataclasses.replace(
                s, batches=s.batches + 1, rows=s.rows + rows, modelled_busy_s=s.modelled_busy_s + service,
                actual_compute_s=s.actual_compute_s + (t1 - t0), lagged_batches=s.lagged_batches + (lag > 0),
                total_lag_s=s.total_lag_s + lag, max_lag_s=max(s.max_lag_s, lag))
        return outputs, finish

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """Queue the batch on the card; return its real outputs at max(actual, modelled) finish."""
        arrival = self._clock()
        if self._closed:
            raise BackendError(f"partition {self.artifact.name} on simcard {self.device.name} is closed")
        with self._lock:
            index = self._accepted
            self._accepted += 1
            self._set_outstanding(+1)
        try:
            if self.faults.fails(index):
                await self._fail(index)
            loop = asyncio.get_running_loop()
            outputs, finish = await loop.run_in_executor(self._worker(), self._serve, inputs, arrival)
            wait = finish - self._clock()
            if wait > 0:
                await self._sleep(wait)
            return outputs
        finally:
            with self._lock:
                self._set_outstanding(-1)

    def _set_outstanding(self, delta: int) -> None:
        self._stats = dataclasses.replace(self._stats, outstanding=self._stats.outstanding + delta)

    async def _fail(self, index: int) -> None:
        if self.faults.hang:
            await asyncio.get_running_loop().create_future()  # never resolves; cancel to leave
        if self.faults.stall_s > 0:
            await self._sleep(self.faults.stall_s)  # then the batch is served as usual
            return
        raise BackendError(f"simcard {self.device.name}: partition {self.artifact.name} crashed "
                           f"(injected fault: crash_after={self.faults.crash_after}, batch {index})")

    def stats(self) -> SimCardStats:
        """A snapshot of this card's counters (safe from any thread)."""
        with self._lock:
            return self._stats

    @property
    def busy_until(self) -> float:
        """When the modelled card finishes the work it has accepted so far (from any process sharing it)."""
        with self._lock:
            return self._timeline.busy_until if self._timeline is not None else self._busy_until

    def close(self) -> None:
        """Stop the worker, close the functional executable and give back this card's memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        super().close()
        self._backend._unshare(self.inner, self._shared_as)
        if self._timeline is not None:
            self._timeline.close()
        self._backend._release(self.device.name, self._slot)


class SimCardBackend(Backend):
    """Simulated accelerator cards: real outputs from a functional backend, timing from DeviceSpecs.

    Options: ``functional`` (a backend name, default "onnxruntime", or a Backend
    instance), ``clock`` (default ``time.monotonic``), ``sleep`` (default
    ``asyncio.sleep``), ``faults`` (dict, see the module docstring), ``shared_timelines``
    (a folder: each card's modelled time shared with other processes), ``worker_nice`` (how much
    lower than the server's threads each card's worker computes, default 5: a real card computes on
    its own silicon, so its simulation should not take the host's cores from the event loop and the
    host stage; 0 keeps them equal), ``share_functional`` (default true: cards loading the same
    partition share one thread-safe functional executable); any other option is passed to the
    functional backend when it is given by name.
    Memory is budgeted per device *name* within one instance.
    """

    name = "simcard"
    formats = ("onnx",)  # the default functional backend's; an instance reports its own

    def __init__(self, *, functional: str | Backend = "onnxruntime", clock: Clock = time.monotonic,
                 sleep: Sleep = asyncio.sleep, faults: Mapping[str, Any] | None = None,
                 shared_timelines: str | None = None, worker_nice: int = DEFAULT_WORKER_NICE,
                 share_functional: bool = True, **functional_options: Any) -> None:
        super().__init__(functional=functional, clock=clock, sleep=sleep, faults=faults,
                         shared_timelines=shared_timelines, worker_nice=worker_nice,
                         share_functional=share_functional, **functional_options)
        self.shared_timelines = shared_timelines
        self.worker_nice = int_option(self.name, "worker_nice", worker_nice)
        self.share_functional = bool_option(self.name, "share_functional", share_functional)
        if isinstance(functional, Backend):
            if functional_options:
                raise BackendError(f"backend simcard: options {', '.join(sorted(functional_options))} are for "
                                   "the functional backend, which was given as an instance; configure it there")
            self.functional = functional
        else:
            self.functional = _functional_backend(functional, functional_options)
        self.formats = self.functional.formats  # type: ignore[misc]
        self.clock, self.sleep, self.faults = clock, sleep, Faults.parse(faults)
        self._lock = threading.Lock()
        self._held: dict[str, dict[int, tuple[str, int]]] = {}  # device name -> slot -> (partition, bytes)
        self._slots = itertools.count()
        self._loading = threading.Lock()
        self._shared: dict[tuple[str, str, str], list] = {}  # (partition, format, payload) -> [inner, cards]

    def supports(self, artifact: PartitionArtifact) -> bool:
        return self.functional.supports(artifact)

    def memory_used(self, device: str | DeviceSpec) -> int:
        """Bytes held on ``device`` (a name or spec) by partitions this instance loaded."""
        key = device if isinstance(device, str) else device.name
        with self._lock:
            return sum(b for _, b in self._held.get(key, {}).values())

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> SimCardExecutable:
        """Reserve ``artifact.param_bytes`` on ``device`` (DoesNotFit if short), then load it functionally."""
        if not self.supports(artifact):
            raise BackendError(f"backend simcard (functional: {self.functional.name}) takes "
                               f"{', '.join(self.formats)} partitions; partition {artifact.name} is {artifact.format!r}")
        with self._lock:
            slot = next(self._slots)
            held = self._held.setdefault(device.name, {})
            used = sum(b for _, b in held.values())
            others = ", ".join(p for p, _ in held.values())
            check_fits(artifact, device, device.memory_bytes - used,
                       f" ({format_bytes(device.memory_bytes)} total, {format_bytes(used)} held by {others})"
                       if held else f" ({format_bytes(device.memory_bytes)} total)")
            held[slot] = (artifact.name, artifact.param_bytes)
        try:
            inner, shared_as = self._functional_load(artifact, device)
        except BaseException:
            self._release(device.name, slot)
            raise
        return SimCardExecutable(artifact, device, inner, self, slot, self.clock, self.sleep, self.faults, shared_as)

    def _functional_load(self, artifact: PartitionArtifact,
                         device: DeviceSpec) -> tuple[Executable, tuple[str, str, str] | None]:
        """The functional executable of a card: the one another card of this instance loaded for the same
        partition when it is thread-safe (``share_functional``), else a new one; and its sharing key."""
        digest = payload_digest(artifact.payload) if self.share_functional else ""
        if not digest:  # an in-memory payload of another kind, or sharing off: nothing tells copies apart
            return self.functional.load(artifact, device), None
        key = (artifact.name, artifact.format, digest)
        with self._loading:  # NOTE: cards load at start and on a card's restart: one at a time is fine
            entry = self._shared.get(key)
            if entry is not None:
                entry[1] += 1
                return entry[0], key
            inner = self.functional.load(artifact, device)
            if not inner.thread_safe:
                return inner, None
            self._shared[key] = [inner, 1]
            return inner, key

    def _unshare(self, inner: Executable, key: tuple[str, str, str] | None) -> None:
        """A card is done with ``inner``: closed when it was its own or the last card sharing it."""
        if key is not None:
            with self._loading:
                entry = self._shared.get(key)
                if entry is not None and entry[0] is inner:
                    entry[1] -= 1
                    if entry[1] > 0:
                        return
                    del self._shared[key]
        inner.close()

    def _release(self, device_name: str, slot: int) -> None:
        with self._lock:
            self._held.get(device_name, {}).pop(slot, None)


def _functional_backend(name: str, options: dict[str, Any]) -> Backend:
    # NOTE: the built-ins are imported directly so SIXFOLD_BACKENDS=simcard
    # still works; any other name goes through the registry (a vendor's backend).
    if name == "onnxruntime":
        from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend
        return OnnxRuntimeBackend(**options)
    if name == "torch":
        from sixfold.backends.builtin.torch_backend import TorchBackend
        return TorchBackend(**options)
    if name == SimCardBackend.name:
        raise BackendError("backend simcard: the functional backend cannot be simcard itself")
    from sixfold.backends.registry import get_backend
    return get_backend(name, **options)
