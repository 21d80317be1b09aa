"""What system shared memory refuses: symlinks and non-regular objects, keys that leave /dev/shm,
registrations past the server's caps, and an unregister from a client that register would refuse.

Real objects in /dev/shm (removed after), stock tritonclient, real gRPC and REST over 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.core import InferenceCore
from sixfold.server.errors import InvalidInput
from sixfold.server.loading.loader import load_builtin
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.protocol.shared_memory import (MAX_REGIONS, SHM_ROOT, SharedMemoryRegistry, TooManyRegions)
from sixfold.server.scheduling.batcher import BatchingConfig

from tests.server.protocol.test_shared_memory import _inputs, _non_loopback_address, segment


@contextlib.contextmanager
def shm_entry(make) -> Iterator[tuple[str, Path]]:
    """A fresh name in /dev/shm made by ``make(path)`` (a symlink, a FIFO, ...); removed after."""
    name = f"sixfold-test-{uuid.uuid4().hex[:12]}"
    path = SHM_ROOT / name
    make(path)
    try:
        yield f"/{name}", path
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def tiny_server(registry: SharedMemoryRegistry | None = None, **config) -> Iterator[BackgroundServer]:
    served = load_builtin("tiny", max_rows=None, seed=0, cards=1, backend="simcard", card_spec="m2-card",
                          metrics=ServerMetrics(), batching=BatchingConfig())
    core = InferenceCore([served])
    if registry is not None:
        core.shared_memory = registry
    options = dict(grpc_port=0, http_port=0, metrics_port=None, warmup=False) | config
    background = BackgroundServer(core, ServerConfig(**options), ServerMetrics()).start()
    try:
        yield background
    finally:
        background.stop()


def _rest(url: str) -> th.InferenceServerClient:
    return th.InferenceServerClient(url, network_timeout=30.0)


def _close_rest(client: th.InferenceServerClient) -> None:
    client.close()
    client.close = lambda: None  # NOTE: its __del__ would close it again, on whatever thread collects it


@pytest.fixture
def victim(tmp_path) -> Path:
    """A file the server's user can write, outside /dev/shm: what a symlinked key points at."""
    path = tmp_path / "victim.bin"
    path.write_bytes(b"precious" * 512)
    return path


# --- the registry ----------------------------------------------------------------------------------

@pytest.mark.parametrize("inside_shm", [False, True], ids=["to-a-file-elsewhere", "to-a-segment"])
def test_a_symlinked_key_is_refused_and_its_target_untouched(victim, inside_shm):
    registry = SharedMemoryRegistry()
    with segment(4096) as (real_key, _):
        target = SHM_ROOT / real_key.lstrip("/") if inside_shm else victim
        before = target.read_bytes()
        with shm_entry(lambda p: p.symlink_to(target)) as (key, _):
            with pytest.raises(InvalidInput, match=rf"region 'out': shared memory key '{key}' is a symbolic link"):
                registry.register("out", key, 0, 64)
        assert len(registry) == 0
        assert target.read_bytes() == before


@pytest.mark.parametrize("make, words", [
    (os.mkfifo, "is not a regular shared memory object"),
    (lambda p: p.mkdir(), "cannot open shared memory key"),
])
def test_only_regular_objects_are_mapped(make, words):
    registry = SharedMemoryRegistry()
    with shm_entry(make) as (key, _):
        with pytest.raises(InvalidInput, match=words):
            registry.register("r", key, 0, 8)
    assert len(registry) == 0


@pytest.mark.parametrize("key", ["/..", "/.", "..", "/a/b", "/../etc/passwd", "/x..y", "/a\0b", "", "/"])
def test_keys_that_could_leave_the_shm_directory_are_refused(key):
    with pytest.raises(InvalidInput, match="must name a POSIX shared memory object"):
        SharedMemoryRegistry().register("r", key, 0, 8)


def test_the_region_and_byte_caps_refuse_the_next_registration_naming_the_cap():
    registry = SharedMemoryRegistry(max_regions=3, max_bytes=10_000)
    with segment(8192) as (key, _):
        for i in range(3):
            registry.register(f"r{i}", key, 0, 1024)
        with pytest.raises(TooManyRegions, match=r"region 'r3': 3 shared memory regions .*max regions 3"):
            registry.register("r3", key, 0, 1024)
        registry.unregister("r0")
        with pytest.raises(TooManyRegions, match=r"from 2048 to 10240 bytes.*max bytes 10000") as info:
            registry.register("big", key, 0, 8192)  # offset + byte_size is what is mapped
        assert info.value.code.name == "RESOURCE_EXHAUSTED"
        registry.register("fits", key, 4096, 1024)
        assert registry.mapped_bytes == 2048 + 5120
    assert MAX_REGIONS == SharedMemoryRegistry().max_regions == 1024


