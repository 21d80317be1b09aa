"""Triton's system shared memory extension, against real /dev/shm segments and stock tritonclient.

The segments are made with ``tritonclient.utils.shared_memory`` (shm_open, as a Triton user's client
makes them); the server maps them by key. Answers from a region must be bit-identical to the same
query sent over the wire, over gRPC and REST; a bad region, size or key is refused naming the tensor,
and the server keeps serving.
"""

from __future__ import annotations

import contextlib
import os
import uuid
import warnings
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

with warnings.catch_warnings():  # it imports pkg_resources, which warns that it is deprecated
    warnings.simplefilter("ignore")
    import tritonclient.utils.shared_memory as shm

from sixfold import models
from sixfold.server.app import BackgroundServer, ServerConfig
from sixfold.server.scheduling.batcher import BatchingConfig
from sixfold.server.core import InferenceCore
from sixfold.server.errors import InvalidInput
from sixfold.server.loading.loader import load_builtin
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.protocol.shared_memory import SHM_ROOT, RegionExists, RegionNotFound, SharedMemoryRegistry

from tests.server.conftest import MAX_ROWS

_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}


@pytest.fixture(scope="module")
def query() -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=41).make(37)


@contextlib.contextmanager
def segment(byte_size: int) -> Iterator[tuple[str, object]]:
    """A fresh POSIX shared memory segment (key, tritonclient handle), destroyed after."""
    key = f"/sixfold-test-{uuid.uuid4().hex[:12]}"
    handle = shm.create_shared_memory_region(key, key, byte_size)
    try:
        yield key, handle
    finally:
        shm.destroy_shared_memory_region(handle)


def _inputs(module, query: dict[str, np.ndarray], region: str | None, *, raw: tuple[str, ...] = ()) -> list:
    """Inputs laid out back to back in ``region`` (those named in ``raw`` sent over the wire)."""
    inputs, offset = [], 0
    for name, array in query.items():
        item = module.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
        if region is None or name in raw:
            item.set_data_from_numpy(array)
        else:
            item.set_shared_memory(region, array.nbytes, offset=offset)
        offset += array.nbytes
        inputs.append(item)
    return inputs


