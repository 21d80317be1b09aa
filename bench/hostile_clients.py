"""Hostile clients: huge requests and a SIGTERM with requests on the wire, before and after the limits.

Two experiments, each against real ``sixfold-serve`` processes (rm2, 50k-row tables, 6 simcards)
started one after another with different settings, so the figures sit side by side in one run:

  large    ``--requests`` (10) concurrent requests of ``--request-mb`` (100) MB each, sent at once.
           Per setting: what the clients got (by status), the server's RSS before, its peak
           (VmHWM, the kernel's own high-water mark) and 5 s after the burst.
  sigterm  ``--inflight`` (200) small requests (1-8 items) sent over one second, then SIGTERM
           right after the last send. Every request was sent before the signal, so each must be
           answered: counted by status, and "unanswered" if no answer came within 60 s.

    .venv/bin/python bench/hostile_clients.py                   # both, writes BENCHMARKS.md
    .venv/bin/python bench/hostile_clients.py --only sigterm --no-write
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


def _outcomes(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items(), key=lambda kv: (kv[0] != "OK", kv[0])))


def render(large: list[LargeResult], sigterm: list[SigtermResult], argv: list[str], wall_s: float) -> str:
    lines = ["## Hostile clients: huge requests, SIGTERM with requests on the wire", "",
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
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["large", "sigterm"], help="run one experiment (default: both)")
    p.add_argument("--requests", type=int, default=10, help="concurrent large requests (default 10)")
    p.add_argument("--request-mb", type=float, default=100.0, help="size of each large request (default 100 MB)")
    p.add_argument("--inflight", type=int, default=200, help="requests on the wire at SIGTERM (default 200)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    large = run_large(args.request_mb, args.requests) if args.only in (None, "large") else []
    sigterm = run_sigterm(args.inflight) if args.only in (None, "sigterm") else []
    if args.json:
        write_json(args.json, {"large": [asdict(r) for r in large], "sigterm": [asdict(s) for s in sigterm]})
    publish("hostile-clients", render(large, sigterm, sys.argv[1:] if argv is None else argv,
                                      time.monotonic() - t0), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
