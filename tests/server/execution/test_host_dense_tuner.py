"""HostDenseTuner on a virtual clock: it follows load both ways, and a burst does not leave it stuck."""

from __future__ import annotations

import pytest

from sixfold.server.execution.runtime import HostDenseTuner


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _traffic(tuner: HostDenseTuner, clock: Clock, seconds: float, *, card_s: float, host_s: float,
             rows: int = 128, rate: float = 25.0) -> int:
    """``rate`` batches a second for ``seconds``, each measured at its path's latency; -> batches on the host."""
    on_host = 0
    for _ in range(int(seconds * rate)):
        host = tuner.on_host(rows)
        tuner.record(rows, host_s if host else card_s, on_host=host)
        on_host += host
        clock.now += 1 / rate
    return on_host


def test_after_a_burst_the_cards_win_back_their_batches_within_a_second_or_two() -> None:
    clock = Clock()
    tuner = HostDenseTuner(-1, limit=256, explore_every=20, clock=clock)
    # Idle: a card does 128 rows in 4 ms, the host in 8: everything stays on the cards.
    _traffic(tuner, clock, 5, card_s=0.004, host_s=0.008)
    assert tuner.threshold == 0
    # A burst: every card batch waits 100 ms in a queue; the idle host answers in 8 ms and takes over.
    _traffic(tuner, clock, 5, card_s=0.100, host_s=0.008)
    assert tuner.threshold == 128
    # The burst is over. The cards are explored one batch in 20 (every 0.8 s here), and a sample
    # that long after the last one moves their average most of the way.
    moved_back_by = None
    for tick in range(1, 41):
        _traffic(tuner, clock, 0.1, card_s=0.004, host_s=0.008)
        if tuner.threshold == 0 and moved_back_by is None:
            moved_back_by = tick / 10
    assert moved_back_by is not None and moved_back_by <= 2.0, tuner.snapshot()
    assert _traffic(tuner, clock, 5, card_s=0.004, host_s=0.008) <= 5 * 25 // 20 + 5  # exploring only


def test_an_average_decays_with_time_as_well_as_with_samples() -> None:
    clock = Clock()
    tuner = HostDenseTuner(-1, limit=256, explore_every=2, clock=clock)
    for _ in range(8):  # both sides measured every other batch, 10 ms apart
        host = tuner.on_host(64)
        tuner.record(64, 0.010 if host else 0.002, on_host=host)
        clock.now += 0.01
    tuner.record(64, 0.100, on_host=False)  # 20 ms after the last: it moves the average a fifth of the way
    assert tuner.snapshot()["card_ms"][64] == pytest.approx(2 + 0.2 * 98, rel=1e-6)
    clock.now += 5
    tuner.record(64, 0.003, on_host=False)  # seconds later: nearly all of the way
    assert tuner.snapshot()["card_ms"][64] == pytest.approx(3, abs=1e-3)


def test_bad_staleness_is_refused() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        HostDenseTuner(-1, stale_after_s=0)
    with pytest.raises(ValueError, match="decay_s"):
        HostDenseTuner(-1, decay_s=-1)


def test_a_side_many_times_slower_is_explored_less_often_at_high_rates_but_still_ten_times_a_second() -> None:
    clock = Clock()
    tuner = HostDenseTuner(-1, limit=256, explore_every=20, clock=clock)
    # The tiny model's shape: 3-row batches, the host's dense 30 us, a simulated card's 0.4 ms, 2,000 batches/s.
    _traffic(tuner, clock, 1, card_s=0.0004, host_s=0.00003, rows=3, rate=2000)
    assert tuner.threshold == 4, tuner.snapshot()
    on_host = _traffic(tuner, clock, 2, card_s=0.0004, host_s=0.00003, rows=3, rate=2000)
    explored = 2 * 2000 - on_host
    # One in 20 would be 200; the 13x slower cards get about one in 20 x 13, plus about ten a second.
    assert 2 * 5 <= explored <= 2 * 2000 // (20 * 13) + 2 * 10 + 2, explored
    # At 25 batches a second the one-in-20 exploring is unchanged (the other side's figure is over 0.1 s old).
    slow = 4 * 25 - _traffic(tuner, clock, 4, card_s=0.0004, host_s=0.00003, rows=3, rate=25)
    assert 4 * 25 // 20 - 1 <= slow <= 4 * 25 // 20 + 1, slow


def test_a_side_twice_as_slow_is_explored_one_in_twice_explore_every() -> None:
    clock = Clock()
    tuner = HostDenseTuner(-1, limit=256, explore_every=20, clock=clock)
    _traffic(tuner, clock, 1, card_s=0.001, host_s=0.0005, rows=8, rate=2000)
    explored = 2000 - _traffic(tuner, clock, 1, card_s=0.001, host_s=0.0005, rows=8, rate=2000)
    assert 2000 // 40 - 2 <= explored <= 2000 // 40 + 2 + 2, explored  # 2x slower: one in 40
