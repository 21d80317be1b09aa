"""Shared test helpers: free ports, tritonclient inputs from canonical requests, a registry reset."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from sixfold.server.workers.process import ReadyProcess

# NOTE: derived tables and calibrations go to one folder per test session, not the user's ~/.cache/sixfold: a
# test run leaves nothing behind and never reads a cache an earlier run (or another checkout) wrote. Servers the
# tests start inherit it. A test that needs its own sets SIXFOLD_CACHE_DIR itself (monkeypatch).
_CACHE = tempfile.mkdtemp(prefix="sixfold-test-cache-")
os.environ.setdefault("SIXFOLD_CACHE_DIR", _CACHE)
atexit.register(shutil.rmtree, _CACHE, True)

_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int16): "INT16", np.dtype(np.int32): "INT32",
              np.dtype(np.int64): "INT64"}


@pytest.fixture
def fresh_registry():
    """Rediscovers backends after the test. Request it before ``monkeypatch`` so it runs after
    monkeypatch is undone: the next test sees the real registry, not this test's SIXFOLD_BACKENDS."""
    yield
    from sixfold.backends.registry import discover
    discover(reload=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def triton_inputs(client_module, request: dict[str, np.ndarray]) -> list:
    """tritonclient InferInputs (sync or aio module) carrying ``request``'s arrays as raw bytes."""
    inputs = []
    for name, array in request.items():
        item = client_module.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs


class ServeProcess(ReadyProcess):
    """``sixfold-serve`` as a real process; ``url`` is set once it prints its READY line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 timeout: float = 180.0) -> None:
        # NOTE: REST on a free port unless the test names one: sixfold-serve's default 8000 would collide;
        # no drain grace unless the test names one (the default 5 s would only slow every stop).
        super().__init__([str(Path(sys.executable).parent / "sixfold-serve"), "--http-port", "0",
                          "--drain-seconds", "0", *args],
                         env=env, cwd=cwd, timeout_s=timeout)


def make_certificate(folder: Path, *, common_name: str = "localhost",
                     alt_names: str = "DNS:localhost,IP:127.0.0.1") -> tuple[Path, Path]:
    """A self-signed certificate and its key (PEM files in ``folder``), made by openssl for a day."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={common_name}", "-addext", f"subjectAltName={alt_names}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="session")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for localhost and 127.0.0.1, shared by the TLS tests."""
    return make_certificate(tmp_path_factory.mktemp("tls"))
