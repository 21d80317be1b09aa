"""The ideal server's policy on the real machine: one query at a time, in arrival order, offline torch.

``sixfold.loadgen.ideal`` *simulates* the ideal FIFO server that ``bench/latency_bounded.py`` divides by:
every query at the offline model's best items/s, one after another, no overhead, on a machine that
never hiccups. This file *runs* that policy for real, so the gap between the simulation and
sixfold can be split into what the machine costs any server (transport, the client on the same
cores, the VM's jitter, a 270-item query being slower per item than the best batch) and what
sixfold's scheduling costs:

- the zoo model, unpartitioned, in eager torch on all cores under ``torch.inference_mode()``: the
  offline model of the latency bench, same weights (same seed), same answers;
- a bare grpc.aio server (uvloop) with only the KServe v2 calls loadgen makes (ServerLive/Ready,
  ModelReady, ModelMetadata, ModelInfer); ModelInfer's request is parsed by sixfold's own
  deserializer (``sixfold.server.protocol.infer_request.parse_model_infer``: raw tensors as views, no copy), so this
  server pays no more to decode a 10 MB query than sixfold does;
- one worker thread runs the queries: a ``ThreadPoolExecutor(max_workers=1)`` takes them in the
  order they arrive, so each one runs alone and none overtakes another. No batching, no
  validation beyond what torch itself refuses.
- ``--dense-precision int8``: the MLPs' ``nn.Linear`` layers dynamically quantized
  (``torch.ao.quantization.quantize_dynamic``: int8 weights, inputs quantized per batch), the
  policy's counterpart of ``sixfold-serve --dense-precision int8``.

    .venv/bin/python bench/fifo_server.py --model dlrm-mlperf --max-rows 50000 --port 0

It prints ``READY grpc=HOST:PORT`` once it serves, and stops on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from sixfold import models  # noqa: E402
from bench.harness.bench_server import serve_until_signalled  # noqa: E402
from sixfold.models.signature import SCORES, Signature, signature_for  # noqa: E402
from sixfold.server.protocol.codec import DTYPES  # noqa: E402


def _servicer(model_name: str, signature: Signature, forward: Any, executor: ThreadPoolExecutor) -> Any:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    inputs = [spec.name for spec in signature.inputs]  # the zoo model's forward() arguments, in order
    metadata = pb.ModelMetadataResponse(name=model_name, versions=["1"], platform="pytorch_eager")
    for spec in signature.inputs:
        metadata.inputs.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
    for spec in signature.outputs:
        metadata.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))

    class FifoServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=request.name == model_name)

        async def ModelMetadata(self, request, context):
            if request.name != model_name:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.name!r}")
            return metadata

        async def ModelInfer(self, request, context):
            if request.model_name != model_name:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown model {request.model_name!r}")
            raw = request.raw_input_contents
            if len(raw) != len(request.inputs):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "send every input as raw_input_contents")
            tensors = {}
            for tensor, data in zip(request.inputs, raw):
                dtype = DTYPES.get(tensor.datatype)
                if dtype is None:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"input '{tensor.name}': datatype {tensor.datatype} not served here")
                tensors[tensor.name] = np.frombuffer(data, dtype).reshape(list(tensor.shape))
            missing = [n for n in inputs if n not in tensors]
            if missing:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"missing inputs {missing}")
            try:
                scores = await asyncio.get_running_loop().run_in_executor(
                    executor, forward, [tensors[n] for n in inputs])
            except (RuntimeError, ValueError, IndexError) as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the model refused the query: {exc}")
            response = pb.ModelInferResponse(model_name=model_name, model_version="1", id=request.id)
            response.outputs.add(name=SCORES, datatype="FP32", shape=list(scores.shape))
            response.raw_output_contents.append(scores.tobytes())
            return response

    return FifoServicer()


def _forward(model: Any) -> Any:
    """One query through the model, in the worker thread (inference mode is per thread)."""
    import torch

    def forward(tensors: list[np.ndarray]) -> np.ndarray:
        with torch.inference_mode():
            # from_numpy over the message's read-only bytes: torch warns (silenced in main), the model only reads
            return model(*[torch.from_numpy(t) for t in tensors]).numpy()

    return forward


def build_model(model_name: str, max_rows: int | None, seed: int, dense_precision: str = "fp32") -> Any:
    """The zoo model as the offline bench builds it, its Linear layers int8 when asked."""
    import torch

    model = models.build(model_name, max_rows=max_rows, seed=seed).eval()
    if dense_precision == "int8":
        model = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    return model


async def serve(model_name: str, max_rows: int | None, seed: int, host: str, port: int, threads: int,
                dense_precision: str = "fp32") -> None:
    import grpc
    import torch
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    from sixfold.server.protocol.infer_request import parse_model_infer

    torch.set_num_threads(threads)
    cfg = models.get_config(model_name, max_rows=max_rows)
    forward = _forward(build_model(model_name, max_rows, seed, dense_precision))
    signature = signature_for(cfg.dense_dim, cfg.num_tables)
    warm = models.RequestGenerator.for_config(cfg, seed=1).make(64)
    forward([warm[spec.name] for spec in signature.inputs])  # first-call allocations
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fifo")
    options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30),
               ("grpc.so_reuseport", 0)]
    server = grpc.aio.server(options=options)
    servicer = _servicer(model_name, signature, forward, executor)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference.GRPCInferenceService", {
        "ModelInfer": grpc.unary_unary_rpc_method_handler(
            servicer.ModelInfer, request_deserializer=parse_model_infer,
            response_serializer=service_pb2.ModelInferResponse.SerializeToString)}),))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await serve_until_signalled(server, f"{host}:{bound}")
    executor.shutdown(wait=True, cancel_futures=True)


def main(argv: list[str] | None = None) -> int:
    import warnings

    import uvloop

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dlrm-mlperf", help="zoo model (default dlrm-mlperf)")
    p.add_argument("--max-rows", type=int, default=50_000, help="rows per table at most (default 50000)")
    p.add_argument("--seed", type=int, default=0, help="weights' seed (default 0: the latency bench's offline model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (default 0: a free one, printed)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch intra-op threads (default: all cores, as the offline model)")
    p.add_argument("--dense-precision", choices=("fp32", "int8"), default="fp32",
                   help="the MLPs' precision (default fp32; int8: torch dynamic quantization of every Linear)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    uvloop.run(serve(args.model, args.max_rows, args.seed, args.host, args.port, args.threads,
                     args.dense_precision))
    return 0


if __name__ == "__main__":
    sys.exit(main())
