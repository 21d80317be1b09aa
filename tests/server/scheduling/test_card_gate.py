"""The card gate hands cards to batches in arrival order, and never keeps a batch waiting on cards that are not there."""

from __future__ import annotations

import asyncio

import pytest

from sixfold.server.scheduling.card_gate import CardGate, Grant


class Cards:
    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self) -> int:
        return self.n


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


class Line:
    """Requests queued on a gate, and what each was granted, in grant order."""

    def __init__(self, gate: CardGate) -> None:
        self.gate = gate
        self.got: list[tuple[str, int]] = []
        self.grants: dict[str, Grant] = {}

    def join(self, name: str, slots: int, seconds=None) -> asyncio.Task:
        async def wait() -> Grant:
            grant = await self.gate.acquire(slots, seconds)
            self.got.append((name, grant.slots))
            self.grants[name] = grant
            return grant
        return asyncio.ensure_future(wait())


def linear(total_s: float):
    """A batch of ``total_s`` seconds of work on one card, split evenly."""
    return lambda parts: total_s / parts


async def test_free_cards_are_granted_at_once_and_a_request_is_clamped_to_the_cards_there_are() -> None:
    gate = CardGate(Cards(6))
    a, b = await gate.acquire(4), await gate.acquire(2)
    assert (a.slots, b.slots, gate.held, gate.waits) == (4, 2, 6, 0)
    gate.release(a)
    gate.release(b)
    assert (await gate.acquire(10)).slots == 6


async def test_batches_get_cards_in_arrival_order_even_when_a_later_one_would_fit() -> None:
    gate = CardGate(Cards(6))
    first = await gate.acquire(4)
    line = Line(gate)
    big, small = line.join("big", 6), line.join("small", 1)
    await _settle()
    assert line.got == [] and gate.waiting == 2  # 2 cards are free, but the small batch came second
    gate.release(first)
    await _settle()
    assert line.got == [("big", 6)] and gate.waiting == 1
    gate.release(line.grants["big"])
    await asyncio.wait_for(asyncio.gather(big, small), 1.0)
    assert line.got == [("big", 6), ("small", 1)] and gate.waits == 2


async def test_one_release_lets_in_every_waiting_batch_that_fits() -> None:
    gate = CardGate(Cards(6))
    first = await gate.acquire(6)
    line = Line(gate)
    tasks = [line.join("a", 3), line.join("b", 2), line.join("c", 2)]
    await _settle()
    gate.release(first)
    await _settle()
    assert line.got == [("a", 3), ("b", 2)] and gate.held == 5  # c needs 2 of the 1 left
    gate.release(line.grants["a"])
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert line.got[-1] == ("c", 2)


async def test_a_cancelled_waiter_leaves_the_queue_and_lets_the_next_in() -> None:
    gate = CardGate(Cards(6))
    await gate.acquire(3)
    line = Line(gate)
    big, small = line.join("big", 6), line.join("small", 2)
    await _settle()
    big.cancel()
    await asyncio.wait_for(small, 1.0)
    assert line.got == [("small", 2)] and gate.held == 5 and gate.waiting == 0
    with pytest.raises(asyncio.CancelledError):
        await big


async def test_a_batch_cancelled_after_its_grant_gives_the_cards_back() -> None:
    gate = CardGate(Cards(2))
    first = await gate.acquire(2)
    line = Line(gate)
    task = line.join("late", 2)
    await _settle()
    gate.release(first)  # granted now, but the task has not run yet
    assert gate.held == 2
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert line.got == [] and gate.held == 0


async def test_no_card_in_rotation_grants_at_once_and_cards_coming_back_wake_waiters() -> None:
    cards = Cards(0)
    gate = CardGate(cards)
    lone = await gate.acquire(3)
    assert lone.slots == 1  # the runtime falls back or fails the batch; nothing waits
    gate.release(lone)
    cards.n = 1
    await gate.acquire(1)
    line = Line(gate)
    task = line.join("next", 2)
    await _settle()
    assert line.got == []  # one card, held
    cards.n = 3  # two cards back in rotation: the waiting batch fits beside the held one
    gate.changed()
    await asyncio.wait_for(task, 1.0)
    assert line.got == [("next", 2)] and gate.held == 3


