"""The host's CPU and memory in Triton's names, and each card's busy time, memory and health."""

from __future__ import annotations

import time

import pytest

from sixfold import models
from sixfold.server.loading.loader import load_builtin
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.observability.system import UtilizationWindow, cpu_times, memory_bytes
from sixfold.server.scheduling.batcher import BatchingConfig
from tests.server.observability.test_metrics import _samples, _types

linux = pytest.mark.skipif(cpu_times() is None, reason="CPU metrics read /proc (Linux)")


@linux
def test_cpu_and_memory_gauges_carry_tritons_names_and_the_hosts_readings():
    metrics = ServerMetrics()
    metrics.exposition()
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:  # busy for a while: this process's own share is above 0
        sum(range(1000))
    types, s = _types(metrics), _samples(metrics)
    for name in ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes"):
        assert types[name] == "gauge", name
    assert 0 < s[("nv_cpu_utilization", ())] <= 1
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert s[("nv_cpu_memory_total_bytes", ())] == total_kb * 1024 == memory_bytes()[0]
    assert 0 < s[("nv_cpu_memory_used_bytes", ())] < total_kb * 1024


def test_a_utilization_window_is_the_busy_share_between_readings():
    window = UtilizationWindow(min_elapsed=1.0)
    window.start("card0", 0.0, 0.0)
    assert window.share("card0", 5.0, 10.0) == 0.5
    assert window.share("card0", 5.5, 10.5) == 0.5      # too short a window: the last share again
    assert window.share("card0", 9.0, 12.0) == 1.0      # 4 s busy in 2 s (two models on one card): at most 1
    assert window.share("card1", 3.0, 12.0) == 0.0      # a first reading has no window


def _tiny(metrics: ServerMetrics):
    return load_builtin("tiny", max_rows=None, seed=0, cards=2, backend="simcard", card_spec="m2-card",
                        metrics=metrics, batching=BatchingConfig(max_queue_delay_microseconds=0),
                        host_dense_max_rows=0)  # every batch on the cards


async def _close(served) -> None:
    await served.batcher.close()
    served.runtime.close()


async def test_card_gauges_follow_a_served_models_cards():
    metrics = ServerMetrics()
    served = _tiny(metrics)
    try:
        s = _samples(metrics)
        cards = ("card0", "card1")
        for card in cards:
            labels = (("card", card),)
            assert s[("sixfold_card_healthy", labels)] == 1
            assert s[("sixfold_card_busy_seconds_total", labels)] == 0
            assert s[("sixfold_card_memory_total_bytes", labels)] == served.runtime.cards[0].device.memory_bytes
        held = sum(s[("sixfold_card_memory_used_bytes", (("card", card),))] for card in cards)
        assert held == sum(card.memory_bytes() for card in served.runtime.cards) > 0
        request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=1).make(64)
        for _ in range(20):
            await served.infer(request, [])
        served.runtime.router.mark_down(1)
        types, s = _types(metrics), _samples(metrics)
        assert types["sixfold_card_busy_seconds_total"] == "counter" and types["sixfold_card_utilization"] == "gauge"
        busy = {c: s[("sixfold_card_busy_seconds_total", (("card", c),))] for c in cards}
        assert sum(busy.values()) > 0
        assert all(0 <= s[("sixfold_card_utilization", (("card", c),))] <= 1 for c in cards)
        assert s[("sixfold_card_healthy", (("card", "card1"),))] == 0
        assert s[("sixfold_card_healthy", (("card", "card0"),))] == 1
    finally:
        await _close(served)
    again = _tiny(metrics)  # the same version loaded anew: a fresh runtime, busy time kept
    try:
        s = _samples(metrics)
        assert {c: s[("sixfold_card_busy_seconds_total", (("card", c),))] for c in cards} == \
            pytest.approx(busy, abs=1e-3)
        assert s[("sixfold_card_healthy", (("card", "card1"),))] == 1
        await again.infer(request, [])
        s = _samples(metrics)
        assert sum(s[("sixfold_card_busy_seconds_total", (("card", c),))] for c in cards) > sum(busy.values())
    finally:
        await _close(again)
