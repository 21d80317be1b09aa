"""``--batch-dim``: requests with a leading batch dimension of 1, for a Triton model whose dynamic batcher
batches whole requests; end to end against the real Triton of ``make triton-venv`` where it is installed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from tritonclient.grpc import model_config_pb2, service_pb2

from sixfold import models
from sixfold.loadgen import LoadConfig, LoadgenError, ShapeOverrides, run_load_async, shape_from
from sixfold.loadgen.batch_dim import BatchDimTransport, with_batch_dim
from sixfold.loadgen.transport import RawGrpcTransport
from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
TRITON_PYTHON = ROOT / ".venv-triton" / "bin" / "python"
T = service_pb2.ModelMetadataResponse.TensorMetadata


def _batched_metadata() -> service_pb2.ModelMetadataResponse:
    """What Triton publishes for a model with max_batch_size > 0 and inputs of dims [-1, 13] etc."""
    return service_pb2.ModelMetadataResponse(name="m", inputs=[
        T(name="dense_features", datatype="FP32", shape=[-1, -1, 13]),
        T(name="sparse_lengths", datatype="INT32", shape=[-1, -1, 4]),
        T(name="sparse_indices", datatype="INT64", shape=[-1, -1])])


def _config() -> model_config_pb2.ModelConfig:
    c = model_config_pb2.ModelConfig(name="m")
    c.parameters["sixfold.table_rows"].string_value = "10,20,30,40"
    return c


def test_shapes_are_read_past_the_batch_dimension_and_its_absence_is_named():
    shape = shape_from(_batched_metadata(), _config(), ShapeOverrides(batch_dim=True))
    assert (shape.dense_dim, shape.num_tables) == (13, 4)
    with pytest.raises(LoadgenError, match="pass --batch-dim"):
        shape_from(_batched_metadata(), _config())


async def test_each_input_goes_as_one_batch_element():
    query = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=500), seed=3).make(5)
    transport = BatchDimTransport(RawGrpcTransport("127.0.0.1:1", "rm1"))
    sent = service_pb2.ModelInferRequest.FromString(transport.prepare(query))
    await transport.close()
    assert [list(t.shape) for t in sent.inputs] == [[1, *a.shape] for a in query.values()]
    assert sent.raw_input_contents[2] == query["sparse_indices"].tobytes()  # the same bytes, one more dimension
    assert all(with_batch_dim(query)[k].base is not None for k in query)  # views, no copies


def test_the_cli_flag_reaches_the_config():
    from sixfold.loadgen.cli import _config as config_of, build_parser

    argv = ["--url", "127.0.0.1:1", "--model", "rm2", "--qps", "5", "--duration", "1", "--report", "r.json"]
    assert config_of(build_parser().parse_args([*argv, "--batch-dim"])).batch_dim
    assert not config_of(build_parser().parse_args(argv)).batch_dim


@pytest.mark.skipif(not TRITON_PYTHON.exists(), reason="NVIDIA Triton is not installed here (make triton-venv)")
def test_triton_dynamic_batching_serves_loadgen_batch_dim_requests_with_the_models_scores():
    port = free_port()
    proc = subprocess.Popen([str(TRITON_PYTHON), str(ROOT / "bench" / "triton_peer" / "serve.py"), "--model", "rm1",
                             "--max-rows", "500", "--grpc-port", str(port), "--http-port", str(free_port()),
                             "--metrics-port", str(free_port()), "--dynamic-batching", "--ready-timeout", "120"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines = []
        for line in proc.stdout:  # bounded: serve.py exits after --ready-timeout
            lines.append(line)
            if line.startswith("READY grpc="):
                break
        assert proc.poll() is None, "".join(lines[-20:])
        report = asyncio.run(run_load_async(LoadConfig(url=f"127.0.0.1:{port}", model="rm1", qps=0, duration_s=2.0,
                                                       concurrency=8, query_size="uniform:1-50", batch_dim=True,
                                                       max_requests=400)))
        assert report.requests["ok"] > 0 and report.requests.get("errors", 0) == 0, report.requests
        # The scores are the model's own, whoever the request was batched with.
        from bench.harness.wire import USUAL_ORDER, check_answers

        gen = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=500), seed=5)
        queries = [gen.make(n) for n in (1, 3, 7, 64)]
        model = models.build("rm1", max_rows=500, seed=0)
        with torch.inference_mode():
            expected = [model(*(torch.from_numpy(q[k]) for k in USUAL_ORDER)).numpy() for q in queries]
        answers = asyncio.run(check_answers(f"127.0.0.1:{port}", "rm1", queries, expected, USUAL_ORDER,
                                            tolerance=1e-5, batch_dim=True))
        assert answers["ok"], answers
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
