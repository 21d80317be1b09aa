"""A server under test in its own process group, that never outlives the bench.

Benches compare servers one at a time on a small machine: a server left running (a crashed bench,
``run_all``'s time limit, MLServer's worker children) would take cores from the next one. So each
server gets its own session (``stop()`` ends the whole group) and the parent-death signal (even a
SIGKILLed bench takes it along); ``start()`` returns only once the model answers ready.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time

from bench.harness.commands import ROOT

__all__ = ["ServerProc", "free_port", "die_with_parent", "wait_model"]

READY_GRPC = "READY grpc="  # sixfold-serve's READY line (sixfold.server.workers.process.READY_PREFIX)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server that cannot take port 0 and report it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """A server must not outlive the bench, even one killed with SIGKILL (run_all's time limit)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def wait_model(url: str, model: str, timeout_s: float) -> None:
    """Until ``model`` is ready at ``url`` (KServe v2 gRPC): serving the model, not only listening."""
    from sixfold.loadgen import wait_until_ready

    from sixfold.loadgen.connect import make_client

    client = make_client(url)
    try:
        await wait_until_ready(client, url, model, "", timeout_s)
    finally:
        await client.close()


class ServerProc:
    """A server in its own process group; ``url`` once it is ready; ``stop()`` ends the whole group.

    ``ready_line``: the output line that says it listens; a line starting ``READY grpc=`` also gives the
    url (sixfold-serve, the FIFO server), else ``url`` is known up front (MLServer's fixed port).
    Output lines are kept (the last 400) for the error message, and lines with `` ERROR `` counted.
    """

    def __init__(self, name: str, argv: list[str], *, ready_line: str, env: dict[str, str] | None = None,
                 url: str = "") -> None:
        self.name, self.argv, self.ready_line, self.env, self.url = name, argv, ready_line, env, url
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.errors = 0
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def start(self, model: str, timeout_s: float = 240.0) -> str:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, cwd=ROOT, start_new_session=True, preexec_fn=die_with_parent)
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(timeout_s) or self.proc.poll() is not None or not self.url:
            raise RuntimeError(f"{self.name} did not start in {timeout_s:g} s (exit code {self.proc.poll()}); "
                               f"last output: {self.tail()}")
        asyncio.run(wait_model(self.url, model, timeout_s))  # serving the model, not only listening
        return self.url

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.errors += " ERROR " in line
            if self.ready_line in line:
                if line.startswith(READY_GRPC):
                    self.url = line.split("=", 1)[1].strip()
                self._ready.set()
        self._ready.set()

    def tail(self, n: int = 12) -> str:
        return " | ".join(list(self.lines)[-n:])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)  # the group: serve.py's `mlserver start` child too
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self._group_alive():
                time.sleep(0.1)
            if not self._group_alive():
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def _group_alive(self) -> bool:
        assert self.proc is not None
        self.proc.poll()  # reap the leader, or it stays a zombie in the group
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
