"""``sixfold-serve --workers N``: one engine and N front ends behind the server's ports.

One event loop is one Python server's ceiling: decoding, validation and the answer of every request
run on it, one core's worth at most. With ``--workers N`` the protocol work spreads over N
front-end processes (``sixfold.server.frontend``) bound to the same gRPC and REST ports with
SO_REUSEPORT, while the tables, models, batcher and cards live once, in one engine process (a
``sixfold-serve`` with ``--as-engine``, on loopback and Unix sockets only). The front ends pass
tensors to the engine through shared memory (``sixfold.server.workers.engine_channel``), so
requests from every front end batch together, table deltas and model control work as in one
process, and host memory holds one copy of the tables.

This process only supervises: it starts the engine, then front end 1 (which binds the ports asked
for, 0 included), then the others on the ports front end 1 bound; prints the READY line once all
serve; passes SIGTERM/SIGINT on; restarts a front end that exits on its own (it holds nothing a
client changed: the engine does); and stops the server (exit code 1) when the engine exits on its
own. Its /metrics is one page: the engine's series and the front ends' counters
(``sixfold.server.workers.worker_metrics``; worker 0 is the engine).
"""

from __future__ import annotations

import ctypes
import json
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


ENGINE_ARGS = "--as-engine"
"""The flag that makes a ``sixfold-serve`` the engine of a ``--workers`` server (its value: the run folder)."""
RESTART_READY_S = 60.0
"""How long a restarted front end may take to serve (it loads no model: about a second)."""


