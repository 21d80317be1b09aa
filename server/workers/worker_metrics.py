"""One /metrics page for all the processes of ``sixfold-serve --workers N``: one process's page.

The engine and each front end serve their own page on a loopback port (page 0: the engine); the supervisor serves ``--metrics-port`` (with
the server's TLS and bearer token, as one process would) and answers each scrape with the
workers' pages merged into the page one process would write: the same names, types and labels,
so Triton's dashboards, alerts and autoscaling rules (and sixfold's own) read N workers as one.

- Counters and histograms (Triton's ``nv_inference_*`` included) are summed over the workers.
- Gauges that add up are summed (``nv_inference_pending_request_count``: requests queued in the
  server; ``sixfold_card_outstanding_rows``; ``sixfold_card_memory_used_bytes``: each worker holds
  its own partitions), a card's memory total is its largest, a card is healthy when it is in every
  worker's rotation, and a counter's ``_created`` is its earliest.
- The host's ``nv_cpu_*`` and ``sixfold_card_utilization`` are the supervisor's own readings (the
  CPU for the whole host; a card's utilisation from the workers' summed busy time).
- Other gauges (a worker's own state: its host-dense threshold, its row cache) keep one series per
  worker, labelled ``worker="I"``. So does ``sixfold_worker_up`` (1 while the page answers; worker 0 is
  the engine). ``sixfold_worker_inference_request_success_total`` and
  ``sixfold_worker_pending_request_count`` have one series per front end (``worker="1"``..``"N"``):
  the requests it answered and those it has at the engine now, which say how the kernel spread the
  clients over the front ends.

A worker whose page does not answer a scrape counts with its last page, so no counter goes back.
"""

from __future__ import annotations

import logging
import re
import ssl
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from sixfold.server.observability.system import HostCollector, UtilizationWindow, card_families

__all__ = ["WorkersMetrics", "parse_page", "merge_pages", "Family"]

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0

_GAUGES: dict[str, Callable[[Iterable[float]], float]] = {
    "nv_inference_pending_request_count": sum,
    "sixfold_card_outstanding_rows": sum,
    "sixfold_card_memory_used_bytes": sum,
    "sixfold_card_memory_total_bytes": max,
    "sixfold_card_healthy": min,
}
"""Gauges merged into one series per label set (the rest: one series per worker)."""
_OWN = ("nv_cpu_utilization", "nv_cpu_memory_total_bytes", "nv_cpu_memory_used_bytes", "sixfold_card_utilization")
"""Families the supervisor writes itself instead of the workers'."""

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$')
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')

Labels = tuple[tuple[str, str], ...]
"""A sample's labels as written (values still escaped), in the page's order."""


@dataclass
class Family:
    """One metric family of a page, its samples under the names they are written with."""

    name: str
    type: str = "untyped"
    help: str = ""
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)


def _labels(text: str | None) -> Labels:
    if not text:
        return ()
    labels, at = [], 0
    while at < len(text):
        match = _LABEL.match(text, at)
        if match is None:
            raise ValueError(f"unreadable labels {{{text}}}")
        labels.append((match.group(1), match.group(2)))
        at = match.end()
    return tuple(labels)


def parse_page(text: str) -> dict[str, Family]:
    """A Prometheus text page as families, keeping each sample's name as written.

    (prometheus-client's parser renames a counter's samples to ``NAME_total``, which would turn
    Triton's ``nv_inference_count`` into ``nv_inference_count_total``.)
    """
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                family = families.setdefault(parts[2], Family(parts[2]))
                if parts[1] == "HELP":
                    family.help = parts[3] if len(parts) > 3 else ""
                else:
                    family.type = parts[3].strip() if len(parts) > 3 else "untyped"
                current = family
            continue
        match = _SAMPLE.match(line)
        if match is None:
            raise ValueError(f"unreadable sample line {line!r}")
        name, labels, value = match.group(1), _labels(match.group(2)), float(match.group(3))
        if current is None or not name.startswith(current.name):
            current = families.setdefault(name, Family(name))
        current.samples[(name, labels)] = value
    return families


def _merge(family: Family, pages: Sequence[tuple[int, Family]]) -> Family:
    """One family from every worker's, by the family's kind (see the module docstring)."""
    merged = Family(family.name, family.type, family.help)
    by_key: dict[tuple[str, Labels], list[float]] = {}
    for index, page in pages:
        for (name, labels), value in page.samples.items():
            per_worker = family.type == "gauge" and family.name not in _GAUGES and not family.name.endswith("_created")
            per_worker |= family.type == "summary" and any(k == "quantile" for k, _ in labels)
            per_worker |= family.type not in ("counter", "histogram", "gauge", "summary")
            key = (name, (*labels, ("worker", str(index))) if per_worker else labels)
            by_key.setdefault(key, []).append(value)
    combine = _GAUGES.get(family.name, min if family.name.endswith("_created") and family.type == "gauge" else sum)
    merged.samples = {key: float(combine(values)) for key, values in by_key.items()}
    return merged


def merge_pages(pages: Sequence[tuple[int, dict[str, Family]]]) -> dict[str, Family]:
    """The workers' pages ((index, families)) as one process's page, families in the order first seen."""
    names: dict[str, Family] = {}
    for _, families in pages:
        for name, family in families.items():
            names.setdefault(name, family)
    return {name: _merge(first, [(i, f[name]) for i, f in pages if name in f]) for name, first in names.items()}


