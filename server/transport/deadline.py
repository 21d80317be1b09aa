"""Await with a time limit and no task of its own (asyncio.wait_for wraps the awaitable in one: ~20 us)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

__all__ = ["within"]

T = TypeVar("T")


async def within(awaitable: Awaitable[T], seconds: float) -> T:
    """``await awaitable``, or TimeoutError once ``seconds`` pass (0: no limit); a cancel from elsewhere
    still cancels. Call it from a task (a handler): the timer cancels the task that awaits."""
    if not seconds:
        return await awaitable
    task = asyncio.current_task()
    assert task is not None, "within() runs inside a task"
    fired = []

    def expire() -> None:
        fired.append(True)
        task.cancel()

    timer = asyncio.get_running_loop().call_later(seconds, expire)
    try:
        return await awaitable
    except asyncio.CancelledError:
        if not fired:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+: the cancel was ours, not one to pass on
            task.uncancel()
        raise TimeoutError(f"not done within {seconds:g} s") from None
    finally:
        timer.cancel()
