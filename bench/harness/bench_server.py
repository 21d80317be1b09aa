"""The bench's own stand-in gRPC servers (the FIFO server, the echo server) start like sixfold-serve.

They print the same READY line, so ``ReadyProcess`` and ``bench.harness.process.ServerProc`` wait
for them as for the real server, and they stop on the same signals.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

__all__ = ["serve_until_signalled"]


async def serve_until_signalled(server: Any, address: str) -> None:
    """Start a bench's grpc.aio ``server``, print sixfold-serve's READY line for ``address`` (what
    ``sixfold.server.workers.process.ReadyProcess`` waits for), and serve until SIGINT or SIGTERM."""
    from sixfold.server.workers.process import READY_PREFIX

    await server.start()
    print(f"{READY_PREFIX}{address}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)