def _label_text(labels: Labels) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def write_families(families: Iterable[Family]) -> str:
    lines: list[str] = []
    for family in families:
        lines += [f"# HELP {family.name} {family.help}", f"# TYPE {family.name} {family.type}"]
        lines += [f"{name}{_label_text(labels)} {floatToGoString(value)}"
                  for (name, labels), value in family.samples.items()]
    return "\n".join(lines) + "\n" if lines else ""


def _from_metric(metric: Metric) -> Family:
    """A prometheus-client family (its name as the text format writes it) as a ``Family``."""
    name = f"{metric.name}_total" if metric.type == "counter" else metric.name
    family = Family(name, metric.type, metric.documentation.replace("\\", "\\\\").replace("\n", "\\n"))
    for sample in metric.samples:
        family.samples[(sample.name, tuple((k, _escape(v)) for k, v in sample.labels.items()))] = sample.value
    return family


_FRONT_END_SERIES = ("sixfold_frontend_requests", "sixfold_frontend_pending_requests")
"""What a front end's page says of its requests (``sixfold.server.frontend``): answered, at the engine now."""


def _total(page: dict[str, Family], name: str) -> float:
    """The sum of a family's samples (a counter's ``NAME_total``, never its ``_created``); 0 if absent."""
    family = page.get(name) or page.get(f"{name}_total")
    if family is None:
        return 0.0
    return sum(value for (sample, _), value in family.samples.items() if not sample.endswith("_created"))


class WorkersMetrics:
    """The workers' pages as one (``exposition``), for a ``sixfold.server.observability.metrics.MetricsEndpoint``."""

    def __init__(self, ports: Sequence[int], token: str | None = None, tls: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ports, self._token, self._tls = list(ports), token, tls
        self._last: dict[int, dict[str, Family]] = {}
        self._host = HostCollector()
        self._cards = UtilizationWindow()
        self._clock, self._started = clock, clock()
        self._lock = threading.Lock()  # scrapes run in the endpoint's threads; the windows are shared

    def _pages(self) -> tuple[list[tuple[int, dict[str, Family]]], list[int]]:
        """Every worker's page (the last one it gave when it does not answer now), and who answered."""
        context = None
        if self._tls:  # our own children on loopback, with the server's (often self-signed) certificate
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        pages, up = [], []
        for index, port in enumerate(self.ports):
            request = urllib.request.Request(f"{'https' if self._tls else 'http'}://127.0.0.1:{port}/metrics")
            if self._token:
                request.add_header("Authorization", f"Bearer {self._token}")
            try:
                with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_S, context=context) as answer:
                    self._last[index] = parse_page(answer.read().decode())
                up.append(index)
            except (OSError, ValueError) as exc:  # a worker stopping: its last page keeps its counters
                log.warning("worker %d's metrics (port %d) did not answer: %s", index, port, exc)
            if index in self._last:
                pages.append((index, self._last[index]))
        return pages, up

    def _own(self, merged: dict[str, Family]) -> dict[str, Family]:
        """The supervisor's own families: the host's CPU and memory, each card's utilisation."""
        own = {f.name: f for f in map(_from_metric, self._host.collect())}
        busy_family = merged.get("sixfold_card_busy_seconds_total")
        busy = {dict(labels)["card"]: value for (_, labels), value in busy_family.samples.items()} if busy_family else {}
        cards = [dict(labels)["card"] for (_, labels) in merged["sixfold_card_utilization"].samples] \
            if "sixfold_card_utilization" in merged else []
        elapsed = self._clock() - self._started
        utilization = {card: self._cards.share(card, busy.get(card, 0.0), elapsed) for card in cards}
        for metric in card_families(cards, busy, utilization, dict.fromkeys(cards, 0.0), {}, {}):
            if metric.name == "sixfold_card_utilization":
                own[metric.name] = _from_metric(metric)
        return own

    def _workers(self, pages: Sequence[tuple[int, dict[str, Family]]], up: Sequence[int]) -> list[Family]:
        """Per-worker series: who answered, requests answered and queued by each (all models)."""
        families = [CounterMetricFamily("sixfold_worker_inference_request_success",
                                        "Successful inference requests answered by each worker (all models)",
                                        labels=["worker"]),
                    GaugeMetricFamily("sixfold_worker_pending_request_count",
                                      "Requests waiting in each worker's model queues", labels=["worker"]),
                    GaugeMetricFamily("sixfold_worker_up", "1 if the worker's page answered this scrape",
                                      labels=["worker"])]
        answered = {i: page for i, page in pages}
        for index in range(len(self.ports)):
            page = answered.get(index, {})
            if index > 0:  # a front end's own counts (page 0, the engine's, holds every model series)
                for family, name in zip(families, _FRONT_END_SERIES):
                    family.add_metric([str(index)], _total(page, name))
            families[2].add_metric([str(index)], 1.0 if index in up else 0.0)
        return [_from_metric(f) for f in families]

    def exposition(self) -> bytes:
        pages, up = self._pages()
        with self._lock:
            merged = merge_pages(pages)
            own = self._own(merged)
            page = [own.get(name, family) for name, family in merged.items() if name not in _OWN or name in own]
            page += [family for name, family in own.items() if name not in merged]
            page += self._workers(pages, up)
        return write_families(page).encode()
