"""Simulated cards shared by several processes (sixfold-serve --workers): one modelled timeline per card."""

from __future__ import annotations

import multiprocessing

import pytest

from sixfold.backends.builtin.shared_timeline import SharedTimeline
from sixfold.backends.builtin.simcard import SimCardBackend, service_seconds
from tests.backends.factories import FakeClock, batch, device, mlp

MLP = mlp(hidden=32, seed=7)


def _advance_in_another_process(folder: str, arrival: float, service: float, out) -> None:
    timeline = SharedTimeline(folder, "card0", "dense")
    out.put(timeline.advance(arrival, service))
    timeline.close()


def test_a_card_timeline_is_one_across_processes(tmp_path):
    a = SharedTimeline(tmp_path, "card0", "dense")
    b = SharedTimeline(tmp_path, "card0", "dense")
    other_card = SharedTimeline(tmp_path, "card1", "dense")
    assert a.busy_until == float("-inf")
    assert a.advance(10.0, 1.0) == 11.0
    assert b.advance(10.5, 1.0) == 12.0          # queued behind a's batch
    assert other_card.advance(10.5, 1.0) == 11.5  # another card is free
    out = multiprocessing.get_context("spawn").Queue()
    child = multiprocessing.get_context("spawn").Process(target=_advance_in_another_process,
                                                         args=(str(tmp_path), 11.0, 2.0, out))
    child.start()
    assert out.get(timeout=60) == 14.0            # a third process queues behind both
    child.join(60)
    assert a.busy_until == b.busy_until == 14.0
    assert a.advance(20.0, 1.0) == 21.0            # idle since: starts on arrival
    for t in (a, b, other_card):
        t.close()


async def test_two_backends_sharing_timelines_model_one_card_not_two(tmp_path):
    clock = FakeClock()
    shared = [SimCardBackend(clock=clock, sleep=clock.sleep, shared_timelines=str(tmp_path)) for _ in range(2)]
    alone = SimCardBackend(clock=clock, sleep=clock.sleep)
    artifact = MLP.artifact(flops_per_item=1e9)
    first, second = (b.load(artifact, device("card0")) for b in shared)
    feed = batch(MLP, 8, seed=1)
    service = service_seconds(device("card0"), artifact, 8, sum(a.nbytes for a in feed.values()), 8 * 4)
    assert service > 0
    # the clock stands still (FakeClock): each batch is released after the sleep its modelled finish asks
    await first.infer(feed)
    await second.infer(feed)  # another process's copy of card0: queued behind the first batch
    await first.infer(feed)
    assert clock.sleeps == pytest.approx([service, 2 * service, 3 * service])
    assert first.busy_until == second.busy_until == pytest.approx(3 * service)
    lone = alone.load(artifact, device("card0"))
    await lone.infer(feed)  # a card outside the shared folder is another card: free
    assert clock.sleeps[-1] == pytest.approx(service)
    for card in (first, second, lone):
        card.close()


async def test_two_partitions_of_one_name_on_one_card_keep_their_own_queues(tmp_path):
    clock = FakeClock()
    backend = SimCardBackend(clock=clock, sleep=clock.sleep, shared_timelines=str(tmp_path))
    other = mlp(hidden=32, seed=8)  # the same partition name, other weights: another model's partition
    first = backend.load(MLP.artifact(flops_per_item=1e9), device("card0"))
    second = backend.load(other.artifact(flops_per_item=1e9), device("card0"))
    assert first.artifact.name == second.artifact.name
    await first.infer(batch(MLP, 8, seed=1))
    await second.infer(batch(other, 8, seed=1))
    assert clock.sleeps[0] == pytest.approx(clock.sleeps[1])  # as in one process: not queued behind each other
    first.close()
    second.close()
