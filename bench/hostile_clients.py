"""Hostile clients: huge requests, slow connections and a SIGTERM with requests on the wire, before and after the limits.

Three experiments, each against real ``sixfold-serve`` processes (rm2, 50k-row tables, 6 simcards)
started one after another with different settings, so the figures sit side by side in one run:

  large    ``--requests`` (10) concurrent requests of ``--request-mb`` (100) MB each, sent at once.
           Per setting: what the clients got (by status), the server's RSS before, its peak
           (VmHWM, the kernel's own high-water mark) and 5 s after the burst.
  sigterm  ``--inflight`` (200) small requests (1-8 items) sent over one second, then SIGTERM
           right after the last send. Every request was sent before the signal, so each must be
           answered: counted by status, and "unanswered" if no answer came within 60 s.
  slow     ``--slow-connections`` (2000; issue 33 used 20,000) connections spread over the gRPC, REST
           and /metrics ports, each sending a request (or the HTTP/2 preface) a byte every
           ``--slow-interval-s`` for ``--slow-duration-s``, with the limits off (before) and at their
           defaults (after, docs/serving.md "Limits"). Meanwhile, every 0.5 s: gRPC inference on a
           connection opened before them, REST health and /metrics on new connections. Reported:
           their latencies and failures, the slow connections the server closed, its peak threads
           and open files.

    .venv/bin/python bench/hostile_clients.py                   # both, writes BENCHMARKS.md
    .venv/bin/python bench/hostile_clients.py --only sigterm --no-write
    .venv/bin/python bench/hostile_clients.py --only slow --max-rows 2000 --slow-connections 600 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tritonclient.grpc.aio as tca  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from sixfold import models  # noqa: E402
from bench.harness.commands import command  # noqa: E402
from bench.harness.report import machine_line, publish, write_json  # noqa: E402
from sixfold.server.workers.process import ReadyProcess  # noqa: E402
from tests.conftest import triton_inputs  # noqa: E402

MODEL, MAX_ROWS = "rm2", 50_000
COMMAND = ".venv/bin/python bench/hostile_clients.py"

LARGE_SETTINGS = [  # (setting, sixfold-serve flags, request size: None is --request-mb)
    ("before (1 GiB messages, queue unbounded in bytes and work)",
     ["--max-message-mb", "1024", "--max-queue-bytes-mb", "0", "--max-queue-work-ms", "0", "--default-timeout-us", "0"],
     None),
    ("after (defaults: 64 MiB messages, 512 MiB of queued bytes, 30 ms of queued work)", [], None),
    ("after, requests just under the 64 MiB limit", [], 60.0),
]
SLOW_SETTINGS = {
    "before (limits off: no header or handshake timeout, no connection cap)":
        ["--header-timeout-s", "0", "--handshake-timeout-s", "0", "--max-connections", "0",
         "--grpc-idle-timeout-s", "0"],
    "after (defaults)": [],
}
SIGTERM_SETTINGS = {  # no work bound in either: this is about shutdown, not admission
    "before (--drain-seconds 0)": ["--drain-seconds", "0", "--max-queue-work-ms", "0"],
    "after (default: --drain-seconds 5)": ["--max-queue-work-ms", "0"],
}


def _status_mb(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def _start(extra: list[str]) -> ReadyProcess:
    cmd = [*command("sixfold-serve"), "--model", MODEL, "--max-rows", str(MAX_ROWS),
           "--cards", "6", "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1",
           "--log-level", "WARNING", *extra]
    server = ReadyProcess(cmd, timeout_s=300)
    if not server.url:
        server.kill()
        raise RuntimeError(f"sixfold-serve did not start:\n{server.output}")
    return server


def _status(exc: BaseException) -> str:
    if isinstance(exc, InferenceServerException):
        return (exc.status() or "error").replace("StatusCode.", "")
    return type(exc).__name__


@dataclass
class LargeResult:
    setting: str
    request_mb: float
    outcomes: dict[str, int] = field(default_factory=dict)
    rss_mb: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0


async def _large(url: str, request: dict[str, np.ndarray], count: int) -> Counter:
    inputs = triton_inputs(tca, request)
    client = tca.InferenceServerClient(url, channel_args=[("grpc.max_send_message_length", (1 << 31) - 1),
                                                          ("grpc.max_receive_message_length", (1 << 31) - 1)])

    async def one() -> str:
        try:
            await client.infer(MODEL, inputs, client_timeout=120)
            return "OK"
        except Exception as exc:  # noqa: BLE001 - every outcome is counted
            return _status(exc)

    try:
        return Counter(await asyncio.gather(*(one() for _ in range(count))))
    finally:
        await client.close()


def run_large(request_mb: float, count: int) -> list[LargeResult]:
    gen = models.RequestGenerator.for_config(models.get_config(MODEL, max_rows=MAX_ROWS), seed=5)
    sample = gen.make(100)
    per_item = sum(a.nbytes for a in sample.values()) / 100
    results = []
    for setting, extra, mb in LARGE_SETTINGS:
        request = gen.make(int(math.ceil((mb or request_mb) * 1e6 / per_item)))
        size_mb = sum(a.nbytes for a in request.values()) / 1e6
        server = _start(extra)
        try:
            time.sleep(1.0)
            result = LargeResult(setting, round(size_mb, 1))
            result.rss_mb["before"] = round(_status_mb(server.pid, "VmRSS"))
            t0 = time.monotonic()
            result.outcomes = dict(asyncio.run(_large(server.url, request, count)))
            result.wall_s = round(time.monotonic() - t0, 2)
            result.rss_mb["peak"] = round(_status_mb(server.pid, "VmHWM"))
            time.sleep(5.0)
            result.rss_mb["5 s after"] = round(_status_mb(server.pid, "VmRSS"))
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
        finally:
            server.stop()
    return results


@dataclass
class SigtermResult:
    setting: str
    sent: int
    outcomes: dict[str, int] = field(default_factory=dict)
    exit_code: int | None = None
    exit_s: float = 0.0
    """From SIGTERM to the process's exit."""


