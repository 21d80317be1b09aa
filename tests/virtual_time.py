"""Run an async test on a virtual clock: sleeps and timers take no real time and a busy machine
cannot stretch them, so tests about order and timeouts are deterministic.

The clock is sixfold-simulate's (``sixfold.simulate.vloop.VirtualTimeLoop``): the loop jumps to its next
timer whenever nothing is ready. Code under test must read time from the loop
(``asyncio.get_running_loop().time``), e.g. ``DynamicBatcher(..., clock=loop_clock())``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any

from sixfold.simulate.vloop import run_virtual

__all__ = ["virtual_time", "loop_clock"]


def virtual_time(test: Callable[..., Coroutine[Any, Any, Any]]) -> Callable[..., Any]:
    """Decorate an ``async def`` test to run it on a fresh virtual-time loop (a plain test to pytest)."""
    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> Any:
        return run_virtual(test(*args, **kwargs), max_time_s=3600.0, max_events=10_000_000)
    return run


def loop_clock() -> Callable[[], float]:
    """The running loop's clock (virtual under ``virtual_time``, monotonic otherwise)."""
    return asyncio.get_running_loop().time
