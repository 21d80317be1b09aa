"""Runs one batch through a plan: host (sparse) stage, then the dense stage on a routed card.

A card that fails or hangs is taken out of rotation, its batch is retried once on
another healthy card (else the batch fails with UNAVAILABLE), and the card is
restarted in the background (closed and loaded again) before it rejoins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from backends.api import Arrays, Executable

from .batcher import BatchInfo
from .errors import InternalError, ServingError, Unavailable
from .router import LeastLoadedRouter, NoHealthyCard

__all__ = ["PlanRuntime"]

log = logging.getLogger(__name__)

ReloadCard = Callable[[int], Executable]


class PlanRuntime:
    """Host executable + one dense executable per card, joined by the router.

    ``reload_card(i)`` loads card ``i`` afresh (used to restart a failed card);
    ``card_timeout_s`` is how long a card may take on one batch before it is
    considered hung.
    """

    def __init__(self, host: Executable, cards: Sequence[Executable], *, reload_card: ReloadCard | None = None,
                 card_timeout_s: float = 30.0, max_card_rows: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.host = host
        self.cards = list(cards)
        self.router = LeastLoadedRouter(len(self.cards))
        self.reload_card = reload_card
        self.card_timeout_s = card_timeout_s
        if max_card_rows is not None and max_card_rows < 1:
            raise ValueError(f"max_card_rows must be >= 1, got {max_card_rows}")
        self.max_card_rows = max_card_rows
        self._clock = clock
        self._restarts: set[asyncio.Task] = set()

    async def run(self, inputs: Arrays, info: BatchInfo) -> Arrays:
        rows = next(iter(inputs.values())).shape[0]
        t0 = self._clock()
        try:
            host_out = await self.host.infer({n: inputs[n] for n in self.host.input_names})
        except ServingError:
            raise
        except Exception as exc:
            raise InternalError(f"host stage failed: {exc}") from exc
        t1 = self._clock()
        card_inputs = {**inputs, **host_out}
        if self.max_card_rows is None or rows <= self.max_card_rows:
            index, outputs = await self._card_stage(card_inputs, rows)
        else:
            index, outputs = await self._split_across_cards(card_inputs, rows)
        t2 = self._clock()
        info.timings.update(host_s=t1 - t0, card_s=t2 - t1, card=float(index))
        return outputs

    async def _split_across_cards(self, card_inputs: Arrays, rows: int) -> tuple[int, Arrays]:
        """A batch larger than a card takes: sub-batches run on several cards at once, then rejoin.

        Each card input splits in proportion to its rows per item (1 for dense
        features, T for pooled embeddings laid out [N * T, D]); outputs concatenate.
        """
        names = self.cards[0].input_names
        per_item = {}
        for name in names:
            length = card_inputs[name].shape[0]
            if length % rows:
                raise InternalError(f"cannot split card input '{name}' ({length} rows) into items of a "
                                    f"{rows}-item batch")
            per_item[name] = length // rows
        chunk = self.max_card_rows
        assert chunk is not None
        bounds = [(a, min(a + chunk, rows)) for a in range(0, rows, chunk)]
        parts = [{n: card_inputs[n][a * per_item[n]:b * per_item[n]] for n in names} for a, b in bounds]
        results = await asyncio.gather(*(self._card_stage(part, b - a) for part, (a, b) in zip(parts, bounds)))
        outputs = {name: np.concatenate([r[1][name] for r in results]) for name in results[0][1]}
        return results[0][0], outputs

    async def _card_stage(self, card_inputs: Arrays, rows: int) -> tuple[int, Arrays]:
        tried: set[int] = set()
        errors: list[str] = []
        for _ in range(2):  # the first card, then one retry elsewhere
            try:
                index = self.router.acquire(rows, exclude=tried)
            except NoHealthyCard as exc:
                raise Unavailable(f"{exc}; earlier failures: {errors}") from None
            tried.add(index)
            card = self.cards[index]
            try:
                outputs = await asyncio.wait_for(card.infer({n: card_inputs[n] for n in card.input_names}),
                                                 self.card_timeout_s)
                return index, outputs
            except asyncio.TimeoutError:
                errors.append(f"card{index} hung (> {self.card_timeout_s:.1f}s)")
            except Exception as exc:  # noqa: BLE001 - any card failure takes the card out
                errors.append(f"card{index}: {exc}")
            finally:
                self.router.release(index, rows)
            self._take_out(index, errors[-1])
        raise Unavailable(f"batch failed on two cards: {'; '.join(errors)}")

    def _take_out(self, index: int, why: str) -> None:
        if not self.router.loads[index].healthy:
            return
        self.router.mark_down(index)
        log.warning("card%d out of rotation: %s", index, why)
        if self.reload_card is not None:
            task = asyncio.ensure_future(self._restart(index))
            self._restarts.add(task)
            task.add_done_callback(self._restarts.discard)

    async def _restart(self, index: int) -> None:
        old = self.cards[index]
        try:
            await asyncio.to_thread(old.close)
            assert self.reload_card is not None
            self.cards[index] = await asyncio.to_thread(self.reload_card, index)
        except Exception:  # noqa: BLE001 - stays out of rotation; the others keep serving
            log.exception("card%d could not be restarted; it stays out of rotation", index)
            return
        self.router.mark_up(index)
        log.warning("card%d restarted and back in rotation", index)

    def close(self) -> None:
        for task in self._restarts:
            task.cancel()
        self.host.close()
        for card in self.cards:
            card.close()
