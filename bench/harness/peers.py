"""The servers a bench compares, each as a ``ServerProc`` ready to start: sixfold-serve (this checkout
or another tree), the FIFO server (``bench/fifo_server.py``), Seldon MLServer (``.venv-mlserver``) and NVIDIA
Triton (``.venv-triton``).

One place says how each is started, so every bench runs them with the same flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.harness.commands import ROOT, command
from bench.harness.process import ServerProc, free_port

__all__ = ["MLSERVER_PYTHON", "TRITON_CONFIGS", "TRITON_PYTHON", "fifo_server", "mlserver_missing", "mlserver_server",
           "mlserver_version", "sixfold_server", "triton_missing", "triton_server", "triton_version"]

MLSERVER_PYTHON = ROOT / ".venv-mlserver" / "bin" / "python"
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
# The Triton configurations a bench compares, by server name: ``bench/triton_peer/serve.py`` flags. Dynamic
# batching batches whole requests (each sent with a leading batch dimension: loadgen's ``batch_dim``).
TRITON_CONFIGS: dict[str, list[str]] = {
    "triton": [],
    "triton-2inst": ["--instances", "2"],
    "triton-batch": ["--dynamic-batching"],
}

# serve.py starts `mlserver start` with subprocess.call: give that grandchild the same parent-death
# signal, then run serve.py, unchanged, as __main__.
_MLSERVER_WRAPPER = """\
import ctypes, runpy, signal, subprocess, sys
def die():
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
die()
_call = subprocess.call
subprocess.call = lambda *a, **k: _call(*a, preexec_fn=die, **k)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def sixfold_server(model: str, max_rows: int, cards: int | None, *, batching: bool, tree: str | None = None,
                   workers: int = 1, extra: list[str] | None = None, name: str | None = None) -> ServerProc:
    """``tree``: serve with the code of another source tree (e.g. ``git archive`` of an earlier commit), put
    first on PYTHONPATH, with this venv's packages: a before/after comparison in one run. ``workers``:
    ``sixfold-serve --workers`` (a tree from before the option serves with one). ``extra``: more
    ``sixfold-serve`` arguments (``--serve-arg``), for every sixfold server. ``cards`` None: no ``--cards``,
    sixfold-serve's own layout for the host. ``name``: the server's name in reports (default from the rest)."""
    argv = [*command("sixfold-serve", tree=tree), "--model", model, "--max-rows", str(max_rows),
            *([] if cards is None else ["--cards", str(cards)]), "--host", "127.0.0.1", "--grpc-port", "0",
            "--metrics-port", "-1", "--http-port", "-1", "--drain-seconds", "0"]
    if workers > 1 and tree is None:
        argv += ["--workers", str(workers)]
    argv += extra or []
    if not batching:
        argv += ["--max-batch-rows", "1", "--max-queue-delay-us", "0"]
    env = None
    if tree is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(tree).resolve()),
                                                                           os.environ.get("PYTHONPATH"))))}
    name = name or ("sixfold-before" if tree is not None else "sixfold" if batching else "sixfold-nobatch")
    return ServerProc(name, argv, ready_line="READY grpc=", env=env)


def fifo_server(model: str, max_rows: int, extra: list[str] | None = None) -> ServerProc:
    """``bench/fifo_server.py``: the offline torch model, one query at a time in arrival order."""
    argv = [sys.executable, str(ROOT / "bench" / "fifo_server.py"), "--model", model, "--max-rows", str(max_rows),
            "--host", "127.0.0.1", "--port", "0", *(extra or [])]
    return ServerProc("fifo", argv, ready_line="READY grpc=")


def mlserver_missing() -> str | None:
    """Why MLServer cannot run here, or None."""
    if not MLSERVER_PYTHON.exists() or not (MLSERVER_PYTHON.parent / "mlserver").exists():
        return "MLServer is not installed (no .venv-mlserver: run `make mlserver-venv`)"
    return None


def mlserver_version() -> str:
    try:
        out = subprocess.run([str(MLSERVER_PYTHON), "-c", "import mlserver; print(mlserver.__version__)"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def mlserver_server(model: str, max_rows: int, batch_size: int, batch_time_s: float) -> ServerProc:
    """``bench/mlserver/serve.py`` in ``.venv-mlserver``: the same torch model with adaptive batching."""
    grpc_port, http_port = free_port(), free_port()
    argv = [str(MLSERVER_PYTHON), "-c", _MLSERVER_WRAPPER, str(ROOT / "bench" / "mlserver" / "serve.py"),
            "--model", model, "--max-rows", str(max_rows), "--grpc-port", str(grpc_port),
            "--http-port", str(http_port), "--max-batch-size", str(batch_size), "--max-batch-time", str(batch_time_s)]
    return ServerProc("mlserver", argv, ready_line="gRPC server running on", url=f"127.0.0.1:{grpc_port}")


def triton_missing() -> str | None:
    """Why Triton cannot run here, or None."""
    if not TRITON_PYTHON.exists():
        return "Triton is not installed (no .venv-triton: run `make triton-venv`)"
    return None


def triton_version() -> str:
    try:
        out = subprocess.run([str(TRITON_PYTHON), "-c", "import importlib.metadata as m; "
                              "print('nvidia-pytriton', m.version('nvidia-pytriton'))"],
                             capture_output=True, text=True, timeout=60)
        return (out.stdout.strip() or "?") + " (tritonserver 2.51, Python backend)"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def triton_server(name: str, model: str, max_rows: int, extra: list[str] | None = None) -> ServerProc:
    """``bench/triton_peer/serve.py`` in ``.venv-triton`` in configuration ``name`` (a ``TRITON_CONFIGS`` key): the same
    torch model behind Triton's Python backend."""
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    argv = [str(TRITON_PYTHON), str(ROOT / "bench" / "triton_peer" / "serve.py"), "--model", model,
            "--max-rows", str(max_rows), "--grpc-port", str(grpc_port), "--http-port", str(http_port),
            "--metrics-port", str(metrics_port), *TRITON_CONFIGS[name], *(extra or [])]
    return ServerProc(name, argv, ready_line="READY grpc=", url=f"127.0.0.1:{grpc_port}")