def serve_workers(argv: Sequence[str], count: int, *, host: str, grpc_port: int, http_port: int,
                  metrics_port: int, tls_cert: str | None = None, tls_key: str | None = None,
                  metrics_token: str | None = None, front_end: Mapping[str, object] | None = None,
                  print_line: Callable[[str], None] = print,
                  env: Mapping[str, str | None] | None = None) -> int:
    """Run the engine of ``sixfold-serve argv`` and ``count`` front ends until SIGTERM/SIGINT or the engine exits;
    the exit code.

    ``http_port`` / ``metrics_port``: as sixfold-serve takes them (-1: off, 0: free). ``front_end``: the
    front ends' own settings (``sixfold.server.frontend.FrontEndSpec`` fields: message size, drain,
    arena bytes, transport limits). ``env``: set (None: unset) in the children's environment, on top of this
    one's: secrets such as the tokens go there, not in ``argv``, which every local user can read in the process
    list. The ports were checked by sixfold-serve before it got here (``sixfold.server.app.check_ports``).
    """
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    _remove_stale_run_folders(Path(shm or tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=f"{RUN_FOLDER_PREFIX}{os.getpid()}-", dir=shm))
    child_env = {**os.environ, SUPERVISOR_ENV: str(os.getpid())}
    for key, value in (env or {}).items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    lock = threading.Lock()
    procs: list[ReadyProcess | None] = [None] * (count + 1)
    """Index 0: the engine; 1..count: the front ends."""
    stopping = threading.Event()

    def echo(index: int) -> Callable[[str], None]:
        def line(text: str) -> None:
            if not text.startswith(WORKER_PREFIX):
                with lock:
                    print_line(f"[worker {index}] {text.rstrip()}")
        return line

    def start_engine() -> ReadyProcess:
        cmd = [sys.executable, "-m", "sixfold.server.cli", *argv, ENGINE_ARGS, str(folder), "--host", "127.0.0.1",
               "--grpc-port", "0", "--http-port", "-1" if http_port < 0 else "0",
               "--metrics-port", "-1" if metrics_port < 0 else "0"]
        procs[0] = ReadyProcess(cmd, env=child_env, echo=echo(0), start_new_session=True, timeout_s=0)
        return procs[0]

    def start_front_end(index: int, grpc: int, http: int, engine_http: str | None) -> ReadyProcess:
        """Start a front end without waiting for it; from this thread (a child's parent-death signal follows
        the thread that started it). Its own session: a terminal's Ctrl-C reaches the supervisor alone."""
        spec = {**(front_end or {}), "folder": str(folder), "index": index, "count": count, "host": host,
                "grpc_port": grpc, "http_port": None if http < 0 else http, "engine_http": engine_http,
                "metrics": metrics_port >= 0, "tls_cert": tls_cert, "tls_key": tls_key}
        cmd = [sys.executable, "-m", "sixfold.server.frontend", json.dumps(spec)]
        procs[index] = ReadyProcess(cmd, env=child_env, echo=echo(index), start_new_session=True, timeout_s=0)
        return procs[index]  # type: ignore[return-value]

    def stop_all(sig: int = signal.SIGTERM) -> None:
        for proc in procs:
            if proc is not None and proc.proc.poll() is None:
                proc.proc.send_signal(sig)

    def on_signal(signum: int, frame: object) -> None:  # a second signal ends the children's drain grace
        stopping.set()
        stop_all()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    metrics: MetricsEndpoint | None = None
    try:
        engine = start_engine()
        if not _wait_ready(engine, stopping):
            return _stopped(procs) if stopping.is_set() else _failed(engine, 0)
        engine_ports = _parse_ports(engine.lines)
        engine_http = None if engine_ports["http"] is None else f"127.0.0.1:{engine_ports['http']}"
        first = start_front_end(1, grpc_port, http_port, engine_http)
        if not _wait_ready(first, stopping):
            if stopping.is_set():
                return _stopped(procs)
            stop_all()
            return _failed(first, 1)
        ports = _parse_ports(first.lines)
        shared_http = -1 if ports["http"] is None else ports["http"]
        others = [start_front_end(i, ports["grpc"], shared_http, engine_http) for i in range(2, count + 1)]
        if stopping.is_set():  # a signal while they were starting: they may have missed it
            return _stopped(procs)
        for index, proc in enumerate(others, start=2):
            if not _wait_ready(proc, stopping):
                if stopping.is_set():
                    return _stopped(procs)
                stop_all()
                return _failed(proc, index)
        pages = []
        for index, proc in enumerate(procs):
            assert proc is not None
            pages.append(_parse_ports(proc.lines)["metrics"])
            print_line(f"sixfold-serve: worker {index} pid {proc.pid} ({'the engine' if index == 0 else 'a front end'})")
        source = None
        if metrics_port >= 0:
            source = WorkersMetrics(pages, token=metrics_token, tls=bool(tls_cert and tls_key))
            metrics = MetricsEndpoint(source)
            try:
                bound = metrics.serve(host, metrics_port, tls_cert=tls_cert, tls_key=tls_key, token=metrics_token)
            except OSError as exc:
                metrics = None
                _error(f"sixfold-serve: could not serve metrics on {host}:{metrics_port}: {exc.strerror or exc}")
                stop_all()
                _wait_all(procs)
                return 2
            print_line(f"sixfold-serve: metrics of all workers on {host}:{bound} (the engine's series and the "
                       "front ends' counters, as one server's)")
        print_line(f"sixfold-serve: one engine, {count} front ends share {host}:{ports['grpc']} (gRPC)"
                   + (f" and {host}:{ports['http']} (REST)" if ports["http"] is not None else "")
                   + f"; run folder {folder}")
        print_line(f"{READY_PREFIX}{host}:{ports['grpc']}")
        while not stopping.is_set():
            if engine.proc.poll() is not None:
                _error(f"sixfold-serve: the engine (pid {engine.pid}) exited with code {engine.proc.returncode}; "
                       "stopping the front ends")
                stop_all()
                _wait_all(procs)
                return 1
            for index in range(1, count + 1):
                old = procs[index]
                assert old is not None
                if old.proc.poll() is None or stopping.is_set():
                    continue
                fresh = start_front_end(index, ports["grpc"], shared_http, engine_http)
                if not fresh.wait_ready(RESTART_READY_S):
                    if stopping.is_set():
                        break
                    _error(f"sixfold-serve: front end {index} exited with code {old.proc.returncode} and did not "
                           "come back; stopping the server")
                    stop_all()
                    _wait_all(procs)
                    return 1
                if source is not None:
                    source.ports[index] = _parse_ports(fresh.lines)["metrics"]
                print_line(f"sixfold-serve: front end {index} (pid {old.pid}) exited with code "
                           f"{old.proc.returncode}; restarted as pid {fresh.pid}")
            stopping.wait(0.2)
        return max(_wait_all(procs), default=0)
    finally:
        stop_all()
        if metrics is not None:
            metrics.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in procs:
            if proc is not None and proc.proc.poll() is None:
                proc.kill()
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