async def _sigterm(server: ReadyProcess, request_count: int) -> tuple[Counter, float]:
    gen = models.RequestGenerator.for_config(models.get_config(MODEL, max_rows=MAX_ROWS), seed=6)
    rng = np.random.default_rng(6)
    requests = [triton_inputs(tca, gen.make(int(rng.integers(1, 9)))) for _ in range(request_count)]
    client = tca.InferenceServerClient(server.url)

    async def one(inputs: list) -> str:
        try:
            await client.infer(MODEL, inputs, client_timeout=60)
            return "OK"
        except Exception as exc:  # noqa: BLE001 - every outcome is counted
            status = _status(exc)
            return "unanswered (60 s)" if status == "DEADLINE_EXCEEDED" else status

    try:
        tasks, gap, start = [], 1.0 / request_count, time.monotonic()
        for i, inputs in enumerate(requests):
            await asyncio.sleep(max(0.0, start + i * gap - time.monotonic()))
            tasks.append(asyncio.ensure_future(one(inputs)))
        await asyncio.sleep(0)  # the last request's send starts before the signal
        os.kill(server.pid, signal.SIGTERM)
        signalled = time.monotonic()
        outcomes = Counter(await asyncio.gather(*tasks))
        return outcomes, signalled
    finally:
        await client.close()


def run_sigterm(count: int) -> list[SigtermResult]:
    results = []
    for setting, extra in SIGTERM_SETTINGS.items():
        server = _start(extra)
        try:
            outcomes, signalled = asyncio.run(_sigterm(server, count))
            code = server.proc.wait(timeout=120)
            result = SigtermResult(setting, count, dict(outcomes), code, round(time.monotonic() - signalled, 2))
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
        finally:
            server.kill()
    return results


@dataclass
class SlowResult:
    setting: str
    connections: int
    quiet_ms: dict[str, float] = field(default_factory=dict)
    """gRPC inference on the open connection before the slow connections: p50, p99."""
    busy_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """While they dribble, per probe (grpc, health, metrics): p50, p99, max, failed."""
    closed_by_server: int = 0
    peak_threads: int = 0
    peak_open_files: int = 0


