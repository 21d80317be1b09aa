"""The host and the cards as Triton's page shows them: CPU and memory gauges, per-card gauges.

Triton reports the host's CPU use and memory as ``nv_cpu_utilization`` (0 to 1, all cores, since
its last reading), ``nv_cpu_memory_total_bytes`` and ``nv_cpu_memory_used_bytes`` (RAM, system-wide),
read from ``/proc/stat`` and ``/proc/meminfo`` (Linux only; elsewhere these series are left out).
They are written here under those names, unlabelled, and read when /metrics is scraped: the
utilisation is the share of CPU time spent busy since the previous scrape.

Cards are not NVIDIA GPUs read through DCGM, so they are not written as Triton's ``nv_gpu_*``
(a fleet dashboard would count simulated cards as GPUs, with no ``gpu_uuid``): each physical card
has ``sixfold_card_*`` gauges labelled ``card`` (the plan's card id, ``card0``...), see
``CardCollector``.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["cpu_times", "memory_bytes", "UtilizationWindow", "HostCollector", "CardCollector"]

_MIN_WINDOW_S = 0.05
"""Card scrapes closer than this repeat the previous utilisation (too short a window to measure)."""
_MIN_WINDOW_TICKS = 10.0
"""The same for the CPU, in clock ticks over all cores (/proc/stat counts 100 a second per core)."""


def cpu_times(path: str = "/proc/stat") -> tuple[float, float] | None:
    """(busy, total) CPU time of all cores in clock ticks since boot, or None where there is no /proc."""
    try:
        with open(path, encoding="ascii") as f:
            first = f.readline().split()
    except OSError:
        return None
    if not first or first[0] != "cpu":
        return None
    ticks = [float(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal
    ticks += [0.0] * (8 - len(ticks))
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def memory_bytes(path: str = "/proc/meminfo") -> tuple[int, int] | None:
    """(total, used) RAM in bytes, used being total less what is available; None without /proc."""
    fields: dict[str, int] = {}
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable", "MemFree"):
                    fields[name] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    if "MemTotal" not in fields:
        return None
    available = fields.get("MemAvailable", fields.get("MemFree", 0))
    return fields["MemTotal"], max(0, fields["MemTotal"] - available)


class UtilizationWindow:
    """Busy share per key between two readings of a cumulative (busy, elapsed) pair, clipped to [0, 1]."""

    def __init__(self, min_elapsed: float = _MIN_WINDOW_S) -> None:
        self._min = min_elapsed
        self._last: dict[Any, tuple[float, float, float]] = {}  # key -> (busy, elapsed, share)

    def start(self, key: Any, busy: float, elapsed: float) -> None:
        """Take the first reading of ``key`` (else its first share is 0)."""
        self._last.setdefault(key, (busy, elapsed, 0.0))

    def share(self, key: Any, busy: float, elapsed: float) -> float:
        last = self._last.get(key)
        if last is None:
            self._last[key] = (busy, elapsed, 0.0)
            return 0.0
        if elapsed - last[1] < self._min:
            return last[2]
        share = min(1.0, max(0.0, (busy - last[0]) / (elapsed - last[1])))
        self._last[key] = (busy, elapsed, share)
        return share


class HostCollector:
    """``nv_cpu_utilization``, ``nv_cpu_memory_total_bytes``, ``nv_cpu_memory_used_bytes`` at scrape time."""

    def __init__(self, read_cpu: Callable[[], tuple[float, float] | None] = cpu_times,
                 read_memory: Callable[[], tuple[int, int] | None] = memory_bytes) -> None:
        self._read_cpu, self._read_memory = read_cpu, read_memory
        self._window = UtilizationWindow(_MIN_WINDOW_TICKS)
        first = read_cpu()
        if first is not None:
            self._window.start("cpu", *first)

    def collect(self) -> Iterator[Metric]:
        cpu = self._read_cpu()
        if cpu is not None:
            yield GaugeMetricFamily("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0], all cores, since the "
                                    "previous scrape", value=self._window.share("cpu", *cpu))
        memory = self._read_memory()
        if memory is not None:
            yield GaugeMetricFamily("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", value=memory[0])
            yield GaugeMetricFamily("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", value=memory[1])


def _stages(lane: Any) -> list[Any]:
    """The executables of a dense lane: a pipeline's stages (each on its own card), else the lane itself."""
    return list(getattr(lane, "stages", None) or [lane])


def card_id(executable: Any, lane: int) -> str:
    """The plan's id of the card an executable runs on (its device is named ``SPEC/CARD``), else ``card<lane>``."""
    name = str(getattr(getattr(executable, "device", None), "name", ""))
    return name.rsplit("/", 1)[1] if "/" in name else f"card{lane}"