async def test_the_first_in_line_starts_on_fewer_cards_when_that_finishes_sooner() -> None:
    """6 cards; 4 held until t+10 ms. A 12-ms batch on the 2 free cards ends at t+6, on 6 at t+12: it starts now."""
    clock = Clock()
    gate = CardGate(Cards(6), clock)
    held = await gate.acquire(4, lambda parts: 0.010)  # expected to end 10 ms from now
    grant = await asyncio.wait_for(gate.acquire(6, linear(0.012)), 1.0)
    assert grant.slots == 2 and gate.early_starts == 1
    assert grant.expected_end == pytest.approx(clock.now + 0.006)
    gate.release(held)
    gate.release(grant)


async def test_the_first_in_line_waits_when_all_its_cards_soon_finish_it_sooner() -> None:
    """4 cards held until t+1 ms: a 60-ms batch on 2 cards ends at t+30, on 6 after the wait at t+11."""
    clock = Clock()
    gate = CardGate(Cards(6), clock)
    held = await gate.acquire(4, lambda parts: 0.001)
    line = Line(gate)
    task = line.join("big", 6, linear(0.060))
    await _settle()
    assert line.got == [] and gate.early_starts == 0
    clock.now += 0.001
    gate.release(held)
    await asyncio.wait_for(task, 1.0)
    assert line.got == [("big", 6)]


async def test_a_batch_without_an_estimate_waits_for_every_card_it_wants() -> None:
    gate = CardGate(Cards(6), Clock())
    held = await gate.acquire(4, lambda parts: 10.0)
    line = Line(gate)
    task = line.join("unpriced", 6)
    await _settle()
    assert line.got == []
    gate.release(held)
    await asyncio.wait_for(task, 1.0)
    assert line.got == [("unpriced", 6)]


async def test_a_batch_gives_back_each_card_as_its_part_finishes() -> None:
    """6 cards held by one batch; a 1-card batch waits, and starts when the first part is done, not the last."""
    gate = CardGate(Cards(6), Clock())
    whole = await gate.acquire(6, lambda parts: 0.012 / parts)
    line = Line(gate)
    task = line.join("small", 1, lambda parts: 0.001)
    await _settle()
    assert line.got == []
    gate.release(whole, 1)  # one part done
    await asyncio.wait_for(task, 1.0)
    assert line.got == [("small", 1)] and gate.held == 6 and whole.slots == 5
    gate.release(whole)  # the rest
    gate.release(line.grants["small"])
    assert gate.held == 0
    gate.release(whole, 1)  # nothing left to give back: a no-op
    assert gate.held == 0 and whole.slots == 0


async def test_a_later_batch_runs_on_idle_cards_only_if_it_is_done_before_the_first_in_line_can_start() -> None:
    """4 of 6 cards held until t+10 ms; a 6-card batch waits. Behind it: a 2-ms batch backfills, a 20-ms one does not."""
    clock = Clock()
    gate = CardGate(Cards(6), clock)
    held = await gate.acquire(4, lambda parts: 0.010)
    line = Line(gate)
    tasks = [line.join("big", 6, linear(0.600)), line.join("long", 1, lambda parts: 0.020),
             line.join("short", 1, lambda parts: 0.002)]
    await _settle()
    assert line.got == [("short", 1)] and gate.backfills == 1 and gate.waiting == 2
    gate.release(line.grants["short"])
    clock.now += 0.010
    gate.release(held)
    await _settle()
    assert line.got == [("short", 1), ("big", 6)]  # the long one still waits its turn
    gate.release(line.grants["big"])
    await asyncio.wait_for(asyncio.gather(*tasks), 1.0)
    assert line.got[-1] == ("long", 1)
