"""Virtual stages: executables that take modelled time on the loop's clock and compute nothing.

Each stands where the server loads a real one (``Executable``), so the runtime, router and
card health treat it as they treat a card or the host stage. A stage is one FIFO server
with its own queue, like a backend's one worker thread or a simulated card
(``sixfold.backends.builtin.simcard``): a batch arriving at ``t`` starts at ``max(t, busy_until)`` and is
answered ``StageModel.seconds(rows)`` later. Busy time inside the measured window is
counted, for utilisation.

Batches carry zero-width arrays (``[rows, 0]``): the server's code splits, merges and checks
them by their first dimension only, so they cost it no copying.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping, Sequence

import numpy as np

from sixfold.backends.api import Arrays, Executable, PartitionArtifact, TensorLayout
from sixfold.models.signature import DENSE, INDICES, SCORES

from sixfold.simulate.platform import StageModel

__all__ = ["Server", "VirtualStage", "VirtualLane", "POOLED", "empty_rows"]

POOLED = "pooled"
"""The host stage's output the cards read (its real name is the plan's; only its rows matter here)."""

_EMPTY: dict[tuple[int, str], np.ndarray] = {}


def empty_rows(rows: int, dtype: str = "float32") -> np.ndarray:
    """A shared, read-only ``[rows, 0]`` array: a batch's shape without its bytes."""
    key = (rows, dtype)
    array = _EMPTY.get(key)
    if array is None:
        if len(_EMPTY) > 65536:
            _EMPTY.clear()
        array = _EMPTY[key] = np.empty((rows, 0), dtype=dtype)
        array.flags.writeable = False
    return array


class Server:
    """One FIFO server on the loop clock: the busy-until timeline of a device's queue."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_until = 0.0
        self.batches = 0
        self.rows = 0
        self.busy_s = 0.0
        """Busy time inside [window_start, window_end)."""
        self.window = (0.0, float("inf"))

    def occupy(self, now: float, seconds: float, rows: int) -> float:
        """Queue a batch arriving ``now`` that takes ``seconds``; returns its finish time."""
        start = now if now > self.busy_until else self.busy_until
        finish = start + seconds
        self.busy_until = finish
        self.batches += 1
        self.rows += rows
        lo, hi = self.window
        busy = min(finish, hi) - max(start, lo)
        if busy > 0:
            self.busy_s += busy
        return finish


def _resolve(future: asyncio.Future, outputs: Arrays) -> None:
    if not future.done():  # a hedged copy's loser may have been cancelled
        future.set_result(outputs)


def _at(loop: asyncio.AbstractEventLoop, when: float, outputs: Arrays) -> asyncio.Future:
    """A future that resolves to ``outputs`` at loop time ``when``.

    NOTE: a future, not a coroutine: the runtime's ``ensure_future`` then makes no task for it,
    and awaiting it costs one timer, which is most of a simulated batch's cost to the simulator.
    """
    future = loop.create_future()
    loop.call_at(when, _resolve, future, outputs)
    return future


def _artifact(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> PartitionArtifact:
    # NOTE: every virtual tensor is one [rows, 0] row per item (empty_rows), and says so: batches split on it
    return PartitionArtifact(name=name, format="virtual", payload=None, input_names=inputs, output_names=outputs,
                             layouts={n: TensorLayout(rows_per_item=1) for n in (*inputs, *outputs)})


class VirtualStage(Executable):
    """A host-side stage (the sparse stage, or the dense part on the host CPU) on a virtual FIFO server.

    ``by_ids``: price a batch by its looked-up ids (``sparse_indices``' length over the
    platform's mean ids per item) rather than its items: the host stage's work is its ids.
    """

    def __init__(self, model: StageModel, inputs: tuple[str, ...], output: str, *,
                 ids_per_item: float = 0.0) -> None:
        super().__init__(_artifact(model.name, inputs, (output,)), model.device)
        self.model = model
        self.server = Server(model.name)
        self._output = output
        self._ids_per_item = ids_per_item

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:  # pragma: no cover - virtual stages only infer
        raise RuntimeError("a virtual stage only runs on the simulator's virtual clock (infer)")

    def infer(self, inputs: Mapping[str, np.ndarray]) -> asyncio.Future:  # type: ignore[override]
        rows = inputs[self.input_names[0]].shape[0]
        work = rows
        if self._ids_per_item:
            work = max(1, round(inputs[INDICES].shape[0] / self._ids_per_item))
        loop = asyncio.get_running_loop()
        finish = self.server.occupy(loop.time(), self.model.seconds(work), rows)
        return _at(loop, finish, {self._output: empty_rows(rows)})


class VirtualLane(Executable):
    """A card (one stage) or a pipeline replica (its stages in order, each its own FIFO card).

    ``expected_seconds`` is what ``sixfold.server.execution.card_health`` prices a batch by, as it does a
    simulated card's: the cost model's time of the lane's stages, summed.
    """

    def __init__(self, stages: Sequence[StageModel], name: str) -> None:
        super().__init__(_artifact(name, (DENSE, POOLED), (SCORES,)), stages[0].device)
        self.models = list(stages)
        self.servers = [Server(s.name) for s in stages]

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:  # pragma: no cover
        raise RuntimeError("a virtual card only runs on the simulator's virtual clock (infer)")

    def expected_seconds(self, rows: int, input_bytes: float, output_bytes: float) -> float:
        return sum(m.seconds(rows) for m in self.models)

    def infer(self, inputs: Mapping[str, np.ndarray]) -> Awaitable[Arrays]:  # type: ignore[override]
        rows = inputs[DENSE].shape[0]
        loop = asyncio.get_running_loop()
        if len(self.servers) == 1:
            finish = self.servers[0].occupy(loop.time(), self.models[0].seconds(rows), rows)
            return _at(loop, finish, {SCORES: empty_rows(rows)})
        return self._through_stages(rows)

    async def _through_stages(self, rows: int) -> Arrays:
        loop = asyncio.get_running_loop()
        for model, server in zip(self.models, self.servers):
            now = loop.time()
            finish = server.occupy(now, model.seconds(rows), rows)
            await asyncio.sleep(finish - now)
        return {SCORES: empty_rows(rows)}
