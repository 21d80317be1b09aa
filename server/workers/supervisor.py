"""``sixfold-serve --workers N``: N server processes on one port, sharing the cards.

One event loop is one Python server's ceiling: decoding, validation and the answers of every
request run on it, one core's worth at most. N workers spread that over N cores. Each worker is
a whole ``sixfold-serve`` (models, batcher, router, both front ends) bound to the same gRPC and
REST ports with SO_REUSEPORT, so the kernel spreads connections over them; each gRPC channel
stays with the worker it reached. What they share:

- the cards: simulated cards keep one modelled timeline per card for all workers
  (``sixfold.backends.builtin.shared_timeline``), so N workers model the same six cards, not 6N; real devices
  are shared by their drivers;
- what clients change: a model loaded or unloaded, a shared memory region registered or
  unregistered, is told to every worker (``sixfold.server.workers.siblings``) before the client's answer.

What they do not share: host memory (each worker holds its own copy of resident tables; tiered
tables share the page cache), batches (a worker batches only the requests it received),
statistics (each worker's are its own; /metrics is one page, the workers' series merged into one
process's names and types: ``sixfold.server.workers.worker_metrics``), and table deltas (refused:
they need ``--workers 1``).

This process only supervises: it starts worker 0 (which binds the ports asked for, 0 included),
then the others on the ports worker 0 bound, prints the READY line once all serve, passes
SIGTERM/SIGINT on, and stops every worker when one exits on its own (an orchestrator restarts
the whole server; a lone restarted worker would not hold what clients had changed).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from sixfold.backends.processes import process_alive
from sixfold.server.workers.process import READY_PREFIX, ReadyProcess
from sixfold.server.observability.metrics import MetricsEndpoint
from sixfold.server.workers.worker_metrics import WorkersMetrics

__all__ = ["WORKER_PREFIX", "worker_ports_line", "serve_workers"]

WORKER_PREFIX = "WORKER "
"""A worker prints ``WORKER grpc=PORT http=PORT|off metrics=PORT|off`` just before its READY line."""

START_TIMEOUT_S = 600.0
"""How long a worker may take to load its models and warm up before the server gives up."""
_PR_SET_PDEATHSIG = 1
SUPERVISOR_ENV = "SIXFOLD_SUPERVISOR_PID"
"""Set in each worker's environment: the worker follows its supervisor out (``follow_supervisor``)."""


def worker_ports_line(grpc_port: int, http_port: int | None, metrics_port: int | None) -> str:
    def text(port: int | None) -> str:
        return "off" if port is None else str(port)
    return f"{WORKER_PREFIX}grpc={grpc_port} http={text(http_port)} metrics={text(metrics_port)}"


def _parse_ports(lines: Sequence[str]) -> dict[str, int | None]:
    line = next(line for line in lines if line.startswith(WORKER_PREFIX))
    fields = dict(item.split("=", 1) for item in line[len(WORKER_PREFIX):].split())
    return {k: None if v == "off" else int(v) for k, v in fields.items()}


def follow_supervisor() -> None:
    """In a worker, first thing: SIGTERM to this process when the supervisor dies (Linux), and exit at
    once if it died already (before the request could take effect)."""
    supervisor = int(os.environ.get(SUPERVISOR_ENV, "0"))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the supervisor's own handlers still stop the workers
        pass
    if supervisor and os.getppid() != supervisor:
        raise SystemExit(f"sixfold-serve: worker's supervisor (pid {supervisor}) is gone")


RUN_FOLDER_PREFIX = "sixfold-workers-"
"""The workers' shared run folder: ``/dev/shm/sixfold-workers-<supervisor pid>-*``."""


