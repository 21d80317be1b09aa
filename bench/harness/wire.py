"""Single queries on the wire to any KServe v2 gRPC server, outside loadgen's timed runs: are its answers
right (against a reference model's), how long does one query take alone, and in which input order.

A KServe v2 server takes inputs by name, but not every server ignores their order (see
``bench/latency_bounded.py``'s docstring: MLServer's adaptive batching needs ``sparse_indices`` first),
so every function here takes the order the server is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np

from sixfold.loadgen.batch_dim import with_batch_dim
from sixfold.loadgen.transport import DATATYPES, SharedMemoryTransport, wire_tensors

__all__ = ["DENSE_LAST", "GRPC_OPTIONS", "USUAL_ORDER", "check_answers", "encode", "idle_latency",
           "inputs_in_order"]

USUAL_ORDER = ("dense_features", "sparse_lengths", "sparse_indices")  # loadgen's (RequestGenerator.make)
DENSE_LAST = ("sparse_indices", "sparse_lengths", "dense_features")  # the one MLServer's batching answers
GRPC_OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


@contextlib.contextmanager
def inputs_in_order(order: tuple[str, ...]) -> Iterator[None]:
    """loadgen's transports encode a query's inputs in this order (see the module docstring)."""
    import sixfold.loadgen.runner as runner

    original = runner.make_transport

    def make_transport(*args: Any, **kwargs: Any) -> Any:
        transport = original(*args, **kwargs)
        prepare = transport.prepare
        transport.prepare = lambda request: prepare({n: request[n] for n in order if n in request})
        return transport

    runner.make_transport = make_transport
    try:
        yield
    finally:
        runner.make_transport = original


def encode(model: str, request: Mapping[str, np.ndarray], order: tuple[str, ...], ids_dtype: str = "int64",
           batch_dim: bool = False) -> bytes:
    """A serialized ``ModelInferRequest``: ``request``'s tensors as raw contents, in ``order``; ``batch_dim``:
    each with a leading batch dimension of 1 (``sixfold.loadgen.batch_dim``)."""
    from tritonclient.grpc import service_pb2

    request = wire_tensors(request, ids_dtype)
    if batch_dim:
        request = with_batch_dim(request)
    message = service_pb2.ModelInferRequest(model_name=model)
    for name in order:
        array = request[name]
        message.inputs.add(name=name, datatype=DATATYPES[array.dtype], shape=list(array.shape))
        message.raw_input_contents.append(np.ascontiguousarray(array).tobytes())
    message.outputs.add(name="scores")
    return message.SerializeToString()


def _scores(answer: Any) -> np.ndarray:
    if answer.raw_output_contents:
        return np.frombuffer(answer.raw_output_contents[0], dtype=np.float32)
    return np.asarray(answer.outputs[0].contents.fp32_contents, dtype=np.float32)


async def check_answers(url: str, model: str, queries: list[dict[str, np.ndarray]], expected: list[np.ndarray],
                        order: tuple[str, ...], ids_dtype: str = "int64", tolerance: float = 1e-3,
                        batch_dim: bool = False) -> dict[str, Any]:
    """Send ``queries`` at once (so a batching server batches them); compare scores with ``expected``
    (ok: every score within ``tolerance``)."""
    import grpc
    from tritonclient.grpc import service_pb2

    async with grpc.aio.insecure_channel(url, options=GRPC_OPTIONS) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                                   response_deserializer=service_pb2.ModelInferResponse.FromString)
        answers = await asyncio.gather(*(call(encode(model, q, order, ids_dtype, batch_dim), timeout=120) for q in queries),
                                       return_exceptions=True)
    worst, errors = 0.0, []
    for answer, want in zip(answers, expected):
        if isinstance(answer, BaseException):
            details = answer.details() if isinstance(answer, grpc.aio.AioRpcError) else str(answer)
            errors.append(" ".join((details or type(answer).__name__).split())[:160])
            continue
        got = _scores(answer)
        if got.size != want.size:
            errors.append(f"{got.size} scores for {want.size} items")
            continue
        worst = max(worst, float(np.max(np.abs(got - want.reshape(-1)))))
    return {"ok": not errors and worst <= tolerance, "max_abs_diff": worst, "errors": errors[:3]}


async def idle_latency(url: str, model: str, gen: Any, order: tuple[str, ...], sizes: tuple[int, ...], repeats: int,
                       *, client: str = "raw", ids_dtype: str = "int64", batch_dim: bool = False
                       ) -> tuple[dict[int, float], dict[int, float]]:
    """Median and min ms of one query at a time, per size (after one untimed query of that size), queries
    from ``gen`` (a ``models.RequestGenerator``); ``client="shm"`` sends each query by shared memory
    region (loadgen's SharedMemoryTransport)."""
    import grpc

    async def timed(send: Any, prepare: Any) -> tuple[dict[int, float], dict[int, float]]:
        out, fastest = {}, {}
        for n in sizes:
            payload = prepare(n)
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                await send(payload, n)
                times.append(time.perf_counter() - t0)
            out[n] = round(statistics.median(times[1:]) * 1e3, 1)
            fastest[n] = round(min(times[1:]) * 1e3, 1)
        return out, fastest

    if client == "shm":
        transport = SharedMemoryTransport(url, model, ids_dtype=ids_dtype)

        def by_region(n: int) -> bytes:
            query = gen.make(n)
            return transport.prepare({k: query[k] for k in order})

        try:
            return await timed(transport.infer, by_region)
        finally:
            await transport.close()
    async with grpc.aio.insecure_channel(url, options=GRPC_OPTIONS) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                                   response_deserializer=None)
        return await timed(lambda payload, n: call(payload, timeout=60),
                           lambda n: encode(model, gen.make(n), order, ids_dtype, batch_dim))
