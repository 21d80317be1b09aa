"""Delta storage failures are errors, never half-applied: a full disk refuses the delta naming the file, and
temporaries a killed process left (log entries being written, uploads being applied) are removed at load."""

from __future__ import annotations

import asyncio
import errno
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.deltas.cli import apply_delta, rollback_delta
from sixfold.server.loading.loader import load_from_repository
from sixfold.server.loading.model_control import ModelControl
from sixfold.server.loading.repository import ModelRepository
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.scheduling.batcher import BatchingConfig
from tests.server.deltas.test_deltas import REQUESTS, TOKEN, _infer, _sequence, versions  # noqa: F401 (a fixture)


def _dead_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait(timeout=10)
    return done.pid


def _fill(folder: Path) -> Path:
    """Write a ballast file until the file system is full; returns it."""
    ballast = folder / "ballast"
    block = b"\0" * (64 << 10)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return ballast


def test_a_full_disk_refuses_a_delta_naming_the_file_and_leftovers_are_cleaned(tmp_path: Path, versions: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True,
                          text=True, timeout=10)
    if done.returncode:
        pytest.skip(f"mounting is not allowed here: {done.stderr.strip() or done.returncode}")
    background = None
    try:
        version = disk / "repo" / "resident" / "1"
        shutil.copytree(versions / "v1", version)
        dead = _dead_pid()
        crashed_entry = version / "deltas" / f".000001.tmp{dead}"
        crashed_entry.mkdir(parents=True)
        (crashed_entry / "table_000.ids.npy").write_bytes(b"half")
        crashed_upload = Path(tempfile.gettempdir()) / f"sixfold-delta-{dead}-x1"
        crashed_upload.mkdir(exist_ok=True)
        metrics, core = ServerMetrics(), InferenceCore()

        def loader(r, name, v):
            return load_from_repository(r, name, v, backend="simcard", metrics=metrics, cache_dir=tmp_path / "cache",
                                        batching=BatchingConfig(max_queue_delay_microseconds=0))

        core.control = ModelControl(core, ModelRepository(disk / "repo"), loader, explicit=True)
        background = BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None, control_token=TOKEN),
                                      metrics).start()
        asyncio.run_coroutine_threadsafe(core.control.load("resident"), background._loop).result(timeout=120)
        assert not crashed_entry.exists() and not crashed_upload.exists()  # removed when the model loaded
        client = grpcclient.InferenceServerClient(background.url)
        before = [_infer(client, "resident", r) for r in REQUESTS]
        ballast = _fill(disk)
        with pytest.raises(InferenceServerException) as refused:
            apply_delta(background.url, "resident", versions / "d1", token=TOKEN)
        message = refused.value.message()
        assert "StatusCode.UNAVAILABLE" in str(refused.value.status()), refused.value
        assert "not applied" in message and str(version / "deltas" / "000001") in message, message
        assert "No space left on device" in message and "bytes needed" in message, message
        assert _sequence(background.url, "resident") == "0"
        assert all(np.array_equal(a, b) for a, b in zip([_infer(client, "resident", r) for r in REQUESTS], before))
        assert [p.name for p in (version / "deltas").iterdir() if p.name.startswith(".")] == []
        ballast.unlink()
        assert apply_delta(background.url, "resident", versions / "d1", token=TOKEN) == "1"
    finally:
        if background is not None:
            background.stop()
        subprocess.run(["umount", "-l", str(disk)], timeout=10)


def test_a_state_write_to_a_full_or_read_only_disk_names_the_file_and_keeps_the_previous_state(
        tmp_path: Path, versions: Path) -> None:
    """A rollback writes only applied.json: on a full tmpfs (ENOSPC), then on the same file system remounted
    read-only (EROFS), it is refused UNAVAILABLE naming applied.json and its bytes; applied.json stays byte for
    byte what it was, the model serves sequence 1 and v2's scores, no temporary is left; writable again, the
    rollback goes through."""
    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True,
                          text=True, timeout=10)
    if done.returncode:
        pytest.skip(f"mounting is not allowed here: {done.stderr.strip() or done.returncode}")
    background = None
    try:
        version = disk / "repo" / "resident" / "1"
        shutil.copytree(versions / "v1", version)
        metrics, core = ServerMetrics(), InferenceCore()

        def loader(r, name, v):
            return load_from_repository(r, name, v, backend="simcard", metrics=metrics, cache_dir=tmp_path / "cache",
                                        batching=BatchingConfig(max_queue_delay_microseconds=0))

        core.control = ModelControl(core, ModelRepository(disk / "repo"), loader, explicit=True)
        background = BackgroundServer(core, ServerConfig(grpc_port=0, metrics_port=None, control_token=TOKEN),
                                      metrics).start()
        asyncio.run_coroutine_threadsafe(core.control.load("resident"), background._loop).result(timeout=120)
        client = grpcclient.InferenceServerClient(background.url)
        assert apply_delta(background.url, "resident", versions / "d1", token=TOKEN) == "1"
        state = version / "deltas" / "applied.json"
        before_state = state.read_bytes()
        before = [_infer(client, "resident", r) for r in REQUESTS]
        ballast = _fill(disk)
        for problem, remount in (("No space left on device", None), ("Read-only file system", "ro")):
            if remount:
                ballast.unlink()
                subprocess.run(["mount", "-o", f"remount,{remount}", str(disk)], check=True, timeout=10)
            with pytest.raises(InferenceServerException) as refused:
                rollback_delta(background.url, "resident", token=TOKEN)
            message = refused.value.message()
            assert "StatusCode.UNAVAILABLE" in str(refused.value.status()), refused.value
            assert str(state) in message and problem in message, message
            written = re.search(r"applied.json: the delta log's state \((\d+) bytes\) could not be written", message)
            assert written and int(written.group(1)) > 0 and "serves sequence 1" in message, message
            assert state.read_bytes() == before_state
            assert [p.name for p in (version / "deltas").iterdir() if p.name.startswith(".")] == []
            assert _sequence(background.url, "resident") == "1"
            assert all(np.array_equal(a, b) for a, b in zip([_infer(client, "resident", r) for r in REQUESTS], before))
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True, timeout=10)
        assert rollback_delta(background.url, "resident", token=TOKEN) == "0"
        assert b'"sequence": 0' in state.read_bytes()
    finally:
        if background is not None:
            background.stop()
        subprocess.run(["umount", "-l", str(disk)], timeout=10)
