"""Serving overhead benchmark: sixfold on a trivial model vs a bare grpc.aio echo server, both under perf_analyzer.

Goal: sixfold's throughput on the ``tiny`` model (3 x 100 rows, dim 8: compute ~0) is at
least 0.9 x that of the floor of any Python gRPC server, at perf_analyzer ``--concurrency-range 16``.

Servers, each in its own process (perf_analyzer, a C++ process, drives both the same way):
  sixfold  ``sixfold-serve --model tiny --cards 6 --grpc-port 0 --metrics-port -1``, as a user
           would start it (simulated cards; the batcher, routing and stats as in production)
  echo     this file with ``--echo-server``: a bare grpc.aio server on uvloop (like sixfold)
           implementing only what perf_analyzer calls: ServerLive/Ready, ModelReady,
           ModelMetadata and ModelConfig (copied verbatim from sixfold's answers), ModelStatistics
           (real counters) and ModelInfer, which answers ``scores`` FP32 [N, 1] zeros as raw
           output contents. No decoding, no batching, no model.

Each run is one perf_analyzer run per (query size, server): ``--concurrency-range 16``
(its default sync mode: 16 client threads), ``--measurement-interval`` ms windows, 3 windows
(``--max-trials 3``; the stability check is opened wide so a run never aborts, and
the report is over the 3 windows). Servers are interleaved with the order rotated every run
(sixfold, echo / echo, sixfold); the report is the median over ``--runs`` runs of infer/s and
of perf_analyzer's p50/p99 latency, and the median of the per-run ratios. Requests: 8
different ``RequestGenerator`` queries of the same size (seeded), cycled by perf_analyzer.
CPU per request, of the server (/proc) and of perf_analyzer (rusage), over the whole
perf_analyzer run divided by the requests ModelStatistics counted, says where a 2-core
machine's time goes.

NVIDIA Triton (``make triton-venv``; ``bench/triton_peer/serve.py``: tritonserver 2.51 of the nvidia-pytriton
wheel, Python backend) is measured the same way on the same model, twice: ``triton`` runs the tiny model
in torch (1 instance, no batching, as the latency bench's), ``triton empty`` answers zeros with no model
(``--empty``): what Triton's own request path costs. Its CPU is its whole process group's (the script,
tritonserver and the Python-backend stub). ``--skip-triton`` leaves both out; without ``.venv-triton``
they are left out with the reason.

Several front-end processes (``--workers 1 2 4``: ``sixfold-serve --workers N``, N front ends on one
port over one engine) and several echo processes on one port (``--echo-processes 1 4``) are measured side
by side; the first echo server is every ratio's baseline. Their CPU is summed over all their processes
(supervisor, engine and front ends), their requests from the engine's statistics (on its Unix socket in
the run folder), or over each echo process's (on Unix sockets of their own). ``--concurrency`` sets
perf_analyzer's; ``--perf-analyzer`` another copy of it (a lent machine without the shared tools).

    .venv/bin/python bench/serving_overhead.py              # writes the section into BENCHMARKS.md
    .venv/bin/python bench/serving_overhead.py --workers 1 2 4 8 --echo-processes 1 4 --concurrency 64 --no-write
    .venv/bin/python bench/serving_overhead.py --quick --no-write
    .venv/bin/python bench/serving_overhead.py --serve-arg=--max-queue-delay-us=0   # other sixfold flags
    .venv/bin/python bench/serving_overhead.py --echo-server --port 0 --model-from 127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._thread_cpu import group_pids  # noqa: E402
from bench.harness.bench_server import serve_until_signalled  # noqa: E402
from bench.harness.peers import TRITON_PYTHON, triton_missing  # noqa: E402
from bench.harness.report import publish  # noqa: E402
from sixfold.server.workers.engine_channel import ENGINE_GRPC_SOCKET  # noqa: E402
from sixfold.server.workers.process import ReadyProcess  # noqa: E402

SECTION = "serving-overhead"
COMMAND = ".venv/bin/python bench/serving_overhead.py"
TOOL = ROOT.parent / "shared" / "tools" / "perf_analyzer"
MODEL = "tiny"
CONCURRENCY = 16
GOAL = 0.9
"""Issue 14's: sixfold / echo >= 0.9 at 1 and 16 items (it was 0.8 until 2026-11-24's re-measure)."""


# ----------------------------------------------------------------------------------------------
# The echo server (runs in its own process: ``--echo-server``)


def _echo_servicer(metadata, config):
    """A GRPCInferenceServiceServicer with only what perf_analyzer needs; answers zeros."""
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    name, version = metadata.name, (metadata.versions[0] if metadata.versions else "1")
    output = metadata.outputs[0]
    batch_input = metadata.inputs[0].name  # its first dim is the query's item count N

    class EchoServicer(service_pb2_grpc.GRPCInferenceServiceServicer):
        def __init__(self) -> None:
            self.requests = self.items = self.ns = 0
            self.last_ms = 0

        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

        async def ServerMetadata(self, request, context):
            return pb.ServerMetadataResponse(name="echo", version="0", extensions=["statistics"])

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=request.name == name)

        async def ModelMetadata(self, request, context):
            return metadata

        async def ModelConfig(self, request, context):
            return config

        async def ModelStatistics(self, request, context):
            d = pb.StatisticDuration
            zero = d(count=self.requests, ns=0)
            stats = pb.InferStatistics(success=d(count=self.requests, ns=self.ns), fail=d(), queue=zero,
                                       compute_input=zero, compute_infer=d(count=self.requests, ns=self.ns),
                                       compute_output=zero)
            response = pb.ModelStatisticsResponse()
            response.model_stats.add(name=name, version=version, last_inference=self.last_ms,
                                     inference_count=self.items, execution_count=self.requests,
                                     inference_stats=stats)
            return response

        async def ModelInfer(self, request, context):
            t0 = time.perf_counter_ns()
            n = next((t.shape[0] for t in request.inputs if t.name == batch_input and t.shape), 1)
            response = pb.ModelInferResponse(model_name=name, model_version=version, id=request.id)
            response.outputs.add(name=output.name, datatype=output.datatype, shape=[n, 1])
            response.raw_output_contents.append(bytes(4 * n))
            self.requests += 1
            self.items += n
            self.ns += time.perf_counter_ns() - t0
            self.last_ms = int(time.time() * 1000)
            return response

    return EchoServicer()


def _model_protos(url: str, model: str):
    """ModelMetadata and ModelConfig responses of ``model`` from the KServe v2 server at ``url``."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        return (stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=30),
                stub.ModelConfig(pb.ModelConfigRequest(name=model), timeout=30))


