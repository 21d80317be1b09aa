"""Fixtures for loadgen tests: fake KServe v2 servers that each test stops at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.loadgen.fake_server import FakeModel, FakeServer


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """``fake_server(latency_s=0.01, ...)`` starts a FakeServer (on ``port=`` if given); all are
    stopped after the test."""
    started: list[FakeServer] = []

    def start(*, port: int = 0, **model_fields) -> FakeServer:
        server = FakeServer(FakeModel(**model_fields), port=port).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
