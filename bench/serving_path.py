"""sixfold's own serving path, without gRPC: event-loop CPU per request (the quiet yardstick).

``bench/serving_overhead.py`` runs real servers under perf_analyzer, and on a shared 2-core VM its
figures move 10-30% between runs. This one calls ``InferenceServicer.ModelInfer`` in-process from
``--concurrency`` coroutines on uvloop, with protobuf requests built as tritonclient would, and
reports the loop's CPU time per request over ``--requests`` requests: decode, validate, queue,
batch, host stage, host-dense MLP, statistics and encode, everything sixfold adds to grpc.aio's own
cost. It moves ~2% between runs, so it tells whether a change to that path helped before the
perf_analyzer bench is worth running. ``--max-batch-rows`` fixes the batch size (batches leave
full, no window): 8 matches what perf_analyzer's 16 clients make of the 2 ms window in situ.

    .venv/bin/python bench/serving_path.py                      # tiny, 1 item, batches of 8
    .venv/bin/python bench/serving_path.py --items 16 --reps 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


class _Context:
    """What ModelInfer reads of a grpc.aio ServicerContext: no deadline, no metadata."""

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: object, message: str) -> None:
        raise RuntimeError(f"{code}: {message}")


def _requests(model: str, items: int, count: int = 8) -> list:
    """``count`` seeded queries as ModelInferRequests with raw contents (tritonclient's encoding)."""
    from tritonclient.grpc import service_pb2

    from sixfold import models
    from sixfold.server.protocol.codec import datatype_of

    gen = models.RequestGenerator.for_config(models.get_config(model), seed=items)
    out = []
    for _ in range(count):
        arrays = gen.make(items)
        request = service_pb2.ModelInferRequest(model_name=model, id="bench")
        for name, array in arrays.items():
            request.inputs.add(name=name, datatype=datatype_of(array), shape=list(array.shape))
            request.raw_input_contents.append(array.tobytes())
        out.append(service_pb2.ModelInferRequest.FromString(request.SerializeToString()))
    return out


async def measure(model: str, items: int, concurrency: int, requests: int, reps: int, max_batch_rows: int) -> list[float]:
    """Loop CPU microseconds per request, one figure per repetition (after one warm-up pass)."""
    from sixfold.server.scheduling.batcher import BatchingConfig
    from sixfold.server.core import InferenceCore
    from sixfold.server.loading.loader import load_builtin
    from sixfold.server.observability.metrics import ServerMetrics
    from sixfold.server.execution.runtime import single_threaded_ops_here
    from sixfold.server.transport.grpc_servicer import InferenceServicer

    single_threaded_ops_here()  # as SixfoldServer.start does
    served = load_builtin(model, max_rows=None, seed=0, cards=6, backend="simcard", card_spec="m2-card",
                          metrics=ServerMetrics(), batching=BatchingConfig(max_batch_rows=max_batch_rows * items))
    core = InferenceCore([served])
    servicer, context, pool = InferenceServicer(core), _Context(), _requests(model, items)

    async def client(k: int, count: int) -> None:
        for i in range(count):
            await servicer.ModelInfer(pool[(k + i) % len(pool)], context)

    async def run(total: int) -> None:
        await asyncio.gather(*(client(k, total // concurrency) for k in range(concurrency)))

    try:
        await run(min(requests, 8000))  # warm up: the host-dense tuner and stage runners settle
        figures = []
        for _ in range(reps):
            cpu = time.thread_time()
            await run(requests)
            figures.append((time.thread_time() - cpu) / requests * 1e6)
        return figures
    finally:
        await core.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="built-in model (default tiny)")
    parser.add_argument("--items", type=int, default=1, help="items per request (default 1)")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    parser.add_argument("--requests", type=int, default=20000, help="requests per repetition (default 20000)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions; the median is reported (default 3)")
    parser.add_argument("--max-batch-rows", type=int, default=8, metavar="REQUESTS",
                        help="requests per batch (default 8; batches leave full, without a window)")
    parser.add_argument("--quick", action="store_true", help="one repetition of 4000 requests (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="accepted for bench/run_all.py; this bench only prints")
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.reps = 4000, 1
    import uvloop

    figures = uvloop.run(measure(args.model, args.items, args.concurrency, args.requests, args.reps,
                                 args.max_batch_rows))
    print(f"sixfold serving path ({args.model}, {args.items} item(s)/request, batches of {args.max_batch_rows}, "
          f"{args.concurrency} in flight): loop CPU per request "
          f"{', '.join(f'{f:.1f}' for f in figures)} us; median {statistics.median(figures):.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