class CardCollector:
    """Per physical card, over every served model's runtime that uses it, read at scrape time:

    - ``sixfold_card_busy_seconds_total``: time the card held at least one batch (summed over the
      models that use it; ``rate()`` of it is the utilisation);
    - ``sixfold_card_utilization``: that busy time over the time since the previous scrape, at most 1;
    - ``sixfold_card_memory_total_bytes``: the card's usable memory (its spec);
    - ``sixfold_card_memory_used_bytes``: what the models' partitions on it hold;
    - ``sixfold_card_healthy``: 1 while it is in rotation for every model, else 0.

    A pipeline lane (stages on several cards) is busy on each of its cards while it holds a batch.
    """

    def __init__(self, runtimes: "weakref.WeakValueDictionary[tuple[str, str], Any]",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._runtimes, self._clock = runtimes, clock
        self._started = clock()
        self._window = UtilizationWindow()
        # (model, version, runtime id, lane, card) -> largest busy time read: a model version loaded
        # again is a new runtime, whose busy time starts at 0 while the old one's is kept
        self._busy_seen: dict[tuple[str, str, int, int, str], float] = {}
        self._busy_retired: dict[str, float] = {}  # card -> busy seconds of runtimes gone since

    def _busy(self, live: dict[tuple[str, str, int, int, str], float]) -> dict[str, float]:
        """Busy seconds per card, never lower than a previous scrape's (a runtime gone keeps its share)."""
        for key in [k for k in self._busy_seen if k not in live]:
            self._busy_retired[key[-1]] = self._busy_retired.get(key[-1], 0.0) + self._busy_seen.pop(key)
        busy = dict(self._busy_retired)
        for key, value in live.items():
            value = self._busy_seen[key] = max(value, self._busy_seen.get(key, 0.0))
            busy[key[-1]] = busy.get(key[-1], 0.0) + value
        return busy

    def collect(self) -> Iterator[Metric]:
        live: dict[tuple[str, str, int, int, str], float] = {}
        total: dict[str, float] = {}
        used: dict[str, float] = {}
        healthy: dict[str, int] = {}
        for (model, version), runtime in sorted(self._runtimes.items()):
            router = getattr(runtime, "router", None)
            for lane, executable in enumerate(list(getattr(runtime, "cards", ()))):
                in_rotation = int(router.loads[lane].healthy) if router is not None else 1
                busy = router.busy_seconds(lane) if router is not None else 0.0
                for stage in _stages(executable):
                    card = card_id(stage, lane)
                    live[(model, version, id(runtime), lane, card)] = busy
                    total[card] = max(total.get(card, 0.0), float(getattr(stage.device, "memory_bytes", 0)))
                    try:
                        held = float(stage.memory_bytes())
                    except Exception:  # noqa: BLE001 - a card being restarted: count nothing this scrape
                        held = 0.0
                    used[card] = used.get(card, 0.0) + held
                    healthy[card] = min(healthy.get(card, 1), in_rotation)
        busy = self._busy(live)
        elapsed = self._clock() - self._started
        cards = sorted(set(busy) | set(total), key=_card_order)
        for card in cards:  # a card's busy time counts from its model's load, after this collector began
            self._window.start(card, 0.0, 0.0)
        yield from card_families(cards, busy, {c: self._window.share(c, busy.get(c, 0.0), elapsed) for c in cards},
                                 total, used, healthy)


def _card_order(card: str) -> tuple[int, str]:
    digits = card[len(card.rstrip("0123456789")):]
    return (int(digits) if digits else -1, card)


def card_families(cards: Iterable[str], busy: dict[str, float], utilization: dict[str, float],
                  total: dict[str, float], used: dict[str, float], healthy: dict[str, int]) -> list[Metric]:
    """The ``sixfold_card_*`` families for ``cards`` (one process's, or the workers' merged)."""
    families = (CounterMetricFamily("sixfold_card_busy_seconds", "Seconds each card held at least one batch "
                                    "(rate(): its utilisation)", labels=["card"]),
                GaugeMetricFamily("sixfold_card_utilization", "Share of the time since the previous scrape each "
                                  "card held at least one batch [0.0 - 1.0]", labels=["card"]),
                GaugeMetricFamily("sixfold_card_memory_total_bytes", "Usable card memory, in bytes (its spec)",
                                  labels=["card"]),
                GaugeMetricFamily("sixfold_card_memory_used_bytes", "Card memory the served partitions hold, in bytes",
                                  labels=["card"]),
                GaugeMetricFamily("sixfold_card_healthy", "1 while the card is in rotation (0: out, being restarted)",
                                  labels=["card"]))
    for card in cards:
        families[0].add_metric([card], busy.get(card, 0.0))
        if card in total:  # a card some served model uses now (busy time stays after the last one goes)
            for family, source in zip(families[1:], (utilization, total, used, healthy)):
                family.add_metric([card], source.get(card, 0))
    return list(families)
