"""ModelInfer admitted before its message is read: a stream-unary handler over the unary wire call.

grpc.aio reads a unary request whole before the handler runs, so a flood of large queries was
buffered before any admission could refuse it. Served as stream-unary (the same bytes on the wire;
stock tritonclient and perf_analyzer cannot tell), the handler runs first: it reserves room in the
server's ReceiveBudget, refuses RESOURCE_EXHAUSTED at once when there is none, and only then reads
the message, within the body timeout. With BDP probing off (``limits.grpc_options``) gRPC holds at
most a stream window (64 KiB) of a message nobody has asked for.
"""

from __future__ import annotations

from typing import Any

import grpc

from sixfold.server.protocol.infer_request import parse_model_infer
from sixfold.server.transport.deadline import within
from sixfold.server.transport.receive_budget import ReceiveBudget

__all__ = ["sized_model_infer", "bounded_model_infer"]

_WAIT_FOR_READS_S = 0.25
"""How long a request waits for other reads to settle before it is refused: an 8.6 MB read takes ~16 ms
on loopback, so a wait longer than this means the server is behind, and waiting more only adds latency."""


def sized_model_infer(data: bytes) -> tuple:
    """The ModelInfer deserializer that also says the message's size: ``(request, size)``.

    Read with ``context.read()``, which keeps nothing: grpc's request iterator (an async generator) kept
    the last message it yielded until it was garbage-collected, long after the call (measured: 1.4 GB of
    8.6 MB queries alive after an overload, with no request in flight).
    """
    return parse_model_infer(data), len(data)


def bounded_model_infer(servicer: Any, budget: ReceiveBudget, body_timeout_s: float, metrics: Any = None):
    """An ``async (request_iterator, context)`` handler: reserve, read (deserialized by ``sized_model_infer``),
    answer with ``servicer.ModelInfer``, release."""

    async def model_infer(request_iterator, context: grpc.aio.ServicerContext):
        # NOTE: the one message is read with context.read(), not the iterator: grpc's iterator is an async
        # generator over that same read, a coroutine and a generator frame more for every request.
        refusal = budget.unread_refusal and budget.unread_refusal(context.time_remaining())
        if refusal:  # every model would refuse it: refused unread, costing no read and no decode
            if metrics is not None:
                metrics.record_refused("grpc", "overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        if not await budget.start_read(_WAIT_FOR_READS_S):
            if metrics is not None:
                metrics.record_refused("grpc", "receive_budget")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server holds {budget.held >> 20} MiB of requests in flight, its limit is "
                                f"{budget.limit >> 20} MiB (--max-queue-bytes-mb); retry later")
        try:
            message = await within(context.read(), body_timeout_s)
            if message is grpc.aio.EOF:
                raise StopAsyncIteration
            request, size = message
        except TimeoutError:
            budget.end_read(None)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the request message did not arrive within {body_timeout_s:g} s (--body-timeout-s)")
        except StopAsyncIteration:
            budget.end_read(None)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ModelInfer carried no request message")
        except BaseException:  # cancelled, or a message gRPC could not read: nothing is held
            budget.end_read(None)
            raise
        budget.end_read(size)
        try:
            return await servicer.ModelInfer(request, context)
        finally:
            budget.release(size)
    return model_infer