def _nbytes(query: dict[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in query.values())


# --- the registry, on real segments --------------------------------------------------------------

def test_registry_maps_a_region_reports_it_and_forgets_it():
    registry = SharedMemoryRegistry()
    with segment(4096) as (key, handle):
        shm.set_shared_memory_region(handle, [np.arange(512, dtype=np.int64)])
        registry.register("ids", key, 1024, 2048)
        [status] = registry.status("ids")
        assert (status.key, status.offset, status.byte_size) == (key, 1024, 2048)
        view = registry.read("ids", 8, 16, what="input 'x'")
        assert np.frombuffer(view, np.int64).tolist() == [129, 130]  # 1024 + 8 bytes in
        assert view.readonly
        with pytest.raises(RegionExists, match="already registered"):
            registry.register("ids", key, 0, 8)
        assert registry.unregister("ids") == ["ids"]
        assert registry.unregister("ids") == []  # unknown names are not an error (Triton's rule)
        with pytest.raises(RegionNotFound, match="'ids'"):
            registry.status("ids")
        # NOTE: a view taken before the unregister still reads the client's pages
        assert np.frombuffer(view, np.int64).tolist() == [129, 130]


@pytest.mark.parametrize("key, offset, size, message", [
    ("/sixfold-test-missing", 0, 8, "does not exist"),
    ("/a/b", 0, 8, "must name a POSIX shared memory object"),
    ("/..", 0, 8, "must name a POSIX shared memory object"),
    (None, 4000, 200, "holds 4096"),
    (None, 0, 0, "byte_size is 0"),
    (None, -1, 8, "offset must be a non-negative integer"),
])
def test_registry_refuses_a_bad_registration_naming_the_region(key, offset, size, message):
    registry = SharedMemoryRegistry()
    with segment(4096) as (real_key, _):
        with pytest.raises(InvalidInput, match=message) as info:
            registry.register("r", key or real_key, offset, size)
        assert "'r'" in info.value.message or "key" in info.value.message
    assert len(registry) == 0


def test_reads_outside_a_region_or_from_a_shrunk_segment_fail_the_request_not_the_process():
    registry = SharedMemoryRegistry()
    with segment(8192) as (key, _):
        registry.register("r", key, 0, 8192)
        with pytest.raises(InvalidInput, match="runs past shared memory region 'r'"):
            registry.read("r", 8000, 400, what="input 'sparse_indices'")
        with pytest.raises(InvalidInput, match="input 'dense_features': no shared memory region 'nope'"):
            registry.read("nope", 0, 8, what="input 'dense_features'")
        os.truncate(SHM_ROOT / key.lstrip("/"), 4096)  # the client breaks the contract
        with pytest.raises(InvalidInput, match="was shrunk to 4096 bytes"):
            registry.read("r", 4096, 8, what="input 'x'")
        assert len(registry.read("r", 0, 4096, what="input 'x'")) == 4096


def test_an_output_that_does_not_fit_its_byte_size_is_refused():
    registry = SharedMemoryRegistry()
    with segment(64) as (key, handle):
        registry.register("out", key, 0, 64)
        registry.write("out", 8, 16, np.arange(4, dtype=np.float32).data.cast("B"), what="output 'scores'")
        assert shm.get_contents_as_numpy(handle, np.float32, [16])[2:6].tolist() == [0, 1, 2, 3]
        with pytest.raises(InvalidInput, match="output 'scores': 20 bytes do not fit the 16 bytes"):
            registry.write("out", 0, 16, bytes(20), what="output 'scores'")


# --- gRPC, stock tritonclient ---------------------------------------------------------------------

@pytest.fixture
def grpc_client(served_rm2) -> Iterator[tc.InferenceServerClient]:
    client = tc.InferenceServerClient(served_rm2.url)
    try:
        yield client
    finally:
        client.unregister_system_shared_memory()
        client.close()


@pytest.mark.parametrize("raw", [(), ("dense_features",)], ids=["all-inputs", "mixed-with-raw"])
def test_grpc_inputs_and_output_in_shared_memory_score_like_the_wire(served_rm2, grpc_client, query, raw):
    wire = grpc_client.infer("rm2", _inputs(tc, query, None)).as_numpy("scores")
    np.testing.assert_allclose(wire, served_rm2.expected(query), atol=1e-4)
    items = len(query["dense_features"])
    with segment(_nbytes(query)) as (key, handle), segment(4096) as (out_key, out_handle):
        shm.set_shared_memory_region(handle, list(query.values()))
        grpc_client.register_system_shared_memory("query", key, _nbytes(query))
        grpc_client.register_system_shared_memory("scores", out_key, 4096)
        assert "system_shared_memory" in grpc_client.get_server_metadata().extensions
        status = grpc_client.get_system_shared_memory_status(as_json=True)["regions"]
        assert {r["name"]: r["key"] for r in status.values()} == {"query": key, "scores": out_key}
        out = tc.InferRequestedOutput("scores")
        out.set_shared_memory("scores", 4096)
        result = grpc_client.infer("rm2", _inputs(tc, query, "query", raw=raw), outputs=[out])
        output = result.get_output("scores")
        assert list(output.shape) == [items, 1]
        assert output.parameters["shared_memory_byte_size"].int64_param == items * 4
        got = shm.get_contents_as_numpy(out_handle, np.float32, [items, 1])
        np.testing.assert_array_equal(got, wire)  # bit-identical to the same query over the wire


def test_grpc_bad_shared_memory_requests_are_refused_naming_the_tensor(grpc_client, query):
    with segment(_nbytes(query)) as (key, handle):
        shm.set_shared_memory_region(handle, list(query.values()))
        with pytest.raises(InferenceServerException, match="input 'dense_features': no shared memory region"):
            grpc_client.infer("rm2", _inputs(tc, query, "unregistered"))
        grpc_client.register_system_shared_memory("query", key, _nbytes(query))
        with pytest.raises(InferenceServerException) as info:
            grpc_client.register_system_shared_memory("query", key, _nbytes(query))
        assert info.value.status() == "StatusCode.ALREADY_EXISTS"
        inputs = _inputs(tc, query, "query")
        inputs[2].set_shared_memory("query", query["sparse_indices"].nbytes - 8)
        with pytest.raises(InferenceServerException, match="input 'sparse_indices': shared_memory_byte_size is"):
            grpc_client.infer("rm2", inputs)
        inputs[2].set_shared_memory("query", query["sparse_indices"].nbytes, offset=_nbytes(query))
        with pytest.raises(InferenceServerException, match="runs past shared memory region 'query'"):
            grpc_client.infer("rm2", inputs)
        out = tc.InferRequestedOutput("scores")
        out.set_shared_memory("nowhere", 4096)
        with pytest.raises(InferenceServerException, match="output 'scores': no shared memory region 'nowhere'"):
            grpc_client.infer("rm2", _inputs(tc, query, "query"), outputs=[out])
        # still serving, from the region
        assert grpc_client.infer("rm2", _inputs(tc, query, "query")).as_numpy("scores").shape == (37, 1)
        with pytest.raises(InferenceServerException) as info:
            grpc_client.get_system_shared_memory_status("nope")
        assert info.value.status() == "StatusCode.NOT_FOUND"


def test_a_server_with_shared_memory_off_refuses_it_and_still_serves():
    served = load_builtin("tiny", max_rows=None, seed=0, cards=1, backend="simcard", card_spec="m2-card", metrics=ServerMetrics(),
                          batching=BatchingConfig())
    query = models.RequestGenerator.for_config(models.get_config("tiny"), seed=1).make(4)
    config = ServerConfig(grpc_port=0, metrics_port=None, shared_memory=False, warmup=False)
    background = BackgroundServer(InferenceCore([served]), config, ServerMetrics()).start()
    try:
        with contextlib.closing(tc.InferenceServerClient(background.url)) as client:
            assert "system_shared_memory" not in client.get_server_metadata().extensions
            with pytest.raises(InferenceServerException) as info:
                client.register_system_shared_memory("r", "/sixfold-any", 8)
            assert info.value.status() == "StatusCode.UNAVAILABLE"
            with pytest.raises(InferenceServerException, match="does not accept shared memory inputs"):
                client.infer("tiny", _inputs(tc, query, "r"))
            assert client.infer("tiny", _inputs(tc, query, None)).as_numpy("scores").shape == (4, 1)
    finally:
        background.stop()


# --- REST, stock tritonclient.http ----------------------------------------------------------------

def test_rest_inputs_and_output_in_shared_memory_score_like_grpc(served_rm2, grpc_client, query):
    wire = grpc_client.infer("rm2", _inputs(tc, query, None)).as_numpy("scores")
    client = th.InferenceServerClient(served_rm2.http_url, network_timeout=60.0)
    try:
        with segment(_nbytes(query)) as (key, handle), segment(4096) as (out_key, out_handle):
            shm.set_shared_memory_region(handle, list(query.values()))
            client.register_system_shared_memory("rest-query", key, _nbytes(query))
            client.register_system_shared_memory("rest-scores", out_key, 4096, offset=0)
            assert {r["name"] for r in client.get_system_shared_memory_status()} == {"rest-query", "rest-scores"}
            out = th.InferRequestedOutput("scores")
            out.set_shared_memory("rest-scores", 1024, offset=512)
            result = client.infer("rm2", _inputs(th, query, "rest-query"), outputs=[out])
            assert result.get_output("scores")["parameters"]["shared_memory_offset"] == 512
            got = shm.get_contents_as_numpy(out_handle, np.float32, [1024])[128:128 + 37].reshape(37, 1)
            np.testing.assert_array_equal(got, wire)
            with pytest.raises(InferenceServerException, match="input 'dense_features': no shared memory region 'gone'"):
                client.infer("rm2", _inputs(th, query, "gone"))
            client.unregister_system_shared_memory("rest-query")
            assert [r["name"] for r in client.get_system_shared_memory_status()] == ["rest-scores"]
            client.unregister_system_shared_memory()
            assert client.get_system_shared_memory_status() == []
    finally:
        client.close()
        client.close = lambda: None  # NOTE: its __del__ would close it again, on whatever thread collects it


def test_rest_registration_errors_name_the_field(served_rm2):
    import http.client
    import json

    host, port = served_rm2.http_url.rsplit(":", 1)
    for body, status, words in [({"offset": 0, "byte_size": 8}, 400, "'key' must be a string"),
                                ({"key": "/sixfold-test-none", "byte_size": 8}, 400, "does not exist"),
                                ({"key": "/x/y", "byte_size": 8}, 400, "must name a POSIX"),
                                ({"key": "/sixfold-test-none", "byte_size": "8"}, 400, "byte_size must be")]:
        connection = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            connection.request("POST", "/v2/systemsharedmemory/region/r/register", json.dumps(body))
            response = connection.getresponse()
            text = response.read().decode()
        finally:
            connection.close()
        assert response.status == status and words in text, (body, response.status, text)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("GET", "/v2/systemsharedmemory/region/r/status")
        response = connection.getresponse()
        assert response.status == 400 and "no shared memory region 'r'" in response.read().decode()
    finally:
        connection.close()


def test_grpc_status_code_of_unknown_region_is_invalid_argument(grpc_client, query):
    with pytest.raises(InferenceServerException) as info:
        grpc_client.infer("rm2", _inputs(tc, query, "never"))
    assert info.value.status() == f"StatusCode.{grpc.StatusCode.INVALID_ARGUMENT.name}"


# --- sixfold-loadgen --client shm -----------------------------------------------------------------

async def test_loadgen_shm_client_serves_a_run_from_segments_and_leaves_none_behind(served_rm2):
    from sixfold.loadgen import LoadConfig, run_load_async

    before = {p.name for p in SHM_ROOT.glob("sixfold-loadgen-*")}
    config = LoadConfig(url=served_rm2.url, model="rm2", qps=20.0, duration_s=1.5, query_size="mlperf",
                        wait_ready_s=10.0, drain_timeout_s=10.0, pool=6, client="shm", arrival="constant")
    report = await run_load_async(config)
    assert report.requests["sent"] == report.requests["ok"] == 30, report.errors_by_reason
    assert {p.name for p in SHM_ROOT.glob("sixfold-loadgen-*")} == before  # unlinked
    with contextlib.closing(tc.InferenceServerClient(served_rm2.url)) as client:
        assert client.get_system_shared_memory_status(as_json=True).get("regions", {}) == {}  # unregistered


def _non_loopback_address() -> str | None:
    """An IPv4 address of this host that is not loopback, for a client that is 'remote' to the server."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") or address == "0.0.0.0" else address


@pytest.mark.parametrize("peer, local", [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True),
                                         (None, True), ("unix:/run/s.sock", True), ("10.1.2.3", False),
                                         ("2001:db8::1", False)])
def test_only_peers_on_this_host_may_register(peer, local):
    from sixfold.server.protocol.shared_memory import NotLocal, check_local_peer, grpc_peer_host

    if local:
        check_local_peer(peer)
    else:
        with pytest.raises(NotLocal, match=f"registration from {peer} is refused"):
            check_local_peer(peer)
    assert grpc_peer_host("ipv4:10.1.2.3:5000") == "10.1.2.3"
    assert grpc_peer_host("ipv6:[::1]:5000") == "::1"


def test_a_registration_from_another_address_is_refused_over_grpc_and_rest(tmp_path):
    """The server binds every address; a client reaching it through a non-loopback one is not local."""
    address = _non_loopback_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    served = load_builtin("tiny", max_rows=None, seed=0, cards=1, backend="simcard", card_spec="m2-card",
                          metrics=ServerMetrics(), batching=BatchingConfig())
    config = ServerConfig(host="0.0.0.0", grpc_port=0, http_port=0, metrics_port=None, warmup=False)
    background = BackgroundServer(InferenceCore([served]), config, ServerMetrics()).start()
    grpc_port, http_port = background.url.rsplit(":", 1)[1], background.http_url.rsplit(":", 1)[1]
    try:
        with segment(64) as (key, _):
            with contextlib.closing(tc.InferenceServerClient(f"{address}:{grpc_port}")) as remote:
                with pytest.raises(InferenceServerException, match="is for clients on this host") as info:
                    remote.register_system_shared_memory("r", key, 64)
                assert info.value.status() == "StatusCode.PERMISSION_DENIED"
            rest = th.InferenceServerClient(f"{address}:{http_port}", network_timeout=30.0)
            try:
                with pytest.raises(InferenceServerException, match=r"\[403\].*is for clients on this host"):
                    rest.register_system_shared_memory("r", key, 64)
            finally:
                rest.close()
                rest.close = lambda: None
            with contextlib.closing(tc.InferenceServerClient(f"127.0.0.1:{grpc_port}")) as local:
                local.register_system_shared_memory("r", key, 64)  # the same server, over loopback
                assert [r["name"] for r in local.get_system_shared_memory_status(as_json=True)["regions"].values()] == ["r"]
                local.unregister_system_shared_memory()
    finally:
        background.stop()
