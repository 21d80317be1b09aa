"""Latency-bounded throughput: the highest QPS whose p99 <= 60 ms, MLPerf DLRM query sizes.

For each model (dlrm-mlperf and rm2, every table capped at ``--max-rows``), one run measures, one
after another (one server alive at a time, so none shares the 2 cores with another):

  offline          in this process, no server: the unpartitioned torch model (``models.build``) on
                   requests from ``models.RequestGenerator`` at batch sizes 64..2048 items,
                   ``torch.inference_mode()``, torch threads = all cores; the best items/s (measured
                   before and after the servers, the better kept: the machine is shared), turned
                   into queries/s by dividing by the mean MLPerf query size (270 items). The limit of
                   this machine: what a user would do offline (the zoo models have no faster path:
                   no compiled or fused variant; eager torch is how they are meant to run).
  sixfold          ``sixfold-serve --model M --max-rows R --cards 6`` in its own process: default
                   dynamic batching (1024 rows, 2 ms window), host-dense fallback at its default
                   (-1: tuned from measured latencies)
  sixfold-nobatch  the same with ``--max-batch-rows 1 --max-queue-delay-us 0``: every request is its
                   own batch (a query larger than 1 row runs alone, no window); host-dense fallback
                   at its default too, and up to cards + 1 batches in flight as in ``sixfold``
  ideal            no server, simulated (``sixfold.loadgen.ideal.ideal_max_qps``): every query at offline's
                   best items/s, one after another in arrival order, no overhead. Queueing alone
                   keeps it below offline's q/s under a latency bound: it is the most any server can
                   reach here, and ``sixfold / ideal`` what sixfold leaves on the table
  fifo             the ideal's policy run for real (``bench/fifo_server.py``): the offline torch model
                   on all cores behind a bare grpc.aio server, one query at a time in arrival order, no
                   batching; it gets ``--ids-dtype`` as sixfold does. ``fifo / ideal`` is what this
                   machine (transport, the client on the same cores, jitter, per-query speed below the
                   best batch's) costs that policy; ``sixfold / fifo`` compares sixfold with it
  mlserver         Seldon MLServer 1.7 (``bench/mlserver/serve.py`` in ``.venv-mlserver``) serving
                   the same torch model (same name, rows and seed) with adaptive batching
                   (``--mlserver-batch-size`` requests, ``--mlserver-batch-time`` s); its runtime
                   (``bench/mlserver/runtime.py``) runs torch on 1 thread

Per server: a few concurrent queries whose scores are checked against the offline model
(``answers``); idle latency (one query at a time, median and min of 5) at 270 items (the mean MLPerf
query) and 700 (the largest, 5% of the mix, so the p99 query); 2 s of closed-loop warmup; then,
per latency bound (``--p99-ms``, default 60 and 250), ``loadgen.find_max_qps_async`` (the
``--find-max-qps`` search of ``sixfold-loadgen``, run in this process): open-loop Poisson
arrivals, query sizes ``mlperf`` (100..700 items, MLPerf DLRM's 20-quantile table), the model's
own table rows, pooling and id skew, the same seeds for every server. Each step is a
``--warmup`` + ``--step`` s run; the search starts at 1/4 of the rate the server reached with 2
queries outstanding (the warmup), doubles (up to 4x offline), halves down to 1 q/s if the first
step fails, then bisects, at most ``--max-steps`` steps. At these rates a step holds some 10-150
queries, so its p99 is near its maximum: strict, and the same for every server; a passing step
with fewer than 40 queries is marked (†) and counts only as "at most" that rate for the goals.
After the searches, the server's own speed (``--saturation``: closed loops of MLPerf-sized queries
at 4, 8 and 16 outstanding, the best items/s kept) with the CPU each group of its threads used per
query there (``bench/_thread_cpu.py``: cards, host stage, event loop, the rest), and the ideal
server *at that speed*, which splits ``server / ideal`` into what the server loses to its speed
and what it loses to scheduling.
A bound below the server's fastest idle 700-item latency is not searched: every one of the
largest queries (5% of all) misses it with no queueing at all, so no rate meets it (reported
as 0). 60 ms is the requirement's bound; 250 ms is a second, looser one that shows how the
servers rank when 60 ms is out of reach on 2 cores.

Input order on the wire: the same tensors go to every server, but not in the same order (a KServe
v2 server takes inputs by name). sixfold gets loadgen's usual order (dense_features,
sparse_lengths, sparse_indices): its runtime reads a batch's item count from the first input
(``server/execution/runtime.py`` ``PlanRuntime.run``), so ids first would miscount items. MLServer gets
sparse_indices, sparse_lengths, dense_features: its adaptive batching splits a batched reply by
the *last* input's first dimension (``mlserver/batching/requests.py``
``BatchedRequests._merge_request_inputs`` overwrites ``_minibatch_sizes`` per input), which for
``sparse_indices`` is the id count, so with the ids last every reply fails to encode
(``struct.error: pack expected N items``). The bench checks both orders against MLServer.

    .venv/bin/python bench/latency_bounded.py                  # ~6-8 min on 2 cores; writes BENCHMARKS.md
    .venv/bin/python bench/latency_bounded.py --quick --no-write   # smoke run, ~1 min, dlrm-mlperf only
    .venv/bin/python bench/latency_bounded.py --models rm2 --skip-mlserver --runs 3 --p99-ms 60
    .venv/bin/python bench/latency_bounded.py --models dlrm-mlperf --skip-mlserver --skip-shm --runs 3 --p99-ms 60 \
        --serve-arg=--dense-precision --serve-arg=int8 --fifo-arg=--dense-precision --fifo-arg=int8 \
        --answer-tolerance 5e-3                                     # both sides at int8

``make mlserver-venv`` builds ``.venv-mlserver`` (mlserver 1.7 + torch CPU) once; without it the
MLServer rows say why they are missing and the rest is reported. With ``--runs N`` the servers run
in a rotated order each run (offline first); figures are the median run's, ratios medians of
per-run ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sixfold import models  # noqa: E402
from bench._common import command, machine_line, write_section  # noqa: E402
from bench._thread_cpu import cpu_by_group, group_pids, thread_cpu  # noqa: E402
from sixfold.loadgen import LoadConfig, SweepConfig, find_max_qps_async, run_load_async, wait_until_ready  # noqa: E402
from sixfold.loadgen.transport import DATATYPES, SharedMemoryTransport, make_client, wire_tensors  # noqa: E402
from sixfold.loadgen.config import IDS_DTYPES  # noqa: E402
from sixfold.loadgen.ideal import ideal_max_qps  # noqa: E402
from sixfold.models.requests import MLPERF_QUANTILES, MLPerfQuerySizes  # noqa: E402

SECTION = "latency-bounded"
COMMAND = ".venv/bin/python bench/latency_bounded.py"
MEAN_QUERY_ITEMS = float(np.mean(MLPERF_QUANTILES))  # 270 items
LARGEST_QUERY = max(MLPERF_QUANTILES)  # 700 items: 1 of the 20 quantiles, so the p99 query
IDEAL_QUERIES = 50_000  # simulated arrivals per ideal-server search
FLOOR_QPS = 1.0  # below this a step holds a handful of queries: its p99 means nothing
FEW_QUERIES = 40  # a passing step with fewer queries likely drew only 0-1 of the 700-item ones (5% of the mix)
CHANNELS_PER_WORKER = 8
SERVERS = ("sixfold", "sixfold-shm", "sixfold-nobatch", "sixfold-before", "fifo", "mlserver")
THIS_TREE = ("sixfold", "sixfold-shm", "sixfold-nobatch")  # the servers that run this checkout's code
TAKES_IDS_DTYPE = (*THIS_TREE, "fifo")  # --ids-dtype reaches these; the others get INT64 ids
LABEL = {"offline": "offline (in-process torch, best batch)",
         "ideal": "ideal server (simulated: every query at offline's best speed, FIFO, no overhead)",
         "sixfold": "sixfold (default batching)",
         "sixfold-shm": "sixfold (default batching), inputs in system shared memory (`--client shm`)",
         "sixfold-nobatch": "sixfold, no batching", "mlserver": "MLServer, adaptive batching",
         "fifo": "FIFO server, measured (`bench/fifo_server.py`: the ideal's policy run here, offline torch, "
                 "one query at a time, over gRPC)",
         "sixfold-before": "sixfold at --baseline-tree (default batching)"}
USUAL_ORDER = ("dense_features", "sparse_lengths", "sparse_indices")  # loadgen's (RequestGenerator.make)
DENSE_LAST = ("sparse_indices", "sparse_lengths", "dense_features")  # the one MLServer's batching answers
WIRE_ORDER = {"sixfold": USUAL_ORDER, "sixfold-shm": USUAL_ORDER, "sixfold-nobatch": USUAL_ORDER, "sixfold-before": USUAL_ORDER,
              "fifo": USUAL_ORDER, "mlserver": DENSE_LAST}
MLSERVER_PYTHON = ROOT / ".venv-mlserver" / "bin" / "python"
GRPC_OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Server processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """A server must not outlive the bench, even one killed with SIGKILL (run_all's time limit)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# serve.py starts `mlserver start` with subprocess.call: give that grandchild the same parent-death
# signal, then run serve.py, unchanged, as __main__.
_MLSERVER_WRAPPER = """\
import ctypes, runpy, signal, subprocess, sys
def die():
    ctypes.CDLL(None).prctl(1, signal.SIGTERM)
die()
_call = subprocess.call
subprocess.call = lambda *a, **k: _call(*a, preexec_fn=die, **k)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


class ServerProc:
    """A server in its own process group; ``url`` once it is ready; ``stop()`` ends the whole group."""

    def __init__(self, name: str, argv: list[str], *, ready_line: str, env: dict[str, str] | None = None,
                 url: str = "") -> None:
        self.name, self.argv, self.ready_line, self.env, self.url = name, argv, ready_line, env, url
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.errors = 0
        self.proc: subprocess.Popen[str] | None = None
        self._ready = threading.Event()

    def start(self, model: str, timeout_s: float = 240.0) -> str:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=self.env, cwd=ROOT, start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._ready.wait(timeout_s) or self.proc.poll() is not None or not self.url:
            raise RuntimeError(f"{self.name} did not start in {timeout_s:g} s (exit code {self.proc.poll()}); "
                               f"last output: {self.tail()}")
        asyncio.run(_wait_model(self.url, model, timeout_s))  # serving the model, not only listening
        return self.url

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self.errors += " ERROR " in line
            if self.ready_line in line:
                if line.startswith("READY grpc="):
                    self.url = line.split("=", 1)[1].strip()
                self._ready.set()
        self._ready.set()

    def tail(self, n: int = 12) -> str:
        return " | ".join(list(self.lines)[-n:])

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)  # the group: serve.py's `mlserver start` child too
            except (ProcessLookupError, PermissionError):
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self._group_alive():
                time.sleep(0.1)
            if not self._group_alive():
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def _group_alive(self) -> bool:
        assert self.proc is not None
        self.proc.poll()  # reap the leader, or it stays a zombie in the group
        try:
            os.killpg(self.proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True


async def _wait_model(url: str, model: str, timeout_s: float) -> None:
    client = make_client(url)
    try:
        await wait_until_ready(client, url, model, "", timeout_s)
    finally:
        await client.close()


def sixfold_server(model: str, max_rows: int, cards: int, *, batching: bool, tree: str | None = None,
                   workers: int = 1, extra: list[str] | None = None) -> ServerProc:
    """``tree``: serve with the code of another source tree (e.g. ``git archive`` of an earlier commit), put
    first on PYTHONPATH, with this venv's packages: a before/after comparison in one run. ``workers``:
    ``sixfold-serve --workers`` (a tree from before the option serves with one). ``extra``: more
    ``sixfold-serve`` arguments (``--serve-arg``), for every sixfold server."""
    argv = [*command("sixfold-serve"), "--model", model, "--max-rows", str(max_rows),
            "--cards", str(cards), "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1",
            "--http-port", "-1", "--drain-seconds", "0"]
    if workers > 1 and tree is None:
        argv += ["--workers", str(workers)]
    argv += extra or []
    if not batching:
        argv += ["--max-batch-rows", "1", "--max-queue-delay-us", "0"]
    env = None
    if tree is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(Path(tree).resolve()),
                                                                           os.environ.get("PYTHONPATH"))))}
    name = "sixfold-before" if tree is not None else "sixfold" if batching else "sixfold-nobatch"
    return ServerProc(name, argv, ready_line="READY grpc=", env=env)


def mlserver_missing() -> str | None:
    """Why MLServer cannot run here, or None."""
    if not MLSERVER_PYTHON.exists() or not (MLSERVER_PYTHON.parent / "mlserver").exists():
        return "MLServer is not installed (no .venv-mlserver: run `make mlserver-venv`)"
    return None


def mlserver_version() -> str:
    try:
        out = subprocess.run([str(MLSERVER_PYTHON), "-c", "import mlserver; print(mlserver.__version__)"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def mlserver_server(model: str, max_rows: int, batch_size: int, batch_time_s: float) -> ServerProc:
    grpc_port, http_port = _free_port(), _free_port()
    argv = [str(MLSERVER_PYTHON), "-c", _MLSERVER_WRAPPER, str(ROOT / "bench" / "mlserver" / "serve.py"),
            "--model", model, "--max-rows", str(max_rows), "--grpc-port", str(grpc_port),
            "--http-port", str(http_port), "--max-batch-size", str(batch_size), "--max-batch-time", str(batch_time_s)]
    return ServerProc("mlserver", argv, ready_line="gRPC server running on", url=f"127.0.0.1:{grpc_port}")


# ---------------------------------------------------------------------------------------------
# Traffic


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


def _ids(args: argparse.Namespace, name: str) -> str:
    """How a server gets its ids: --ids-dtype for this tree's sixfold servers and the FIFO server, int64 for
    the others."""
    return args.ids_dtype if name in TAKES_IDS_DTYPE else "int64"


def _client(name: str) -> str:
    """The loadgen transport a server is driven with: the shm variant sends tensors by region."""
    return "shm" if name == "sixfold-shm" else "raw"


def _channels(args: argparse.Namespace, client: str) -> int:
    """Connections loadgen spreads a sixfold server's traffic over: several per worker (SO_REUSEPORT
    hashes each connection to one worker), one for a single process (as before the option)."""
    return CHANNELS_PER_WORKER * args.workers if args.workers > 1 and client in ("raw", "shm") else 1


def _load_config(url: str, model: str, cfg: models.ModelConfig, **kw: Any) -> LoadConfig:
    return LoadConfig(url=url, model=model, query_size="mlperf", table_rows=cfg.table_rows, pooling=cfg.pooling,
                      zipf=cfg.zipf, dense_dim=cfg.dense_dim, wait_ready_s=60.0, **kw)


def _encode(model: str, request: Mapping[str, np.ndarray], order: tuple[str, ...], ids_dtype: str = "int64") -> bytes:
    from tritonclient.grpc import service_pb2

    request = wire_tensors(request, ids_dtype)
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
                        order: tuple[str, ...], ids_dtype: str = "int64", tolerance: float = 1e-3) -> dict[str, Any]:
    """Send ``queries`` at once (so a batching server batches them); compare scores with ``expected``
    (ok: every score within ``tolerance``)."""
    import grpc
    from tritonclient.grpc import service_pb2

    async with grpc.aio.insecure_channel(url, options=GRPC_OPTIONS) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=None,
                                   response_deserializer=service_pb2.ModelInferResponse.FromString)
        answers = await asyncio.gather(*(call(_encode(model, q, order, ids_dtype), timeout=120) for q in queries),
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


async def idle_latency(url: str, model: str, gen: models.RequestGenerator, order: tuple[str, ...],
                       sizes: tuple[int, ...], repeats: int, *, client: str = "raw", ids_dtype: str = "int64"
                       ) -> tuple[dict[int, float], dict[int, float]]:
    """Median and min ms of one query at a time, per size (after one untimed query of that size);
    ``client="shm"`` sends each query by shared memory region (loadgen's SharedMemoryTransport)."""
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
        return await timed(lambda payload, n: call(payload, timeout=60), lambda n: _encode(model, gen.make(n), order, ids_dtype))


async def search(url: str, model: str, cfg: models.ModelConfig, args: argparse.Namespace, bound: float, *,
                 lo: float, hi: float, seed: int, console: Any, client: str = "raw", ids_dtype: str = "int64"
                 ) -> dict[str, Any]:
    """The find-max-qps search for one bound: the answer and its best step's figures."""
    config = _load_config(url, model, cfg, qps=lo, duration_s=args.step, warmup_s=args.warmup, seed=seed,
                          drain_timeout_s=10.0, client=client, channels=_channels(args, client), ids_dtype=ids_dtype)
    sweep = SweepConfig(p99_ms=bound, min_qps=lo, max_qps=hi, floor_qps=min(FLOOR_QPS, lo),
                        step_duration_s=args.step, tolerance=args.tolerance, max_steps=args.max_steps, settle_s=2.0)
    report = await find_max_qps_async(config, sweep, console=console)
    best = report.max_qps_under_slo
    found = best is not None
    measured = int(report.requests["scheduled"]) if found else None
    return {"max_qps": best, "floor": sweep.floor_qps, "lo": lo, "hi": hi, "at_ceiling": found and best >= hi,
            "queries": measured,
            "items_per_s": round(float(report.items_per_s), 1) if found else None,
            "p50_ms": report.latency_ms["p50"] if found else None,
            "p99_ms": report.latency_ms["p99"] if found else None,
            "steps": report.sweep, "warnings": list(report.warnings)}


# ---------------------------------------------------------------------------------------------
# Offline limit


Queries = list[dict[str, np.ndarray]]


def measure_offline(name: str, cfg: models.ModelConfig, max_rows: int, batches: list[int], min_s: float,
                    check_sizes: tuple[int, ...]) -> tuple[dict[str, Any], Queries, list[np.ndarray]]:
    """Best items/s of the unpartitioned model over ``batches``, and reference answers for the check."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    model = models.build(name, max_rows=max_rows, seed=0)
    gen = models.RequestGenerator.for_config(cfg, seed=7)
    per_batch = {}
    with torch.inference_mode():
        for b in batches:
            reqs = [[torch.from_numpy(r[k]) for k in USUAL_ORDER] for r in (gen.make(b), gen.make(b))]
            model(*reqs[0])  # warm
            times: list[float] = []
            t_end = time.perf_counter() + min_s
            while len(times) < 3 or time.perf_counter() < t_end:
                t0 = time.perf_counter()
                model(*reqs[len(times) % 2])
                times.append(time.perf_counter() - t0)
            per_batch[b] = b / statistics.median(times)
        check_gen = models.RequestGenerator.for_config(cfg, seed=11)
        queries = [check_gen.make(n) for n in check_sizes]
        expected = [model(*[torch.from_numpy(q[k]) for k in USUAL_ORDER]).numpy().copy() for q in queries]
    best = max(per_batch, key=per_batch.__getitem__)
    del model
    return ({"items_per_s": {b: round(v, 1) for b, v in per_batch.items()}, "best_batch": best,
             "best_items_per_s": round(per_batch[best], 1), "qps": per_batch[best] / MEAN_QUERY_ITEMS,
             "threads": torch.get_num_threads()}, queries, expected)


# ---------------------------------------------------------------------------------------------
# One model, one run


def fifo_server(model: str, max_rows: int, extra: list[str] | None = None) -> ServerProc:
    argv = [sys.executable, str(ROOT / "bench" / "fifo_server.py"), "--model", model, "--max-rows", str(max_rows),
            "--host", "127.0.0.1", "--port", "0", *(extra or [])]
    return ServerProc("fifo", argv, ready_line="READY grpc=")


def _start(name: str, model: str, args: argparse.Namespace) -> ServerProc:
    if name == "fifo":
        return fifo_server(model, args.max_rows, args.fifo_arg)
    if name == "mlserver":
        return mlserver_server(model, args.max_rows, args.mlserver_batch_size, args.mlserver_batch_time)
    if name == "sixfold-before":
        return sixfold_server(model, args.max_rows, args.cards, batching=True, tree=args.baseline_tree,
                              extra=args.serve_arg)
    return sixfold_server(model, args.max_rows, args.cards, batching=name in ("sixfold", "sixfold-shm"),
                          workers=args.workers, extra=args.serve_arg)


def measure_server(name: str, model: str, run: int, args: argparse.Namespace, cfg: models.ModelConfig,
                   queries: list[dict[str, np.ndarray]], expected: list[np.ndarray], hi: float,
                   console: Any) -> dict[str, Any]:
    tag = f"[{model} run {run + 1}] {name}"
    server = _start(name, model, args)
    t0 = time.perf_counter()
    try:
        try:
            url = server.start(model)
        except RuntimeError as exc:
            log(f"{tag}: {exc}")
            return {"skipped": f"did not start: {' '.join(str(exc).split())[:300]}"}
        log(f"{tag}: serving at {url} ({time.perf_counter() - t0:.0f} s to start)")
        order = WIRE_ORDER[name]
        entry: dict[str, Any] = {"wire_order": list(order),
                                 "answers": asyncio.run(check_answers(url, model, queries, expected, order,
                                                                      _ids(args, name), args.answer_tolerance))}
        if order != USUAL_ORDER:
            entry["answers_usual_order"] = asyncio.run(check_answers(url, model, queries, expected, USUAL_ORDER,
                                                                     tolerance=args.answer_tolerance))
        log(f"{tag}: answers {entry['answers']}")
        gen = models.RequestGenerator.for_config(cfg, seed=13)
        entry["idle_ms"], entry["idle_ms_min"] = asyncio.run(idle_latency(
            url, model, gen, order, (int(MEAN_QUERY_ITEMS), LARGEST_QUERY), args.idle_repeats,
            client=_client(name), ids_dtype=_ids(args, name)))
        log(f"{tag}: idle latency (ms by items) median {entry['idle_ms']}, min {entry['idle_ms_min']}")
        with inputs_in_order(order):
            warm = asyncio.run(run_load_async(_load_config(url, model, cfg, qps=0, duration_s=args.warmup_run,
                                                           concurrency=2, seed=1000 * run + 500,
                                                           client=_client(name), ids_dtype=_ids(args, name),
                                                           channels=_channels(args, _client(name)))))
            entry["closed_loop_qps"] = round(float(warm.achieved_qps), 2)
            # The search starts at a quarter of what 2 outstanding queries get: a rate near the answer for
            # the looser bound, whatever the (noisy) offline figure was.
            start = max(FLOOR_QPS, round(entry["closed_loop_qps"] / 4, 2))
            hi = round(max(hi, 4 * entry["closed_loop_qps"], start), 2)
            entry["bounds"] = {}
            for bound in args.p99_ms:
                if entry["idle_ms_min"][LARGEST_QUERY] > bound:
                    entry["bounds"][bound] = {"max_qps": 0.0, "infeasible": True}
                    log(f"{tag}: p99 <= {bound:g} ms: not searched, a {LARGEST_QUERY}-item query alone takes "
                        f"{entry['idle_ms_min'][LARGEST_QUERY]:g} ms at best")
                    continue
                result = asyncio.run(search(url, model, cfg, args, bound, lo=start, hi=hi, seed=1000 * run,
                                            console=console, client=_client(name), ids_dtype=_ids(args, name)))
                entry["bounds"][bound] = result
                start = max(start, result["max_qps"] or 0.0)  # passes a looser bound too: start there
                log(f"{tag}: p99 <= {bound:g} ms: max {_qps(result)} q/s")
            if args.saturation:  # after the searches: an overload must not change what they measure
                entry["saturation"] = measure_saturation(server, url, model, cfg, run, name, args)
        entry["alive_after"] = server.alive
        entry["server_errors_logged"] = server.errors
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        return entry
    finally:
        server.stop()


def measure_saturation(server: ServerProc, url: str, model: str, cfg: models.ModelConfig, run: int, name: str,
                       args: argparse.Namespace) -> dict[str, Any]:
    """The server's own best speed: closed loops of MLPerf-sized queries at each of ``args.saturation``
    outstanding (after the latency searches), and the CPU its threads used per query there, by stage
    (``bench._thread_cpu``).

    The ideal server at *this* speed (``ideal_max_qps`` of the best items/s) separates what a server
    loses to its speed (CPU per query: serving overhead, simulated cards on the host's cores) from
    what it loses to scheduling (queueing, batching, interference): sixfold / ideal = (ideal at own
    speed / ideal) x (sixfold / ideal at own speed).
    """
    tag = f"[{model} run {run + 1}] {name}"
    assert server.proc is not None  # started: measure_server got its url
    pids = group_pids(server.proc.pid)  # the server's processes (workers, MLServer's children) stay put
    steps = []
    for concurrency in args.saturation:
        before, t0 = thread_cpu(pids), time.perf_counter()
        # No warmup: the server is warm from the searches, and the CPU read here must be the measured
        # window's.
        report = asyncio.run(run_load_async(_load_config(
            url, model, cfg, qps=0, duration_s=args.saturation_s, concurrency=concurrency,
            seed=1000 * run + 700 + concurrency, client=_client(name), channels=_channels(args, _client(name)),
            ids_dtype=_ids(args, name))))
        groups = cpu_by_group(before, thread_cpu(pids))
        wall = time.perf_counter() - t0
        answered = max(1, report.requests.get("ok", 0))
        steps.append({"concurrency": concurrency, "items_per_s": round(float(report.items_per_s), 1),
                      "qps": round(float(report.achieved_qps), 2), "p50_ms": report.latency_ms.get("p50"),
                      "errors": report.requests.get("errors", 0), "answered": answered,
                      "cpu_ms_per_query": {g: round(v / answered * 1e3, 2) for g, v in groups.items()},
                      "cores_busy": round(sum(groups.values()) / wall, 2)})
        log(f"{tag}: closed loop at {concurrency} outstanding: {report.items_per_s:,.0f} items/s, "
            f"{sum(groups.values()) / answered * 1e3:.1f} core-ms a query on {steps[-1]['cores_busy']} cores")
    best = max(steps, key=lambda st: st["items_per_s"] if not st["errors"] else 0.0)
    return {"steps": steps, "best": best}


def run_model(model: str, run: int, args: argparse.Namespace, console: Any) -> dict[str, Any]:
    cfg = models.get_config(model, max_rows=args.max_rows)
    log(f"[{model} run {run + 1}] offline: batches {args.offline_batches}")
    offline, queries, expected = measure_offline(model, cfg, args.max_rows, args.offline_batches, args.offline_s,
                                                 args.check_sizes)
    log(f"[{model} run {run + 1}] offline: best {offline['best_items_per_s']:,.0f} items/s at batch "
        f"{offline['best_batch']} = {offline['qps']:.2f} q/s")
    hi = round(offline["qps"] * 4, 2)
    names = [s for s in SERVERS if not ((s == "mlserver" and args.skip_mlserver)
                                        or (s == "sixfold-nobatch" and args.skip_nobatch)
                                        or (s == "sixfold-shm" and args.skip_shm)
                                        or (s == "fifo" and args.skip_fifo)
                                        or (s == "sixfold-before" and not args.baseline_tree))]
    k = run % len(names)
    run_order = names[k:] + names[:k]
    result: dict[str, Any] = {"offline": offline, "order": ["offline", *run_order], "servers": {}}
    for name in run_order:
        missing = mlserver_missing() if name == "mlserver" else None
        if missing:
            result["servers"][name] = {"skipped": missing}
            log(f"[{model} run {run + 1}] mlserver: skipped: {missing}")
            continue
        result["servers"][name] = measure_server(name, model, run, args, cfg, queries, expected, hi, console)
    if args.offline_again:
        # The machine is shared and noisy: measure the limit again after the servers, keep the better one.
        again, _, _ = measure_offline(model, cfg, args.max_rows, args.offline_batches, args.offline_s, ())
        log(f"[{model} run {run + 1}] offline again: best {again['best_items_per_s']:,.0f} items/s at batch "
            f"{again['best_batch']}")
        result["order"].append("offline")
        result["offline_runs"] = [offline, again]
        if again["qps"] > offline["qps"]:
            result["offline"] = again
    return result


# ---------------------------------------------------------------------------------------------
# Report


def _qps(r: dict[str, Any]) -> str:
    if r.get("infeasible"):
        return "0"
    if r["max_qps"] is None:
        return f"< {r['floor']:g}"
    return ("≥ " if r["at_ceiling"] else "") + f"{r['max_qps']:.2f}"


INF = float("inf")


def _interval(r: dict[str, Any] | None) -> tuple[float, float] | None:
    """What one search result says about the true max q/s: (at least, at most); None: not measured."""
    if r is None:
        return None
    if r.get("infeasible"):
        return 0.0, 0.0
    if r["max_qps"] is None:
        return 0.0, r["floor"]
    if r["queries"] < FEW_QUERIES:  # † : a pass from a handful of queries says "at most about this"
        return 0.0, r["max_qps"]
    return r["max_qps"], INF if r["at_ceiling"] else r["max_qps"]


def _div(x: float, y: float) -> float:
    if x == 0:
        return 0.0
    return INF if y == 0 else x / y


def _ratio(a: tuple[float, float] | None, b: tuple[float, float] | None) -> dict[str, Any] | None:
    """a / b as an interval (low, high); ``both_zero`` when neither meets the bound at any rate."""
    if a is None or b is None:
        return None
    return {"low": _div(a[0], b[1]), "high": _div(a[1], b[0]), "both_zero": a == (0.0, 0.0) == b}


def _bound(entry: dict[str, Any] | None, bound: float) -> dict[str, Any] | None:
    if entry is None or "skipped" in entry:
        return None
    return entry.get("bounds", {}).get(bound)


def _median_ratio(values: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    real = [v for v in values if v is not None]
    if not real:
        return None
    return {"low": statistics.median(v["low"] for v in real), "high": statistics.median(v["high"] for v in real),
            "both_zero": all(v["both_zero"] for v in real)}


def _fmt_ratio(r: dict[str, Any] | None) -> str:
    if r is None:
        return "n/a"
    lo, hi = r["low"], r["high"]
    if r["both_zero"]:
        return "both 0"
    if lo == hi:
        return "∞ (the other: 0)" if lo == INF else f"{lo:.2f}"
    if lo == 0 and hi == INF:
        return "?"
    if lo == 0:
        return f"≤ {hi:.2f}"
    return f"≥ {lo:.2f}" if hi == INF else f"{lo:.2f}-{hi:.2f}"


def _median_entry(entries: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """The run whose max QPS at ``bound`` is the median (its figures stay consistent with each other)."""
    real = [e for e in entries if "skipped" not in e]
    if not real:
        return entries[0]
    real.sort(key=lambda e: (_interval(_bound(e, bound)) or (0.0, 0.0))[1])
    return real[(len(real) - 1) // 2]


RATIOS = (("sixfold", "sixfold-nobatch"), ("sixfold", "mlserver"), ("sixfold", "offline"),
          ("sixfold", "ideal"), ("mlserver", "offline"), ("sixfold-nobatch", "offline"),
          ("sixfold-before", "ideal"), ("sixfold", "sixfold-before"), ("sixfold-shm", "ideal"),
          ("sixfold-shm", "sixfold"), ("fifo", "ideal"), ("sixfold", "fifo"), ("sixfold-shm", "fifo"))


def ideal_qps(offline: dict[str, Any], bound: float) -> float:
    """The ideal server's max q/s at ``bound``: offline's best speed for every query, FIFO, no overhead."""
    return ideal_max_qps(offline["best_items_per_s"], MLPerfQuerySizes(), bound, queries=IDEAL_QUERIES).max_qps


def summarize(results: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model, runs in results.items():
        offline = {"max_qps": statistics.median(r["offline"]["qps"] for r in runs),
                   "items_per_s": statistics.median(r["offline"]["best_items_per_s"] for r in runs),
                   "best_batch": sorted({r["offline"]["best_batch"] for r in runs})}
        entries = {name: [r["servers"][name] for r in runs if name in r["servers"]] for name in SERVERS}
        ratios: dict[float, dict[str, Any]] = {}
        ideal: dict[float, float] = {}
        ideal_by_run: dict[float, list[float]] = {}
        for bound in args.p99_ms:
            ratios[bound] = {}
            per_run_ideal = ideal_by_run[bound] = [ideal_qps(r["offline"], bound) for r in runs]
            ideal[bound] = statistics.median(per_run_ideal)
            for num, den in RATIOS:
                values = []
                for r, ideal_run in zip(runs, per_run_ideal):
                    a = _interval(_bound(r["servers"].get(num), bound))
                    if den == "offline":
                        b: tuple[float, float] | None = (r["offline"]["qps"],) * 2
                    elif den == "ideal":
                        b = (ideal_run, ideal_run)
                    else:
                        b = _interval(_bound(r["servers"].get(den), bound))
                    values.append(_ratio(a, b))
                ratios[bound][f"{num}/{den}"] = _median_ratio(values)
        offline["ideal_qps"] = ideal
        first = args.p99_ms[0]
        out[model] = {"offline": offline, "ratios": ratios, "orders": [r["order"] for r in runs],
                      "servers": {n: _median_entry(e, first) for n, e in entries.items() if e},
                      "own_speed": own_speed_split(runs, args, ideal_by_run)}
    return out


def own_speed_split(runs: list[dict[str, Any]], args: argparse.Namespace,
                    ideal_by_run: dict[float, list[float]]) -> dict[str, Any]:
    """Per server, medians over runs: best closed-loop items/s, that / offline's, the ideal server at that
    speed (q/s per bound), the server's q/s / that ideal (an interval), and CPU per query by thread group.
    ``ideal_by_run``: the ideal server's q/s per bound, one per run (``summarize`` has them)."""
    out: dict[str, Any] = {}
    for name in SERVERS:
        measured = [(i, r["servers"][name]) for i, r in enumerate(runs)
                    if r["servers"].get(name, {}).get("saturation", {}).get("steps")]
        if not measured:
            continue
        best = [e["saturation"]["best"] for _, e in measured]
        entry: dict[str, Any] = {
            "items_per_s": statistics.median(b["items_per_s"] for b in best),
            "of_offline": statistics.median(b["items_per_s"] / runs[i]["offline"]["best_items_per_s"]
                                            for (i, _), b in zip(measured, best)),
            "concurrency": sorted({b["concurrency"] for b in best}),
            "ideal_qps": {}, "of_ideal_own": {}, "of_ideal": {}}
        for bound in args.p99_ms:
            own = [ideal_max_qps(b["items_per_s"], MLPerfQuerySizes(), bound, queries=IDEAL_QUERIES).max_qps
                   for b in best]
            entry["ideal_qps"][bound] = statistics.median(own)
            entry["of_ideal_own"][bound] = _median_ratio([_ratio(_interval(_bound(e, bound)), (o, o))
                                                          for (_, e), o in zip(measured, own)])
            entry["of_ideal"][bound] = statistics.median(_div(o, ideal_by_run[bound][i])
                                                         for (i, _), o in zip(measured, own))
        groups: dict[str, list[float]] = {}
        for b in best:
            for g, v in b["cpu_ms_per_query"].items():
                groups.setdefault(g, []).append(v)
        entry["cpu_ms_per_query"] = {g: statistics.median(v + [0.0] * (len(best) - len(v)))
                                     for g, v in groups.items()}
        out[name] = entry
    return out


def _answers(entry: dict[str, Any]) -> str:
    a = entry["answers"]
    if a["ok"]:
        return f"match (max diff {a['max_abs_diff']:.0e})"
    return "**WRONG**: " + "; ".join(a["errors"] or [f"max diff {a['max_abs_diff']:.2g}"])


def format_tables(summary: dict[str, Any], args: argparse.Namespace) -> str:
    bounds = args.p99_ms
    head = " | ".join(f"max q/s at p99 <= {b:g} ms (p50 / p99 ms there)" for b in bounds)
    lines = [f"| model | server | idle ms (median of {args.idle_repeats}), {int(MEAN_QUERY_ITEMS)} / {LARGEST_QUERY} "
             f"items | {head} "
             f"| answers vs offline model |", "|---|---|---|" + "---|" * len(bounds) + "---|"]
    for model, s in summary.items():
        off = s["offline"]
        cells = " | ".join(f"{off['max_qps']:.2f} (no latency bound)" for _ in bounds)
        lines.append(f"| {model} | {LABEL['offline']}: {off['items_per_s']:,.0f} items/s at batch "
                     f"{', '.join(map(str, off['best_batch']))} |  | {cells} |  |")
        cells = " | ".join(f"{off['ideal_qps'][b]:.2f}" for b in bounds)
        lines.append(f"| {model} | {LABEL['ideal']} | {LARGEST_QUERY / off['items_per_s'] * 1e3:.0f} "
                     f"(its service time) | {cells} |  |")
        for name in SERVERS:
            e = s["servers"].get(name)
            if e is None:
                continue
            if "skipped" in e:
                lines.append(f"| {model} | {LABEL[name]} | {e['skipped']} |" + " |" * len(bounds) + "  |")
                continue
            idle = (f"{e['idle_ms'][int(MEAN_QUERY_ITEMS)]:.0f} / {e['idle_ms'][LARGEST_QUERY]:.0f} "
                    f"(fastest {e['idle_ms_min'][LARGEST_QUERY]:.0f})")
            cells = []
            for b in bounds:
                r = e["bounds"][b]
                if r.get("infeasible"):
                    cells.append(f"0 (a lone {LARGEST_QUERY}-item query > {b:g} ms)")
                elif r["p99_ms"] is not None:
                    few = "†" if r["queries"] < FEW_QUERIES else ""
                    cells.append(f"{_qps(r)}{few} ({r['p50_ms']:.0f} / {r['p99_ms']:.0f}; {r['queries']} queries; "
                                 f"{len(r['steps'])} steps)")
                else:
                    cells.append(f"{_qps(r)} ({len(r['steps'])} steps)")
            lines.append(f"| {model} | {LABEL[name]} | {idle} | {' | '.join(cells)} | {_answers(e)} |")
    lines += ["", "| model | p99 bound | sixfold / no batching | sixfold / MLServer (goal >= 3) "
              "| sixfold / offline (goal >= 0.7) | sixfold / ideal server | MLServer / offline "
              "| no batching / offline | baseline tree / ideal server | sixfold / baseline tree "
              "| sixfold over shm / ideal server | sixfold over shm / over gRPC bytes "
              "| FIFO server measured / ideal (simulated) | sixfold / FIFO measured | sixfold over shm / FIFO measured |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, s in summary.items():
        for b in bounds:
            r = s["ratios"][b]
            lines.append(f"| {model} | {b:g} ms | " + " | ".join(_fmt_ratio(r[f"{n}/{d}"]) for n, d in RATIOS) + " |")
    split = [(m, n, e) for m, s in summary.items() for n, e in s.get("own_speed", {}).items()]
    if split:
        first = bounds[0]
        lines += ["", f"Where the gap to the ideal server goes (p99 <= {first:g} ms): sixfold / ideal = "
                  "(ideal at the server's own speed / ideal) x (server / ideal at its own speed).", "",
                  "| model | server | own speed: best closed-loop items/s (outstanding) | / offline's best "
                  f"| ideal at own speed, q/s | = x of the ideal | server / ideal at own speed "
                  "| CPU per query there, core-ms by threads |", "|---|---|---|---|---|---|---|---|"]
        for model, name, e in split:
            cpu = ", ".join(f"{g} {v:.1f}" for g, v in e["cpu_ms_per_query"].items() if v >= 0.05)
            total = sum(e["cpu_ms_per_query"].values())
            lines.append(f"| {model} | {LABEL[name]} | {e['items_per_s']:,.0f} "
                         f"({', '.join(map(str, e['concurrency']))}) | {e['of_offline']:.2f} "
                         f"| {e['ideal_qps'][first]:.2f} | {e['of_ideal'][first]:.2f} "
                         f"| {_fmt_ratio(e['of_ideal_own'][first])} | {total:.1f}: {cpu} |")
    return "\n".join(lines)


def _goal(summary: dict[str, Any], bound: float, key: str, goal: float) -> str:
    parts = []
    for model, s in summary.items():
        r = s["ratios"][bound][key]
        if r is None:
            parts.append(f"{model}: not measured")
        elif r["both_zero"]:
            parts.append(f"{model}: **not met** (neither meets the bound at any rate)")
        elif r["low"] >= goal:
            parts.append(f"{model} {_fmt_ratio(r)}: met")
        elif r["high"] < goal:
            parts.append(f"{model} {_fmt_ratio(r)}: **not met**")
        else:
            parts.append(f"{model} {_fmt_ratio(r)}: **not shown** (a figure from too few queries)")
    return "; ".join(parts)


def format_section(summary: dict[str, Any], results: dict[str, Any], args: argparse.Namespace, argv: list[str],
                   wall: float, machine: str) -> str:
    cmd = (COMMAND + " " + " ".join(argv)).strip()
    orders = "; ".join(f"{m}: " + " | ".join(" → ".join(o) for o in s["orders"]) for m, s in summary.items())
    ml_notes = []
    for model, runs in results.items():
        e = next((r["servers"]["mlserver"] for r in runs if "answers_usual_order" in r["servers"].get("mlserver", {})),
                 None)
        if e is not None:
            a = e["answers_usual_order"]
            ml_notes.append(f"{model}: " + ("answered" if a["ok"] else "failed, " + "; ".join(a["errors"][:1])))
    first = args.p99_ms[0]
    text = [
        f"## Latency-bounded throughput (p99 <= {first:g} ms, MLPerf DLRM query sizes)",
        "",
        f"Command: `{cmd}` ({wall / 60:.1f} min; {machine}).",
        f"Models: {', '.join(summary)}, every table capped at {args.max_rows:,} rows, seed 0. Traffic: "
        f"`loadgen.find_max_qps_async` in the bench process: open-loop Poisson, query sizes `mlperf` "
        f"(100..700 items, mean {MEAN_QUERY_ITEMS:.0f}), the same seeds for every server; each step "
        f"{args.warmup:g} s warmup + {args.step:g} s measured, starting at 1/4 of the server's closed-loop rate "
        f"at 2 outstanding queries ({args.warmup_run:g} s, also its warmup), doubling (halving to {FLOOR_QPS:g} q/s "
        f"if the first step fails), then bisection to {args.tolerance:.0%}, at most "
        f"{args.max_steps} steps; a step passes with p99 (from scheduled send) within the bound, no errors, "
        f">= 90% of the rate answered. A bound below a server's idle {LARGEST_QUERY}-item latency (the p99 "
        f"query size; the fastest of {args.idle_repeats}) is not searched: no rate can meet it. "
        f"{args.runs} run(s); figures are the median run's, ratios medians of per-run ratios.",
        f"Run order (one server alive at a time): {orders}. sixfold: `sixfold-serve --cards {args.cards}{(' --workers ' + str(args.workers)) if args.workers > 1 else ''}{''.join(' ' + a for a in args.serve_arg)}` "
        f"(simcard), default batching (1024 rows, 2 ms window) and host-dense fallback at its default "
        f"(auto-tuned); no batching: `--max-batch-rows 1 --max-queue-delay-us 0`, same fallback default. "
        f"MLServer: `bench/mlserver/serve.py --max-batch-size {args.mlserver_batch_size} --max-batch-time "
        f"{args.mlserver_batch_time:g}` (adaptive batching; the runtime runs torch on 1 thread). FIFO measured: "
        f"`bench/fifo_server.py{''.join(' ' + a for a in args.fifo_arg)}` (the offline model on {os.cpu_count()} "
        f"threads behind a bare grpc.aio server, "
        f"one query at a time in arrival order). Offline: the "
        f"unpartitioned torch model in this process, `inference_mode`, {os.cpu_count()} threads, batches of "
        f"{', '.join(map(str, args.offline_batches))} items (median time per batch"
        + ("; measured before and after the servers, the better kept" if args.offline_again else "")
        + f"); its q/s = best items/s / {MEAN_QUERY_ITEMS:.0f}.",
        "Same tensors for every server; MLServer gets them ids first, dense last: its adaptive batching splits "
        "a batched reply by the last input's first dimension, so in loadgen's usual order (ids last) every "
        "reply fails" + (f" (checked here: {'; '.join(ml_notes)})." if ml_notes else ".")
        + " sixfold gets the usual order (it takes inputs in any order).",
        "",
        format_tables(summary, args),
        "",
        f"† the passing step held fewer than {FEW_QUERIES} queries: its p99 is about its maximum, and with 5% of "
        f"the mix at {LARGEST_QUERY} items it may hold none of the largest, so it counts as \"at most\" this "
        "rate (ratios then show ≤ / ≥). "
        f"Answers match when every score is within {args.answer_tolerance:g} of the offline model's. "
        "Cells: max q/s (p50 / p99 ms of the best passing step; its measured queries; search steps run).",
        "",
        f"Goals at p99 <= {first:g} ms: sixfold / MLServer >= 3: {_goal(summary, first, 'sixfold/mlserver', 3.0)}. "
        f"sixfold / offline >= 0.7: {_goal(summary, first, 'sixfold/offline', 0.7)}.",
        "",
        f"The ideal server (`sixfold.loadgen.ideal.ideal_max_qps`, {IDEAL_QUERIES:,} simulated Poisson arrivals of the "
        "same query mix) runs every query alone at offline's best items/s, back to back: no server on this "
        "machine does better with a FIFO queue. What it reaches at a bound, as a fraction of offline, is the "
        "most any server can: " + "; ".join(
            f"{m} " + ", ".join(f"{s['offline']['ideal_qps'][b] / s['offline']['max_qps']:.2f} at {b:g} ms"
                                for b in args.p99_ms) for m, s in summary.items()) + ".",
    ]
    return "\n".join(text) + "\n"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=None, help="comma-separated (default dlrm-mlperf,rm2; --quick: dlrm-mlperf)")
    p.add_argument("--max-rows", type=int, default=None, help="rows per table at most (default 50000; --quick 20000)")
    p.add_argument("--cards", type=int, default=6, help="simcards of the sixfold servers (default 6)")
    p.add_argument("--workers", type=int, default=1,
                   help="server processes of each sixfold server (sixfold-serve --workers; default 1: "
                        "on 2 cores more cannot help; on a bigger host, try one per spare core)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more sixfold-serve argument for every sixfold server, e.g. "
                        "--serve-arg=--backend-option --serve-arg=intra_op_threads=2 (repeatable)")
    p.add_argument("--p99-ms", type=_floats, default=None,
                   help="latency bounds, comma-separated; the first one is the goals' (default 60,250; --quick 60)")
    p.add_argument("--runs", type=int, default=1, help="repeat everything, servers in a rotated order (default 1)")
    p.add_argument("--step", type=float, default=None, help="measured seconds per search step (default 5; --quick 2)")
    p.add_argument("--warmup", type=float, default=None,
                   help="warmup seconds before each step (default 1; --quick 0.5)")
    p.add_argument("--max-steps", type=int, default=None, help="search steps per bound at most (default 8; --quick 3)")
    p.add_argument("--tolerance", type=float, default=None, help="bisection stops within this fraction (default 0.15)")
    p.add_argument("--offline-batches", type=_ints, default=None,
                   help="offline batch sizes in items (default 64,128,256,512,1024,2048)")
    p.add_argument("--saturation", type=_ints, default=None,
                   help="closed loops at these many outstanding queries measure each server's own best speed "
                        "and CPU per query by stage, for the ideal server at that speed (default 4,8,16; "
                        "--quick 8; 0: none)")
    p.add_argument("--saturation-s", type=float, default=None,
                   help="measured seconds of each closed loop (default 5; --quick 2)")
    p.add_argument("--skip-mlserver", action="store_true", help="leave MLServer out")
    p.add_argument("--skip-nobatch", action="store_true", help="leave sixfold without batching out")
    p.add_argument("--fifo-arg", action="append", default=[], metavar="ARG",
                   help="one more bench/fifo_server.py argument, e.g. --fifo-arg=--dense-precision --fifo-arg=int8 "
                        "beside --serve-arg=--dense-precision --serve-arg=int8 (repeatable)")
    p.add_argument("--answer-tolerance", type=float, default=1e-3,
                   help="largest |score - offline score| a server's answers may show (default 1e-3; raise it "
                        "with a reduced precision, e.g. 5e-3 with --serve-arg=--dense-precision --serve-arg=int8)")
    p.add_argument("--skip-fifo", action="store_true",
                   help="leave out the measured FIFO server (bench/fifo_server.py: the ideal's policy run here)")
    p.add_argument("--skip-shm", action="store_true",
                   help="leave out sixfold driven through system shared memory (loadgen --client shm)")
    p.add_argument("--ids-dtype", choices=IDS_DTYPES, default="int64",
                   help="sparse_indices as this tree's sixfold servers get them (default int64; int32: half the "
                        "bytes); --baseline-tree's server and MLServer always get int64")
    p.add_argument("--baseline-tree", metavar="DIR",
                   help="also serve with the code in DIR (e.g. `git archive COMMIT | tar -x -C DIR`), first on "
                        "PYTHONPATH with this venv: 'sixfold-before', in the same rotated runs as 'sixfold'")
    p.add_argument("--mlserver-batch-size", type=int, default=8, help="MLServer max_batch_size, requests (default 8)")
    p.add_argument("--mlserver-batch-time", type=float, default=0.004,
                   help="MLServer max_batch_time, seconds (default 0.004)")
    p.add_argument("--quick", action="store_true", help="a smoke run of about 1 minute (dlrm-mlperf, 2 s steps)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    p.add_argument("--json", help="write every figure (all steps of every search) here")
    args = p.parse_args(argv)
    q = args.quick
    args.models = [m for m in (args.models or ("dlrm-mlperf" if q else "dlrm-mlperf,rm2")).split(",") if m]
    args.max_rows = args.max_rows or (20_000 if q else 50_000)
    args.p99_ms = args.p99_ms or ([60.0] if q else [60.0, 250.0])
    args.step = args.step or (2.0 if q else 5.0)
    args.warmup = args.warmup if args.warmup is not None else (0.5 if q else 1.0)
    args.max_steps = args.max_steps or (3 if q else 8)
    args.tolerance = args.tolerance or (0.5 if q else 0.15)
    args.offline_batches = args.offline_batches or ([256, 1024] if q else [64, 128, 256, 512, 1024, 2048])
    args.offline_s = 0.3 if q else 1.0
    args.warmup_run = 1.0 if q else 2.0
    args.idle_repeats = 3 if q else 5
    args.offline_again = not q
    if args.ids_dtype != "int64":
        for name in TAKES_IDS_DTYPE:
            LABEL[name] += f", {args.ids_dtype.upper()} ids"
    args.check_sizes = (100, 270, 700)
    args.saturation = [c for c in (args.saturation if args.saturation is not None else ([8] if q else [4, 8, 16]))
                       if c > 0]
    args.saturation_s = args.saturation_s or (2.0 if q else 5.0)
    for m in args.models:
        models.get_config(m)  # an unknown name fails here, listing the names that exist

    # SIGTERM runs the finally blocks that stop the servers (SIGKILL is covered by PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch
    from rich.console import Console

    console = Console(stderr=True, highlight=False)
    ml = "MLServer not installed" if mlserver_missing() else f"mlserver {mlserver_version()}"
    load_at_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in args.models}
    for run in range(args.runs):
        for model in args.models:
            results[model].append(run_model(model, run, args, console))
    wall = time.perf_counter() - t0
    machine = machine_line(f"torch {torch.__version__}", ml,
                           f"load average {load_at_start:.1f} at start, {os.getloadavg()[0]:.1f} at end")
    summary = summarize(results, args)
    text = format_section(summary, results, args, argv, wall, machine)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "summary": summary},
                                              indent=2, default=str) + "\n")
    if not args.no_write:
        write_section(SECTION, text)
        log(f"wrote the {SECTION} section of BENCHMARKS.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
