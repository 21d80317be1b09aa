"""Where one front end stands among the ``count`` front ends of a ``sixfold-serve --workers N`` server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["WorkerSet"]


@dataclass(frozen=True)
class WorkerSet:
    """A front end's place: the server's run folder (the engine's sockets, the arenas), its index and the count.

    Set in each front end's ``ServerConfig.workers``: its ports are shared with the others (SO_REUSEPORT) and its
    metrics page is for the supervisor, which serves one page for all (``sixfold.server.workers.worker_metrics``).
    """

    folder: Path
    index: int
    count: int
