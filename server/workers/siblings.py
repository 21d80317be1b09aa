"""The other worker processes of one ``sixfold-serve --workers N`` server, and what they must all hear.

Each worker serves the same port (SO_REUSEPORT: the kernel spreads connections, and with them
channels, over the workers) and also listens on a Unix socket of its own in the server's run
folder. A request that changes what the server holds — loading or unloading a model, registering
or unregistering a shared memory region — is carried out by the worker it reached, then told to
every sibling over their Unix sockets with the marker ``SIBLING_HEADER``, so whichever worker a
client's next channel reaches holds the same models and regions. A sibling does not pass a told
request on. When a sibling fails it, the client's error names the worker and why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from tritonclient.grpc import service_pb2_grpc

from sixfold.server.errors import InternalError

__all__ = ["SIBLING_HEADER", "WorkerSet", "Siblings", "from_sibling"]

SIBLING_HEADER = "sixfold-told-by-worker"
"""gRPC metadata on a request one worker tells its siblings: they carry it out and tell no one."""

TELL_TIMEOUT_S = {"RepositoryModelLoad": 600.0, "RepositoryModelUnload": 120.0}
"""Loading a model takes as long in every worker; the shared memory steps take milliseconds."""
DEFAULT_TELL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WorkerSet:
    """Where this worker stands among the server's ``count`` workers (``sixfold-serve --workers``)."""

    folder: Path
    """The server's run folder: the workers' Unix sockets, the simulated cards' shared timelines."""
    index: int
    count: int

    def socket(self, index: int) -> Path:
        return self.folder / f"worker-{index}.sock"

    def address(self, index: int | None = None) -> str:
        """A worker's private gRPC address (this worker's by default)."""
        return f"unix:{self.socket(self.index if index is None else index)}"

    @property
    def timelines(self) -> Path:
        """Where simulated cards keep the modelled busy time every worker's copy of a card shares."""
        return self.folder / "cards"


def from_sibling(metadata: Sequence[tuple[str, Any]] | None) -> bool:
    """True when a request was told by a sibling worker (so it is not told on again)."""
    return any(key == SIBLING_HEADER for key, _ in metadata or ())


class Siblings:
    """gRPC channels to the other workers of this server, opened on first use."""

    def __init__(self, workers: WorkerSet, control_token: str | None = None) -> None:
        self.workers = workers
        self._metadata = [(SIBLING_HEADER, str(workers.index))]
        if control_token:
            self._metadata.append(("authorization", f"Bearer {control_token}"))
        self._stubs: dict[int, Any] = {}
        self._channels: list[grpc.aio.Channel] = []

    def _stub(self, index: int) -> Any:
        if index not in self._stubs:
            channel = grpc.aio.insecure_channel(self.workers.address(index),
                                                options=[("grpc.max_send_message_length", 64 << 20),
                                                         ("grpc.max_receive_message_length", 64 << 20)])
            self._channels.append(channel)
            self._stubs[index] = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return self._stubs[index]

    async def tell(self, method: str, request: Any) -> None:
        """Carry out ``request`` (a protobuf request of the inference service) in every other worker.

        Raises ``InternalError`` naming each worker that failed it (this worker already holds the change).
        """
        others = [i for i in range(self.workers.count) if i != self.workers.index]
        if not others:
            return
        timeout = TELL_TIMEOUT_S.get(method, DEFAULT_TELL_TIMEOUT_S)
        results = await asyncio.gather(*(getattr(self._stub(i), method)(request, metadata=self._metadata,
                                                                         timeout=timeout) for i in others),
                                       return_exceptions=True)
        failed = [f"worker {i}: {r.details() if isinstance(r, grpc.aio.AioRpcError) else r!r}"
                  for i, r in zip(others, results) if isinstance(r, BaseException)]
        if failed:
            raise InternalError(f"{method} was carried out by worker {self.workers.index} but not by "
                                f"{len(failed)} of its {len(others)} sibling(s), so the workers now differ "
                                f"(restart the server to make them agree): {'; '.join(failed)}")

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
