"""A server command run as its own process, usable once it prints ``sixfold-serve``'s READY line.

``sixfold-serve`` prints ``READY grpc=HOST:PORT`` once it serves (``--grpc-port 0`` picks a free
port, so the line is how a caller learns it); with ``--log-format json`` the line is a JSON object
whose ``message`` is that text (``ready_address`` reads both). The demo, the end-to-end tests and
the benchmarks start servers this way.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["READY_PREFIX", "ReadyProcess", "ready_address"]

READY_PREFIX = "READY grpc="


def ready_address(line: str) -> str:
    """``HOST:PORT`` of a READY line, plain or a JSON log object whose ``message`` is one; "" for other lines."""
    text = line.strip()
    if text.startswith("{") and READY_PREFIX in text:
        try:
            text = str(json.loads(text).get("message", ""))
        except (ValueError, AttributeError):
            return ""
    return text[len(READY_PREFIX):].strip() if text.startswith(READY_PREFIX) else ""


class ReadyProcess:
    """Start ``cmd``, collect its output (stderr too), and wait up to ``timeout_s`` for its READY line.

    ``url`` is ``HOST:PORT`` once the line came, else "" (the process exited or was too slow:
    ``output`` says why). ``echo`` sees every other line as it arrives. Whoever starts one stops
    it (``stop`` or ``kill``, in a ``finally``).
    """

    def __init__(self, cmd: Sequence[str], *, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 timeout_s: float = 180.0, echo: Callable[[str], None] | None = None,
                 start_new_session: bool = False) -> None:
        self.proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=cwd, start_new_session=start_new_session)
        self.lines: list[str] = []
        self.url = ""
        ready = self._ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.lines.append(line)
                if address := ready_address(line):
                    self.url = address
                    ready.set()
                elif echo is not None:
                    echo(line)
            ready.set()  # EOF: the process is gone; no READY line is coming

        threading.Thread(target=pump, daemon=True).start()
        ready.wait(timeout_s)

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        """Wait for the READY line (when constructed with ``timeout_s=0``); ``url``, "" if it did not come."""
        self._ready.wait(timeout_s)
        return self.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM (the server answers what it holds, then exits), SIGKILL after ``grace_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(timeout=10)