def _summary(values: list[float], failed: int) -> dict[str, float]:
    ms = np.array(values) * 1e3 if values else np.array([np.nan])
    return {"p50": round(float(np.percentile(ms, 50)), 1), "p99": round(float(np.percentile(ms, 99)), 1),
            "max": round(float(np.max(ms)), 1), "failed": failed}


async def _dribble(host: str, port: int, line: bytes, interval_s: float, until: float) -> bool:
    """One slow connection: a byte of ``line`` every ``interval_s`` until ``until``; True if the server closed it."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError):
        return True  # refused or not accepted: the server did not hold it
    try:
        for i in range(len(line)):
            if time.monotonic() >= until:
                return False
            writer.write(line[i:i + 1])
            try:
                if await asyncio.wait_for(reader.read(4096), interval_s) == b"":
                    return True
            except asyncio.TimeoutError:
                pass
        return False
    except OSError:
        return True
    finally:
        writer.transport.abort()


async def _slow(server: ReadyProcess, ports: dict[str, int], count: int, interval_s: float, duration_s: float,
                setting: str) -> SlowResult:
    import urllib.request

    host = "127.0.0.1"
    request = triton_inputs(tca, models.RequestGenerator.for_config(models.get_config(MODEL, max_rows=MAX_ROWS),
                                                                   seed=7).make(4))
    client = tca.InferenceServerClient(server.url)
    result = SlowResult(setting, count)

    async def timed(call) -> float | None:
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(call(), 10)
            return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - a failure is counted, not raised
            return None

    def fetch(url: str) -> None:
        urllib.request.urlopen(url, timeout=10).read()

    probes = {"grpc": lambda: client.infer(MODEL, request, client_timeout=10),
              "health": lambda: asyncio.to_thread(fetch, f"http://{host}:{ports['http']}/v2/health/ready"),
              "metrics": lambda: asyncio.to_thread(fetch, f"http://{host}:{ports['metrics']}/metrics")}
    try:
        quiet = [await timed(probes["grpc"]) for _ in range(20)]
        result.quiet_ms = _summary([q for q in quiet if q is not None], quiet.count(None))
        lines = {"grpc": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                 "http": b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n",
                 "metrics": b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"}
        until = time.monotonic() + duration_s
        names = list(lines)
        slow = [asyncio.ensure_future(_dribble(host, ports[names[i % 3]], lines[names[i % 3]], interval_s, until))
                for i in range(count)]
        seen: dict[str, list[float | None]] = {name: [] for name in probes}
        while time.monotonic() < until:
            for name, probe in probes.items():
                seen[name].append(await timed(probe))
            result.peak_threads = max(result.peak_threads, round(_status_mb(server.pid, "Threads") * 1024))
            result.peak_open_files = max(result.peak_open_files, len(os.listdir(f"/proc/{server.pid}/fd")))
            await asyncio.sleep(0.5)
        result.closed_by_server = sum(await asyncio.gather(*slow))
        result.busy_ms = {name: _summary([v for v in values if v is not None], values.count(None))
                          for name, values in seen.items()}
        return result
    finally:
        await client.close()


def run_slow(count: int, interval_s: float, duration_s: float) -> list[SlowResult]:
    from tests.conftest import free_port

    results = []
    for setting, extra in SLOW_SETTINGS.items():
        ports = {"http": free_port(), "metrics": free_port()}
        server = _start([*extra, "--http-port", str(ports["http"]), "--metrics-port", str(ports["metrics"])])
        ports["grpc"] = int(server.url.rsplit(":", 1)[1])
        try:
            result = asyncio.run(_slow(server, ports, count, interval_s, duration_s, setting))
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
        finally:
            server.stop()
    return results


def _outcomes(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: (kv[0] != "OK", kv[0])))


def render(large: list[LargeResult], sigterm: list[SigtermResult], argv: list[str], wall_s: float,
           slow: list[SlowResult] | None = None) -> str:
    lines = ["## Hostile clients: huge requests, SIGTERM with requests on the wire, slow connections", "",
             f"Command: `{(COMMAND + ' ' + ' '.join(argv)).strip()}` ({wall_s:.0f} s; "
             f"{machine_line(f'load average {os.getloadavg()[0]:.1f} at the end')}). "
             f"{MODEL} ({MAX_ROWS:,}-row tables) on 6 simcards, one `sixfold-serve` per setting, "
             "started one after another.", ""]
    if large:
        lines += [f"{sum(large[0].outcomes.values())} concurrent requests, sent at once. RSS of the server process "
                  "(MiB); peak is the kernel's high-water mark (VmHWM).",
                  "", "| setting | request | answers | RSS before | peak | 5 s after | wall |",
                  "|---|---:|---|---:|---:|---:|---:|"]
        for r in large:
            lines.append(f"| {r.setting} | {r.request_mb:g} MB | {_outcomes(r.outcomes)} | {r.rss_mb['before']:,.0f} | "
                         f"{r.rss_mb['peak']:,.0f} | {r.rss_mb['5 s after']:,.0f} | {r.wall_s:.1f} s |")
        lines.append("")
    if sigterm:
        lines += [f"{sigterm[0].sent} requests of 1-8 items sent over 1 s, SIGTERM right after the last send: every "
                  "request was on the wire before the signal. Both servers without the work bound "
                  "(`--max-queue-work-ms 0`), so what is measured is shutdown, not admission.", "",
                  "| setting | answers | exit code | SIGTERM to exit |", "|---|---|---:|---:|"]
        for s in sigterm:
            lines.append(f"| {s.setting} | {_outcomes(s.outcomes)} | {s.exit_code} | {s.exit_s:.1f} s |")
        lines.append("")
    if slow:
        lines += [f"{slow[0].connections} slow connections over the gRPC, REST and /metrics ports, a byte each per "
                  "interval; probes every 0.5 s meanwhile: gRPC inference on a connection opened before them (quiet "
                  "p99 beside it), REST health and /metrics on new connections. Milliseconds, p99 (failed).", "",
                  "| setting | gRPC quiet p99 | gRPC p99 | health p99 | /metrics p99 | slow ones closed by the server "
                  "| peak threads | peak open files |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in slow:
            cells = [f"{r.busy_ms[k]['p99']:g} ({r.busy_ms[k]['failed']:g})" for k in ("grpc", "health", "metrics")]
            lines.append(f"| {r.setting} | {r.quiet_ms['p99']:g} | {' | '.join(cells)} | {r.closed_by_server} of "
                         f"{r.connections} | {r.peak_threads} | {r.peak_open_files} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global MAX_ROWS
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["large", "sigterm", "slow"], help="run one experiment (default: all)")
    p.add_argument("--requests", type=int, default=10, help="concurrent large requests (default 10)")
    p.add_argument("--request-mb", type=float, default=100.0, help="size of each large request (default 100 MB)")
    p.add_argument("--inflight", type=int, default=200, help="requests on the wire at SIGTERM (default 200)")
    p.add_argument("--slow-connections", type=int, default=2000, help="slow connections (default 2000)")
    p.add_argument("--slow-interval-s", type=float, default=1.0, help="seconds between their bytes (default 1)")
    p.add_argument("--slow-duration-s", type=float, default=20.0, help="how long they dribble (default 20)")
    p.add_argument("--max-rows", type=int, default=50_000, help="rows per table (default 50,000)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    MAX_ROWS = args.max_rows
    t0 = time.monotonic()
    large = run_large(args.request_mb, args.requests) if args.only in (None, "large") else []
    sigterm = run_sigterm(args.inflight) if args.only in (None, "sigterm") else []
    slow = run_slow(args.slow_connections, args.slow_interval_s, args.slow_duration_s) \
        if args.only in (None, "slow") else []
    if args.json:
        write_json(args.json, {"large": [asdict(r) for r in large], "sigterm": [asdict(s) for s in sigterm],
                               "slow": [asdict(r) for r in slow]})
    publish("hostile-clients", render(large, sigterm, sys.argv[1:] if argv is None else argv,
                                      time.monotonic() - t0, slow), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