def _remove_stale_run_folders(parent: Path) -> None:
    """Remove run folders of supervisors that no longer run: a killed supervisor cannot remove its own."""
    for entry in parent.glob(f"{RUN_FOLDER_PREFIX}*-*"):
        pid = entry.name[len(RUN_FOLDER_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def serve_workers(argv: Sequence[str], count: int, *, host: str, grpc_port: int, http_port: int,
                  metrics_port: int, tls_cert: str | None = None, tls_key: str | None = None,
                  metrics_token: str | None = None, print_line: Callable[[str], None] = print,
                  env: Mapping[str, str | None] | None = None) -> int:
    """Run ``count`` workers of ``sixfold-serve argv`` until SIGTERM/SIGINT or one of them exits; the exit code.

    ``http_port`` / ``metrics_port``: as sixfold-serve takes them (-1: off, 0: free). The workers'
    own /metrics pages are on loopback; this process serves them all on ``metrics_port``. ``env``: set
    (None: unset) in the workers' environment, on top of this one's: secrets such as the tokens go there,
    not in ``argv``, which every local user can read in the process list. The ports were checked by
    sixfold-serve before it got here (``sixfold.server.app.check_ports``, a plain bind that also tells
    apart another server holding a port the workers would join with SO_REUSEPORT).
    """
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    _remove_stale_run_folders(Path(shm or tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=f"{RUN_FOLDER_PREFIX}{os.getpid()}-", dir=shm))
    base = [sys.executable, "-m", "sixfold.server.cli", *argv]
    worker_env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    for key, value in (env or {}).items():
        if value is None:
            worker_env.pop(key, None)
        else:
            worker_env[key] = value
    lock = threading.Lock()
    workers: list[ReadyProcess | None] = [None] * count
    stopping = threading.Event()

    def echo(index: int) -> Callable[[str], None]:
        def line(text: str) -> None:
            if not text.startswith(WORKER_PREFIX):
                with lock:
                    print_line(f"[worker {index}] {text.rstrip()}")
        return line

    def start(index: int, grpc: int, http: int) -> ReadyProcess:
        """Start a worker without waiting for it; from this thread (a worker's parent-death signal follows
        the thread that started it, so none may start from a pool's thread). Its own session: a terminal's
        Ctrl-C reaches the supervisor alone, which stops the workers in order."""
        cmd = [*base, "--as-worker", f"{folder}:{index}:{count}", "--grpc-port", str(grpc),
               "--http-port", str(http), "--metrics-port", "-1" if metrics_port < 0 else "0"]
        worker = ReadyProcess(cmd, env=worker_env, echo=echo(index), start_new_session=True, timeout_s=0)
        workers[index] = worker
        return worker

    def stop_all(sig: int = signal.SIGTERM) -> None:
        for worker in workers:
            if worker is not None and worker.proc.poll() is None:
                worker.proc.send_signal(sig)

    def on_signal(signum: int, frame: object) -> None:  # a second signal ends the workers' drain grace
        stopping.set()
        stop_all()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    metrics: MetricsEndpoint | None = None
    try:
        first = start(0, grpc_port, http_port)
        if not _wait_ready(first, stopping):
            return _stopped(workers) if stopping.is_set() else _failed(first, 0)
        ports = _parse_ports(first.lines)
        others = [start(i, ports["grpc"], -1 if ports["http"] is None else ports["http"]) for i in range(1, count)]
        if stopping.is_set():  # a signal while they were starting: they may have missed it
            return _stopped(workers)
        for index, worker in enumerate(others, start=1):
            if not _wait_ready(worker, stopping):
                if stopping.is_set():
                    return _stopped(workers)
                stop_all()
                return _failed(worker, index)
        pages = []
        for index, worker in enumerate(workers):
            assert worker is not None
            pages.append(_parse_ports(worker.lines)["metrics"])
            print_line(f"sixfold-serve: worker {index} pid {worker.pid}")
        if metrics_port >= 0:
            metrics = MetricsEndpoint(WorkersMetrics(pages, token=metrics_token, tls=bool(tls_cert and tls_key)))
            try:
                bound = metrics.serve(host, metrics_port, tls_cert=tls_cert, tls_key=tls_key, token=metrics_token)
            except OSError as exc:
                metrics = None
                _error(f"sixfold-serve: could not serve metrics on {host}:{metrics_port}: {exc.strerror or exc}")
                stop_all()
                _wait_all(workers)
                return 2
            print_line(f"sixfold-serve: metrics of all workers on {host}:{bound} (summed as one server's)")
        print_line(f"sixfold-serve: {count} workers share {host}:{ports['grpc']} (gRPC)"
                   + (f" and {host}:{ports['http']} (REST)" if ports["http"] is not None else "")
                   + f"; run folder {folder}")
        print_line(f"{READY_PREFIX}{host}:{ports['grpc']}")
        while not stopping.is_set():
            exited = [(i, w) for i, w in enumerate(workers) if w is not None and w.proc.poll() is not None]
            if exited:
                index, worker = exited[0]
                _error(f"sixfold-serve: worker {index} (pid {worker.pid}) exited with code "
                       f"{worker.proc.returncode}; stopping the others")
                stop_all()
                _wait_all(workers)
                return 1
            stopping.wait(0.2)
        return max(_wait_all(workers), default=0)
    finally:
        stop_all()
        if metrics is not None:
            metrics.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for worker in workers:
            if worker is not None and worker.proc.poll() is None:
                worker.kill()
        shutil.rmtree(folder, ignore_errors=True)


def _error(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _wait_ready(worker: ReadyProcess, stopping: threading.Event) -> bool:
    """Wait for a worker's READY line; False if it did not come in time, or the server is being stopped."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not stopping.is_set() and time.monotonic() < deadline:
        if worker.wait_ready(0.2) or worker.proc.poll() is not None:
            return bool(worker.url)
    return False


def _stopped(workers: Sequence[ReadyProcess | None]) -> int:
    """Stopped by a signal while starting: every worker started so far is stopped; a clean exit."""
    for worker in workers:
        if worker is not None and worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGTERM)
    _wait_all(workers)
    return 0


def _wait_all(workers: Sequence[ReadyProcess | None], timeout_s: float = 120.0) -> list[int]:
    """Each worker's exit code once it stops (SIGKILL after ``timeout_s``: drain and grace are shorter)."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for worker in workers:
        if worker is None:
            continue
        try:
            codes.append(worker.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - past the deadline: kill it
            codes.append(worker.kill())
    return [abs(c) for c in codes]


def _failed(worker: ReadyProcess, index: int) -> int:
    code = worker.proc.poll()
    if code is None:  # too slow to start: do not leave it behind
        worker.kill()
        _error(f"sixfold-serve: worker {index} did not become ready")
        return 1
    _error(f"sixfold-serve: worker {index} could not start (exit code {code})")
    return code if code > 0 else 1
