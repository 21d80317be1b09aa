"""The request path's own stages, one at a time: microseconds each for one small request.

``bench/serving_path.py`` gives the event loop's CPU per request for the whole path; this says which
stage of it costs what, so a change to one stage can be judged on its own (issue 35). Each stage is the
real function on a real request: a ModelInferRequest built as tritonclient builds it (``--items``
items of ``--model``), the model loaded as ``sixfold-serve`` loads it (simulated cards). Stages:

  parse      ``parse_model_infer`` (the ModelInfer deserializer: protobuf for small messages)
  decode     ``decode_inputs`` (protobuf tensors -> numpy views)
  params     ``request_timeout``, ``request_priority``, ``requested_outputs`` (the request's parameters)
  validate   ``validate_request`` (names, dtypes, shapes, lengths, ids against the tables)
  encode     ``encode_response`` (outputs -> ModelInferResponse)
  serialize  ``SerializeToString`` of that response (what grpc does with it)
  stats      ``ModelStats.record_success`` and the Prometheus ``record_success`` of one request

With ``--workers N`` a request also crosses from its front end to the engine and back
(``sixfold.server.workers.engine_channel``): ``hop`` is that crossing's CPU per request, both ends in
this process on one uvloop loop over a real Unix socket and real arenas, ``--hop-concurrency``
requests in flight for ``--hop-seconds`` (0: left out), the engine's model replaced by one that answers
zeros at once so the figure is the channel's own. It is printed apart from the stages' total. Across
two processes each crossing also wakes the other process; that cost is not in this figure.

``--batch-rows N`` (0: left out) also times ``batch``: ``PlanRuntime.run`` on one batch of N such requests
(the host stage, then the dense part where the host-dense tuner sends it, exploring batches included), CPU
per batch over ``--batch-seconds``, after a second of warm-up that lets the tuner settle. It is the part of
a request's cost a batch shares, printed apart too.

Each figure is the fastest of ``--repeat`` timings of ``--number`` calls (the least disturbed one: on a
shared host the others are the host's noise, not the code's). The batcher, the stages of a batch and
gRPC itself are not here: they are shared by a batch or are not Python, and ``serving_path.py`` and
``serving_overhead.py`` (CPU per request) measure them.

    .venv/bin/python bench/request_path_stages.py
    .venv/bin/python bench/request_path_stages.py --items 16 --number 20000
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class _NoDeadline:
    """What ``request_timeout`` reads of a grpc.aio ServicerContext: no deadline set."""

    def time_remaining(self) -> None:
        return None


def stages(model: str, items: int) -> dict[str, Callable[[], object]]:
    """Each stage as a call on one real request of ``items`` items to ``model``, by name."""
    from bench.serving_path import _requests
    from sixfold.server.loading.loader import load_builtin
    from sixfold.server.model.validation import validate_request
    from sixfold.server.observability.metrics import ServerMetrics
    from sixfold.server.protocol.codec import (decode_inputs, encode_response, request_priority, request_timeout,
                                               requested_outputs)
    from sixfold.server.protocol.infer_request import parse_model_infer
    from sixfold.server.scheduling.batcher import BatchingConfig

    served = load_builtin(model, max_rows=None, seed=0, cards=6, backend="simcard", card_spec="m2-card",
                          metrics=ServerMetrics(), batching=BatchingConfig())
    request = _requests(model, items)[0]
    wire = request.SerializeToString()
    inputs = decode_inputs(request)
    rows = validate_request(inputs, served.input_specs, served.table_rows)
    outputs = {t.name: _zeros(t, rows) for t in served.plan.outputs}  # the model's outputs, as it answers
    response = encode_response(served.name, served.version, "bench", outputs)
    context = _NoDeadline()

    def params() -> None:
        request_timeout(request, context)
        request_priority(request)
        requested_outputs(request)

    def stats() -> None:
        served.stats.record_success(1e-3, 1e-4, 1e-4, 1e-4, 1e-4, rows)
        served._metrics.record_success(rows, 1e-3, 1e-4, 1e-4, 1e-4)

    return {
        "parse": lambda: parse_model_infer(wire),
        "decode": lambda: decode_inputs(request),
        "params": params,
        "validate": lambda: validate_request(inputs, served.input_specs, served.table_rows),
        "encode": lambda: encode_response(served.name, served.version, "bench", outputs),
        "serialize": response.SerializeToString,
        "stats": stats,
    }


def _zeros(tensor, rows: int):
    import numpy as np

    from sixfold.server.protocol.codec import DTYPES

    return np.zeros((rows, *tensor.shape[1:]), DTYPES[tensor.datatype])


class _ZerosModel:
    """What the engine serves in the hop: ``scores`` of zeros, answered at once (no batcher, no model)."""

    name, version = "zeros", "1"

    async def infer(self, inputs, requested, timeout_s, priority):
        import numpy as np

        return {"scores": np.zeros((next(iter(inputs.values())).shape[0], 1), np.float32)}


class _ZerosCore:
    def serving(self, name: str, version: str = "") -> _ZerosModel:
        return _ZerosModel()


async def _hop(model: str, items: int, seconds: float, concurrency: int) -> tuple[float, int]:
    import tempfile
    import time

    from bench.serving_path import _requests
    from sixfold.server.protocol.codec import decode_inputs
    from sixfold.server.workers.engine_channel import EngineChannel, EngineClient

    inputs = decode_inputs(_requests(model, items)[0])
    with tempfile.TemporaryDirectory(prefix="sixfold-hop-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        channel = EngineChannel(_ZerosCore(), Path(d))
        await channel.start()
        client = EngineClient(Path(d), 0, 64 << 20, 64 << 20)
        try:
            await client.connect()
            for _ in range(100):  # warm
                await client.infer("zeros", "", inputs, ["scores"], None, 0)
            count = 0
            stop = time.monotonic() + seconds

            async def sender() -> None:
                nonlocal count
                while time.monotonic() < stop:
                    await client.infer("zeros", "", inputs, ["scores"], None, 0)
                    count += 1

            cpu = time.process_time()
            await asyncio.gather(*(sender() for _ in range(concurrency)))
            return (time.process_time() - cpu) / max(count, 1) * 1e6, count
        finally:
            await client.close()
            await channel.close()


def hop_us(model: str, items: int, seconds: float, concurrency: int) -> tuple[float, int]:
    """CPU microseconds per request of the front end -> engine -> front end crossing, and the requests timed."""
    try:
        import uvloop
        return uvloop.run(_hop(model, items, seconds, concurrency))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_hop(model, items, seconds, concurrency))


async def _batches(model: str, items: int, rows: int, seconds: float) -> tuple[float, int]:
    import time

    import numpy as np

    from bench.serving_path import _requests
    from sixfold.server.execution.runtime import single_threaded_ops_here
    from sixfold.server.loading.loader import load_builtin
    from sixfold.server.observability.metrics import ServerMetrics
    from sixfold.server.protocol.codec import decode_inputs
    from sixfold.server.scheduling.batcher import BatchInfo, BatchingConfig

    single_threaded_ops_here()  # as sixfold-serve's event loop does (small stages run inline on it)
    served = load_builtin(model, max_rows=None, seed=0, cards=6, backend="simcard", card_spec="m2-card",
                          metrics=ServerMetrics(), batching=BatchingConfig())
    try:
        requests = [decode_inputs(r) for r in _requests(model, items)]
        chosen = [requests[i % len(requests)] for i in range(rows)]
        batch = {name: np.concatenate([r[name] for r in chosen]) for name in chosen[0]}
        total = rows * items
        warm_until = time.monotonic() + 1.0
        while time.monotonic() < warm_until:
            await served.runtime.run(batch, BatchInfo(rows=total, requests=rows))
        count, stop = 0, time.monotonic() + seconds
        cpu = time.process_time()
        while time.monotonic() < stop:
            await served.runtime.run(batch, BatchInfo(rows=total, requests=rows))
            count += 1
        return (time.process_time() - cpu) / max(count, 1) * 1e6, count
    finally:
        served.runtime.close()


def batch_us(model: str, items: int, rows: int, seconds: float) -> tuple[float, int]:
    """CPU microseconds (every thread's) per ``PlanRuntime.run`` of a batch of ``rows`` requests, and the batches timed."""
    try:
        import uvloop
        return uvloop.run(_batches(model, items, rows, seconds))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(_batches(model, items, rows, seconds))


def measure(calls: dict[str, Callable[[], object]], number: int, repeat: int) -> dict[str, float]:
    """Microseconds per call of each stage: the fastest of ``repeat`` timings of ``number`` calls."""
    return {name: min(timeit.repeat(call, number=number, repeat=repeat)) / number * 1e6
            for name, call in calls.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="built-in model (default tiny)")
    parser.add_argument("--items", type=int, default=1, help="items per request (default 1)")
    parser.add_argument("--number", type=int, default=50000, help="calls per timing (default 50000)")
    parser.add_argument("--repeat", type=int, default=5, help="timings per stage; the fastest counts (default 5)")
    parser.add_argument("--hop-seconds", type=float, default=1.0,
                        help="how long to time the front end -> engine hop of --workers N (default 1; 0: left out)")
    parser.add_argument("--hop-concurrency", type=int, default=16, help="hop requests in flight (default 16)")
    parser.add_argument("--batch-rows", type=int, default=3,
                        help="requests in the batch timed through PlanRuntime.run (default 3; 0: left out)")
    parser.add_argument("--batch-seconds", type=float, default=1.0, help="how long to time it (default 1)")
    parser.add_argument("--no-write", action="store_true", help="accepted for bench/run_all.py; this bench only prints")
    args = parser.parse_args(argv)
    if args.items < 1 or args.number < 1 or args.repeat < 1 or args.hop_concurrency < 1:
        parser.error("--items, --number, --repeat and --hop-concurrency must be at least 1")
    if args.batch_rows < 0 or not 0 < args.batch_seconds <= 60:
        parser.error(f"--batch-rows must be at least 0 and --batch-seconds within (0, 60], got {args.batch_rows} "
                     f"and {args.batch_seconds:g}")
    if not 0 <= args.hop_seconds <= 60:
        parser.error(f"--hop-seconds must be within 0..60, got {args.hop_seconds:g}")
    figures = measure(stages(args.model, args.items), args.number, args.repeat)
    print(f"request path stages ({args.model}, {args.items} item(s)/request; fastest of {args.repeat} x "
          f"{args.number} calls), us per request:")
    for name, us in figures.items():
        print(f"  {name:10s} {us:7.2f}")
    print(f"  {'total':10s} {sum(figures.values()):7.2f}")
    if args.batch_rows:
        us, count = batch_us(args.model, args.items, args.batch_rows, args.batch_seconds)
        print(f"batch of {args.batch_rows} request(s) through PlanRuntime.run (host stage + dense; CPU of every "
              f"thread, {count} batches): {us:.2f} us per batch, {us / args.batch_rows:.2f} us per request")
    if args.hop_seconds:
        us, count = hop_us(args.model, args.items, args.hop_seconds, args.hop_concurrency)
        print(f"front end -> engine hop (--workers N; CPU of both ends, {count} requests, {args.hop_concurrency} "
              f"in flight): {us:.2f} us per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