# --- over the wire ----------------------------------------------------------------------------------

def test_a_symlinked_key_is_refused_over_grpc_and_rest_and_the_server_keeps_serving(victim):
    query = models.RequestGenerator.for_config(models.get_config("tiny"), seed=1).make(4)
    before = victim.read_bytes()
    with tiny_server() as server, shm_entry(lambda p: p.symlink_to(victim)) as (key, _):
        with contextlib.closing(tc.InferenceServerClient(server.url)) as client:
            with pytest.raises(InferenceServerException, match="is a symbolic link") as info:
                client.register_system_shared_memory("scores", key, 4096)
            assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
            out = tc.InferRequestedOutput("scores")
            out.set_shared_memory("scores", 4096)
            with pytest.raises(InferenceServerException, match="no shared memory region 'scores'"):
                client.infer("tiny", _inputs(tc, query, None), outputs=[out])
            rest = _rest(server.http_url)
            try:
                with pytest.raises(InferenceServerException, match=r"\[400\].*is a symbolic link"):
                    rest.register_system_shared_memory("scores", key, 4096)
            finally:
                _close_rest(rest)
            assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
            assert client.infer("tiny", _inputs(tc, query, None)).as_numpy("scores").shape == (4, 1)
    assert victim.read_bytes() == before


def test_the_default_region_cap_refuses_the_next_over_grpc_and_rest_and_the_server_keeps_serving():
    query = models.RequestGenerator.for_config(models.get_config("tiny"), seed=1).make(4)
    with tiny_server() as server, segment(64) as (key, _):
        with contextlib.closing(tc.InferenceServerClient(server.url)) as client:
            for i in range(MAX_REGIONS):  # one segment under many names: each is its own mapping
                client.register_system_shared_memory(f"r{i}", key, 64)
            with pytest.raises(InferenceServerException, match=f"max regions {MAX_REGIONS}") as info:
                client.register_system_shared_memory("one-too-many", key, 64)
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            rest = _rest(server.http_url)
            try:
                with pytest.raises(InferenceServerException, match=rf"\[429\].*max regions {MAX_REGIONS}"):
                    rest.register_system_shared_memory("one-too-many", key, 64)
            finally:
                _close_rest(rest)
            assert client.infer("tiny", _inputs(tc, query, None)).as_numpy("scores").shape == (4, 1)
            assert len(client.get_system_shared_memory_status(as_json=True)["regions"]) == MAX_REGIONS
            client.unregister_system_shared_memory("r0")
            client.register_system_shared_memory("one-too-many", key, 64)  # room again
            client.unregister_system_shared_memory()


def test_the_byte_cap_is_refused_over_rest_with_429():
    with tiny_server(SharedMemoryRegistry(max_bytes=4096)) as server, segment(8192) as (key, _):
        rest = _rest(server.http_url)
        try:
            rest.register_system_shared_memory("a", key, 4096)
            with pytest.raises(InferenceServerException, match=r"\[429\].*max bytes 4096"):
                rest.register_system_shared_memory("b", key, 1)
            rest.unregister_system_shared_memory()
        finally:
            _close_rest(rest)


def test_an_unregister_from_another_address_is_refused_like_a_register_over_grpc_and_rest():
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    with tiny_server(host="0.0.0.0") as server, segment(64) as (key, _):
        grpc_port, http_port = server.url.rsplit(":", 1)[1], server.http_url.rsplit(":", 1)[1]
        with contextlib.closing(tc.InferenceServerClient(f"127.0.0.1:{grpc_port}")) as local:
            local.register_system_shared_memory("r", key, 64)
            with contextlib.closing(tc.InferenceServerClient(f"{address}:{grpc_port}")) as remote:
                for name in ("r", ""):  # one region, and all of them
                    with pytest.raises(InferenceServerException,
                                       match=f"unregistration from {address} is refused") as info:
                        remote.unregister_system_shared_memory(name)
                    assert info.value.status() == "StatusCode.PERMISSION_DENIED"
            rest = _rest(f"{address}:{http_port}")
            try:
                for name in ("r", ""):
                    with pytest.raises(InferenceServerException, match=r"\[403\].*unregistration from"):
                        rest.unregister_system_shared_memory(name)
            finally:
                _close_rest(rest)
            assert [r["name"] for r in local.get_system_shared_memory_status(as_json=True)["regions"].values()] == ["r"]
            local.unregister_system_shared_memory("r")  # over loopback, as before
            assert local.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}