async def _serve_echo(host: str, port: int, metadata, config, stats_socket: str | None = None) -> None:
    import grpc
    from tritonclient.grpc import service_pb2_grpc

    # NOTE: the same message limits as sixfold's server (ServerConfig.max_message_bytes).
    options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    server = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(_echo_servicer(metadata, config), server)
    bound = server.add_insecure_port(f"{host}:{port}")  # grpc's default SO_REUSEPORT: several echo processes share it
    if stats_socket:  # the driver counts each process's requests here, whichever of them a channel reached
        server.add_insecure_port(f"unix:{stats_socket}")
    await serve_until_signalled(server, f"{host}:{bound}")


def echo_main(host: str, port: int, model_from: str, model: str, stats_socket: str | None = None) -> int:
    import uvloop

    metadata, config = _model_protos(model_from, model)
    uvloop.run(_serve_echo(host, port, metadata, config, stats_socket))
    return 0


# ----------------------------------------------------------------------------------------------
# The driver


class Child(ReadyProcess):
    """A server command in its own process; ``url`` is set once it prints ``READY grpc=HOST:PORT``.

    ``stop()`` (always called, in a finally) sends SIGTERM, then SIGKILL after a few seconds.
    """

    def __init__(self, name: str, cmd: list[str], timeout_s: float = 180.0, start_new_session: bool = False) -> None:
        self.name = name
        super().__init__(cmd, cwd=ROOT, timeout_s=timeout_s, start_new_session=start_new_session)
        if not self.url:
            self.stop()
            raise RuntimeError(f"{name} did not start:\n" + "".join(self.lines[-30:]))


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used so far (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    """One server under test: its processes (a supervisor and its workers, or N echo processes on one
    port), their CPU together, and the requests they answered together."""

    def __init__(self, name: str, children: list[Child], *, pids: list[int], stats_urls: list[str]) -> None:
        self.name, self.children, self.pids, self.stats_urls = name, children, pids, stats_urls
        self.url = children[0].url

    def cpu_s(self) -> float:
        return sum(cpu_s(pid) for pid in self.pids)

    def successes(self) -> int:
        return sum(successes(url, MODEL) for url in self.stats_urls)

    def stop(self) -> None:
        for child in self.children[::-1]:
            child.stop()


def start_sixfold(name: str, workers: int, serve_args: list[str], workdir: Path) -> Server:
    """``sixfold-serve --model tiny --cards 6`` with ``workers`` front ends; requests counted by the engine."""
    cmd = [sys.executable, "-m", "sixfold.server.cli", "--model", MODEL, "--cards", "6", "--grpc-port", "0",
           "--metrics-port", "-1", "--http-port", "-1", "--drain-seconds", "0", "--workers", str(workers), *serve_args]
    child = Child(name, cmd)
    if workers == 1:
        return Server(name, [child], pids=[child.pid], stats_urls=[child.url])
    pids = [int(pid) for pid in re.findall(r"worker \d+ pid (\d+)", child.output)]
    folder = re.search(r"front ends share .* run folder (\S+)", child.output)
    sockets = [f"unix:{folder.group(1)}/{ENGINE_GRPC_SOCKET}"] if folder else []  # one engine counts them all
    return Server(name, [child], pids=[child.pid, *pids], stats_urls=sockets)


def start_echo(name: str, processes: int, model_from: str, workdir: Path) -> Server:
    """``processes`` echo servers on one port (the first picks it), each counting on its own Unix socket."""
    children: list[Child] = []
    port = 0
    try:
        for i in range(processes):
            stats = workdir / f"{name}-{i}.sock"
            children.append(Child(f"{name}-{i}", [sys.executable, str(Path(__file__).resolve()), "--echo-server",
                                                  "--port", str(port), "--model-from", model_from,
                                                  "--stats-socket", str(stats)]))
            port = int(children[0].url.rsplit(":", 1)[1])
    except BaseException:
        for child in children:
            child.stop()
        raise
    return Server(name, children, pids=[c.pid for c in children],
                  stats_urls=[f"unix:{workdir / f'{name}-{i}.sock'}" for i in range(processes)])


TRITONS = {"triton": [], "triton empty": ["--empty"]}
"""The Triton servers measured, by name: ``bench/triton_peer/serve.py`` flags."""


def start_triton(name: str) -> Server:
    """``bench/triton_peer/serve.py`` on the tiny model in its own process group (the script, tritonserver, the stub)."""
    from bench.harness.process import free_port

    cmd = [str(TRITON_PYTHON), str(ROOT / "bench" / "triton_peer" / "serve.py"), "--model", MODEL, "--max-rows", "100",
           "--grpc-port", str(free_port()), "--http-port", str(free_port()), "--metrics-port", str(free_port()),
           *TRITONS[name]]
    child = Child(name, cmd, start_new_session=True)
    return Server(name, [child], pids=group_pids(child.pid), stats_urls=[child.url])


def children_cpu_s() -> float:
    """CPU seconds of this process's finished, waited-for children (perf_analyzer runs; servers still run)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def successes(url: str, model: str) -> int:
    """Requests the server answered so far (ModelStatistics' success count)."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    with grpc.insecure_channel(url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        stats = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=30)
    return int(stats.model_stats[0].inference_stats.success.count)


def write_input_data(items: int, path: Path, entries: int = 8, seed: int = 0) -> Path:
    """``entries`` different ``tiny`` queries of ``items`` items as perf_analyzer --input-data JSON."""
    from sixfold import models
    from sixfold.loadgen.export import write_perf_analyzer_json

    gen = models.RequestGenerator.for_config(models.get_config(MODEL), seed=seed + items)
    return write_perf_analyzer_json((gen.make(items) for _ in range(entries)), path)[0]


@dataclass
class Run:
    infer_per_s: float
    p50_us: float
    p99_us: float
    cpu_us_per_req: float | None  # server CPU per request over the whole perf_analyzer run
    client_cpu_us_per_req: float | None  # perf_analyzer's own CPU per request, the same way


def perf_analyzer(url: str, data: Path, csv_path: Path, interval_ms: int, trials: int,
                  concurrency: int = CONCURRENCY) -> tuple[float, float, float]:
    """One perf_analyzer run at ``concurrency``: (infer/s, p50 us, p99 us) from its CSV report."""
    cmd = [str(TOOL), "-m", MODEL, "-i", "grpc", "-u", url, "--input-data", str(data),
           "--concurrency-range", f"{concurrency}", "--measurement-interval", str(interval_ms),
           # NOTE: max/min within 1000% always holds: the run is exactly ``trials`` windows and
           # never aborts as unstable on a noisy shared machine (medians over runs smooth it).
           "--stability-percentage", "1000", "--max-trials", str(trials), "-f", str(csv_path)]
    csv_path.unlink(missing_ok=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=60 + 3 * trials * interval_ms / 1000)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    if proc.returncode != 0 or not csv_path.exists():
        raise RuntimeError(f"perf_analyzer failed (rc {proc.returncode}): {' '.join(cmd)}\n{output[-3000:]}")
    with open(csv_path, newline="") as f:
        row = next(csv.DictReader(f))
    return float(row["Inferences/Second"]), float(row["p50 latency"]), float(row["p99 latency"])


@dataclass
class Result:
    names: list[str]
    runs: dict[str, list[Run]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.runs = {name: [] for name in self.names}

    def median(self, server: str, key: str) -> float:
        values = [getattr(r, key) for r in self.runs[server] if getattr(r, key) is not None]
        return statistics.median(values) if values else float("nan")

    def ratios(self, server: str = "sixfold", baseline: str = "echo") -> list[float]:
        return [s.infer_per_s / e.infer_per_s for s, e in zip(self.runs[server], self.runs[baseline])]


def sixfold_name(workers: int) -> str:
    return "sixfold" if workers == 1 else f"sixfold x{workers}"


def echo_name(processes: int) -> str:
    return "echo" if processes == 1 else f"echo x{processes}"


def bench(sizes: list[int], runs: int, interval_ms: int, trials: int, workdir: Path,
          serve_args: list[str] = (), workers: list[int] = (1,), echo_processes: list[int] = (1,),
          concurrency: int = CONCURRENCY, variants: list[str] = (), tritons: list[str] = ()) -> dict[int, Result]:
    servers: dict[str, Server] = {}
    try:
        for w in workers:
            servers[sixfold_name(w)] = start_sixfold(sixfold_name(w), w, list(serve_args), workdir)
        for variant in variants:  # LABEL=ARGS: one more sixfold server, side by side with the others
            label, _, extra = variant.partition("=")
            name, words = f"sixfold {label}", extra.split()
            count = int(words[words.index("--workers") + 1]) if "--workers" in words else 1
            servers[name] = start_sixfold(name, count, [*serve_args, *words], workdir)
        model_from = next(iter(servers.values())).url
        for e in echo_processes:
            servers[echo_name(e)] = start_echo(echo_name(e).replace(" ", ""), e, model_from, workdir)
        for name in tritons:
            servers[name] = start_triton(name)
        names = list(servers)
        data = {n: write_input_data(n, workdir / f"input-{n}.json") for n in sizes}
        csv_path = workdir / "pa.csv"
        for name, server in servers.items():  # warm up: connections, allocator, sixfold's first batches
            perf_analyzer(server.url, data[sizes[0]], csv_path, min(interval_ms, 500), 3, concurrency)
            print(f"  warmed up {name}", file=sys.stderr)
        results = {n: Result(names) for n in sizes}
        for r in range(runs):
            for n in sizes:
                order = names if (r + sizes.index(n)) % 2 == 0 else names[::-1]
                for name in order:
                    server = servers[name]
                    count0, cpu0, client0 = server.successes(), server.cpu_s(), children_cpu_s()
                    ips, p50, p99 = perf_analyzer(server.url, data[n], csv_path, interval_ms, trials, concurrency)
                    cpu, client = server.cpu_s() - cpu0, children_cpu_s() - client0
                    count = server.successes() - count0
                    per_req = (lambda s: s / count * 1e6) if count > 0 else (lambda s: None)
                    results[n].runs[name].append(Run(ips, p50, p99, per_req(cpu), per_req(client)))
                print(f"  run {r + 1}/{runs} items={n}: " + ", ".join(
                    f"{name} {results[n].runs[name][-1].infer_per_s:,.0f}" for name in names) + " infer/s",
                    file=sys.stderr)
        return results
    finally:
        for server in servers.values():
            server.stop()


def format_section(results: dict[int, Result], args: argparse.Namespace, argv: list[str], wall: float) -> str:
    import grpc

    machine = (f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
               f"grpcio {grpc.__version__}, perf_analyzer 2.41.0, {time.strftime('%Y-%m-%d')}, "
               f"load average {os.getloadavg()[0]:.2f} at the end")
    runs = args.runs
    serve = " ".join(["sixfold-serve --model tiny --cards 6", *args.serve_arg])
    names = next(iter(results.values())).names
    baseline = echo_name(args.echo_processes[0])
    lines = [
        "## Serving overhead (sixfold on `tiny` vs a bare grpc.aio echo server)",
        "",
        f"Command: `{(COMMAND + ' ' + ' '.join(argv)).strip()}` ({wall:.0f} s; {machine}).",
        f"perf_analyzer `--concurrency-range {args.concurrency}` (sync, {args.concurrency} client threads) on the "
        f"same machine, {args.trials} windows of {args.interval_ms} ms per run; servers interleaved, order rotated "
        f"every run; medians of {runs} runs, the ratio is the median of per-run ratios. Each server is its own "
        f"process (`{serve}`, `--workers N` for sixfold xN: N processes on one port; the echo server: "
        f"`bench/serving_overhead.py --echo-server`, echo xN: N of them on one port). "
        f"Queries: 8 seeded `RequestGenerator` queries of the given size, cycled. "
        f"CPU columns: CPU time (user + system) over the whole perf_analyzer run divided by the requests "
        f"the server answered in it (server: /proc, all its processes; perf_analyzer: rusage of the finished child).",
        "",
        "| items/query | server | infer/s per run | infer/s (median) | p50 ms | p99 ms | server CPU us/request "
        f"| perf_analyzer CPU us/request | / {baseline} (median of per-run ratios) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for n, res in results.items():
        for name in names:
            per_run = ", ".join(f"{r.infer_per_s:,.0f}" for r in res.runs[name])
            cpu, client = res.median(name, "cpu_us_per_req"), res.median(name, "client_cpu_us_per_req")
            ratio = statistics.median(res.ratios(name, baseline)) if name != baseline else None
            lines.append(f"| {n} | {name} | {per_run} | {res.median(name, 'infer_per_s'):,.0f} "
                         f"| {res.median(name, 'p50_us') / 1e3:.2f} | {res.median(name, 'p99_us') / 1e3:.2f} "
                         f"| {cpu:,.0f} | {client:,.0f} | {f'**{ratio:.3f}**' if ratio is not None else ''} |")
            if name.startswith("sixfold"):
                verdicts.append(f"{name} {ratio:.3f} at {n} item(s)/query ({'met' if ratio >= GOAL else 'NOT met'})")
    per_run = "; ".join(f"{name}, {n} item(s): " + ", ".join(f"{x:.3f}" for x in res.ratios(name, baseline))
                        for n, res in results.items() for name in names if name.startswith("sixfold"))
    lines += ["", f"Goal: sixfold / {baseline} throughput >= {GOAL}: {'; '.join(verdicts)}. Per-run ratios: {per_run}."]
    if "triton empty" in names:
        against = "; ".join(
            f"{name} / triton empty at {n} item(s): "
            f"{statistics.median(res.ratios(name, 'triton empty')):.3f}"
            for n, res in results.items() for name in names if name.startswith("sixfold"))
        lines += ["", f"Against Triton's own request path (its Python backend answering zeros, no model; goal: "
                  f"sixfold with 2 front ends above it): {against}."]
    if args.triton_skipped:
        lines += ["", f"Triton: {args.triton_skipped}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    global TOOL
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="perf_analyzer runs per server and size (median reported)")
    parser.add_argument("--items", type=int, nargs="+", default=[1, 16], help="query sizes (items per request)")
    parser.add_argument("--interval-ms", type=int, default=1500, help="perf_analyzer measurement window (ms)")
    parser.add_argument("--trials", type=int, default=3,
                        help="measurement windows per perf_analyzer run (at least 3: its stability check needs 3)")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                        help="extra sixfold-serve argument, e.g. --serve-arg=--max-queue-delay-us=0 (repeatable)")
    parser.add_argument("--quick", action="store_true", help="2 runs of 3 x 500 ms windows, 1 item (a smoke run)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    parser.add_argument("--echo-server", action="store_true", help="serve the echo server (and nothing else)")
    parser.add_argument("--host", default="127.0.0.1", help="with --echo-server: address to bind")
    parser.add_argument("--port", type=int, default=0, help="with --echo-server: gRPC port (0: a free one)")
    parser.add_argument("--model-from", metavar="HOST:PORT",
                        help="with --echo-server: copy the model's metadata and config from this KServe v2 server")
    parser.add_argument("--model", default=MODEL, help="with --echo-server: the model to copy and answer for")
    parser.add_argument("--stats-socket", help="with --echo-server: also serve on this Unix socket (request counts)")
    parser.add_argument("--workers", type=int, nargs="+", default=[1], metavar="N",
                        help="sixfold servers to measure, by worker processes (sixfold-serve --workers N; default 1)")
    parser.add_argument("--echo-processes", type=int, nargs="+", default=[1], metavar="N",
                        help="echo servers to measure, by processes on one port (default 1); the first is the "
                             "baseline of the ratios")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                        help="one more sixfold server with these extra sixfold-serve arguments, measured side by "
                             "side (repeatable), e.g. --variant 'window=--no-all-in-dispatch'")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY,
                        help=f"perf_analyzer's concurrency (default {CONCURRENCY})")
    parser.add_argument("--perf-analyzer", type=Path, default=None, help=f"perf_analyzer command (default {TOOL})")
    parser.add_argument("--skip-triton", action="store_true", help="leave the Triton servers out")
    args = parser.parse_args(argv)
    if args.echo_server:
        if not args.model_from:
            parser.error("--echo-server needs --model-from HOST:PORT (a running sixfold-serve)")
        return echo_main(args.host, args.port, args.model_from, args.model, args.stats_socket)
    if args.quick:
        args.runs, args.items, args.interval_ms = 2, [1], 500
    args.trials = max(args.trials, 3)
    TOOL = args.perf_analyzer or TOOL
    if not TOOL.exists():
        print(f"serving_overhead: skipped: perf_analyzer not found at {TOOL}", file=sys.stderr)
        return 0
    args.triton_skipped = "left out (--skip-triton)" if args.skip_triton else triton_missing()
    tritons = [] if args.triton_skipped else list(TRITONS)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp:
        results = bench(args.items, args.runs, args.interval_ms, args.trials, Path(tmp), args.serve_arg,
                        args.workers, args.echo_processes, args.concurrency, args.variant, tritons)
    text = format_section(results, args, argv, time.perf_counter() - t0)
    publish(SECTION, text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
