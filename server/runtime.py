"""Runs one batch through a plan: host (sparse) stage, then the dense stage on a routed card."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from backends.api import Arrays, Executable

from .batcher import BatchInfo
from .errors import InternalError, ServingError
from .router import LeastLoadedRouter

__all__ = ["PlanRuntime"]


class PlanRuntime:
    """Host executable + one dense executable per card, joined by the router."""

    def __init__(self, host: Executable, cards: Sequence[Executable],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.host = host
        self.cards = list(cards)
        self.router = LeastLoadedRouter(len(self.cards))
        self._clock = clock

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
        index = self.router.acquire(rows)
        card = self.cards[index]
        try:
            outputs = await card.infer({n: card_inputs[n] for n in card.input_names})
        except ServingError:
            raise
        except Exception as exc:
            raise InternalError(f"card{index} failed: {exc}") from exc
        finally:
            self.router.release(index, rows)
        t2 = self._clock()
        info.timings.update(host_s=t1 - t0, card_s=t2 - t1, card=float(index))
        return outputs

    def close(self) -> None:
        self.host.close()
        for card in self.cards:
            card.close()
