"""One /metrics page for all the workers of ``sixfold-serve --workers N``.

Each worker serves its own page on a loopback port; the supervisor serves ``--metrics-port`` (with
the server's TLS and bearer token, as one process would) and answers each scrape with every
worker's samples, labelled ``worker="I"``. So a pod of N workers is scraped like a pod of one,
and a sum over the pod's series is the server's figure.
"""

from __future__ import annotations

import logging
import ssl
import urllib.request
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["WorkersMetrics"]

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0


class _Workers:
    """A collector: each worker's page, parsed, with a ``worker`` label on every sample."""

    def __init__(self, pages: Callable[[], Sequence[tuple[int, str]]]) -> None:
        self._pages = pages

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for index, text in self._pages():
            for family in text_string_to_metric_families(text):
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    into.add_sample(sample.name, {**sample.labels, "worker": str(index)}, sample.value,
                                    sample.timestamp, sample.exemplar)
        yield from merged.values()


class WorkersMetrics:
    """The workers' pages as one (``exposition``), for a ``sixfold.server.observability.metrics.MetricsEndpoint``."""

    def __init__(self, ports: Sequence[int], token: str | None = None, tls: bool = False) -> None:
        self.ports, self._token, self._tls = list(ports), token, tls
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(_Workers(self._pages))

    def _pages(self) -> list[tuple[int, str]]:
        context = None
        if self._tls:  # our own children on loopback, with the server's (often self-signed) certificate
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        pages = []
        for index, port in enumerate(self.ports):
            request = urllib.request.Request(f"{'https' if self._tls else 'http'}://127.0.0.1:{port}/metrics")
            if self._token:
                request.add_header("Authorization", f"Bearer {self._token}")
            try:
                with urllib.request.urlopen(request, timeout=SCRAPE_TIMEOUT_S, context=context) as answer:
                    pages.append((index, answer.read().decode()))
            except OSError as exc:  # a worker stopping: the page holds the others
                log.warning("worker %d's metrics (port %d) did not answer: %s", index, port, exc)
        return pages

    def exposition(self) -> bytes:
        return generate_latest(self._registry)
