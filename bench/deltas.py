"""Table deltas under load: a 1% row delta every 10 s against a full version swap.

rm2 (32 tables x --max-rows rows x dim 64 fp32; 500k rows is its full size, 3.8 GiB) is written
to a model repository (sixfold.partitioner.tables.build, streaming) and served by a real
``sixfold-serve`` process (explicit model control, 6 simcards, default batching). The bench
process drives it open loop (loadgen: Poisson at --qps, MLPerf query sizes, Zipf ids) through
three phases, one after another:

  none     --baseline s of load, no updates (the reference p99)
  deltas   --duration s of load; every --every s a delta of --share of each table's rows (random
           rows, new random values, written with sixfold.partitioner.tables.deltas.write_delta as a trainer would)
           is applied through REST load (the folder's path on the server; sixfold.delta_path);
           time from the call to its answer (the rows are visible when it returns: the swap is
           done before the answer) and the host stage's hold, as the server reports them
  swap     --swap-load s of load; at --swap-at s version 2 (a copy of version 1's folder) is
           loaded through RepositoryModelLoad: the load's time; version 1 is then retired

Requests are split by when they were in flight: those overlapping an apply (call to answer)
or the swap (load call to its answer) count as "during"; the others "between". The server's
RSS (VmRSS of its process, sampled every 50 ms) is reported per phase (peak). Every failed
request is counted. The machine's load average is printed at start and end (the machine may
be shared; then say so). Everything written is deleted at the end.

    .venv/bin/python bench/deltas.py                           # rm2 at full size, writes BENCHMARKS.md
    .venv/bin/python bench/deltas.py --max-rows 50000 --duration 40 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness.commands import command  # noqa: E402
from bench.harness.process import free_port  # noqa: E402
from bench.harness.report import machine_line, publish  # noqa: E402
from bench.harness.sweep import search_max_qps  # noqa: E402
from sixfold.loadgen import LoadConfig  # noqa: E402
from sixfold.loadgen.record import ERROR, OK  # noqa: E402
from sixfold.loadgen.runner import Target, drive, plan_run  # noqa: E402
from sixfold.loadgen.clock import MonotonicClock  # noqa: E402
from sixfold.partitioner.tables import build as table_build  # noqa: E402
from sixfold.partitioner.tables.deltas import version_fingerprint, write_delta  # noqa: E402
from sixfold.server.workers.process import READY_PREFIX  # noqa: E402

TOKEN = "bench"
MODEL = "rm2"


class Server:
    """sixfold-serve as a process; ``rss`` samples its VmRSS every 50 ms while ``sampling``."""

    def __init__(self, repo: Path) -> None:
        self.grpc, self.http = free_port(), free_port()
        self.proc = subprocess.Popen(
            [*command("sixfold-serve"), "--model-repository", str(repo),
             "--model-control-mode", "explicit", "--control-token", TOKEN, "--load-model", MODEL,
             "--grpc-port", str(self.grpc), "--http-port", str(self.http), "--metrics-port", "-1",
             "--drain-seconds", "0", "--cards", "6"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if line.startswith(READY_PREFIX):
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(1800) or self.proc.poll() is not None:
            raise RuntimeError("sixfold-serve did not start:\n" + "".join(self.lines[-30:]))
        self.peak = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.05)

    def rss(self) -> int:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def reset_peak(self) -> None:
        self.peak = self.rss()

    def load(self, parameters: dict) -> dict:
        body = json.dumps({"parameters": parameters}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.http}/v2/repository/models/{MODEL}/load",
                                         data=body, method="POST",
                                         headers={"authorization": f"Bearer {TOKEN}"})
        answer = urllib.request.urlopen(request, timeout=1800).read()
        return json.loads(answer) if answer.strip() else {}

    def stop(self) -> None:
        self._stop.set()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _load(server: Server, qps: float, seconds: float, seed: int, events) -> tuple:
    """Drive the server for ``seconds`` while ``events(t0)`` runs in a thread; (record, t0 of the record)."""
    config = LoadConfig(url=f"127.0.0.1:{server.grpc}", model=MODEL, qps=qps, duration_s=seconds, warmup_s=0,
                        seed=seed)

    async def run():
        async with Target(config) as target:
            schedule = plan_run(config, target.shape, target.transport.prepare)
            start = time.perf_counter()
            thread = threading.Thread(target=events, args=(start,), daemon=True)
            thread.start()
            record, _, _ = await drive(config, schedule, target.transport, clock=MonotonicClock())
            thread.join()
            return record

    record = asyncio.run(run())
    return record


def _split(record, windows: list[tuple[float, float]]) -> dict:
    """p50/p99 (ms) and counts of requests overlapping ``windows`` (record-relative seconds) and the rest."""
    n = len(record)
    sent, done, due = record.sent[:n], record.done[:n], record.due[:n]
    ok = record.status[:n] == OK
    start = np.where(np.isnan(sent), due, sent)
    during = np.zeros(n, bool)
    for a, b in windows:
        during |= (start <= b) & (done >= a)
    latency = (done - due) * 1e3

    def stats(mask):
        lat = latency[mask & ok]
        return {"requests": int(mask.sum()), "failed": int((record.status[:n][mask] == ERROR).sum()),
                "p50_ms": float(np.percentile(lat, 50)) if lat.size else None,
                "p99_ms": float(np.percentile(lat, 99)) if lat.size else None}

    everything = np.ones(n, bool)
    reasons: dict[str, int] = {}
    for i in np.flatnonzero(record.status[:n] == ERROR).tolist():
        reason = record.reasons.get(i, "unknown")
        reasons[reason] = reasons.get(reason, 0) + 1
    return {"all": stats(everything), "during": stats(during), "between": stats(~during),
            "not_answered": int((record.status[:n] != OK).sum()), "errors": reasons}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-rows", type=int, default=None, help="rows per table (default: rm2's full 500k)")
    p.add_argument("--qps", type=float, default=None,
                   help="offered load (default: half of the latency-bounded maximum, searched first)")
    p.add_argument("--p99-ms", type=float, default=250.0,
                   help="the latency bound of that search (rm2's lone 700-item query is over 60 ms on 2 cores)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load with deltas")
    p.add_argument("--baseline", type=float, default=60.0, help="seconds of load without updates")
    p.add_argument("--every", type=float, default=10.0, help="seconds between deltas")
    p.add_argument("--share", type=float, default=0.01, help="share of each table's rows in a delta")
    p.add_argument("--swap-load", type=float, default=60.0, help="seconds of load around the version swap")
    p.add_argument("--swap-at", type=float, default=15.0, help="when the version swap starts (s into its phase)")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of untimed load at 2 q/s first")
    p.add_argument("--workdir", default=None, help="where to write the repository (default: a temp folder)")
    p.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="sixfold-deltas-bench-", dir=args.workdir))
    server = None
    try:
        repo = work / "repo"
        version = repo / MODEL / "1"
        t0 = time.perf_counter()
        table_build.build_streamed(MODEL, version, max_rows=args.max_rows, progress=sys.stdout.isatty())
        build_s = time.perf_counter() - t0
        plan = json.loads((version / "plan.json").read_text())
        rows = plan["tables"]["rows"]
        table_bytes = sum(rows) * plan["tables"]["dim"] * 4
        print(f"built rm2: {len(rows)} x {rows[0]} rows ({table_bytes / 2**30:.2f} GiB) in {build_s:.0f} s",
              flush=True)
        # the deltas, written as a trainer would: random rows of every table, new values
        rng = np.random.default_rng(0)
        count = int(args.duration // args.every)
        fingerprint = version_fingerprint(version)
        deltas = []
        for k in range(count):
            tables = {}
            for t, r in enumerate(rows):
                ids = np.sort(rng.choice(r, max(1, int(r * args.share)), replace=False))
                tables[t] = (ids, (rng.standard_normal((ids.shape[0], plan["tables"]["dim"])) * 0.01)
                             .astype(np.float32))
            delta = write_delta(work / "deltas" / f"{k + 1:03d}", MODEL, k, fingerprint, tables)
            fingerprint = delta.fingerprint
            deltas.append(delta)
        delta_rows = deltas[0].rows
        print(f"wrote {count} deltas of {delta_rows} rows ({delta_rows * 256 / 2**20:.1f} MiB of rows) each",
              flush=True)
        t0 = time.perf_counter()
        server = Server(repo)
        start_s = time.perf_counter() - t0
        print(f"server up in {start_s:.0f} s (RSS {server.rss() / 2**20:.0f} MiB)", flush=True)

        results = {}
        search = None
        # warm up: the memory-mapped tables fault in on first touch (untimed)
        _load(server, 2.0, args.warmup, 9, lambda start: None)
        if args.qps is None:  # half of the latency-bounded maximum, measured now on this machine
            config = LoadConfig(url=f"127.0.0.1:{server.grpc}", model=MODEL, qps=2.0, duration_s=6.0,
                                warmup_s=1.0, seed=7)
            found = asyncio.run(search_max_qps(config, p99_ms=args.p99_ms, lo=2.0, floor=0.5, step_s=6.0,
                                               tolerance=0.15, max_steps=7))
            search = found["max_qps"]
            args.qps = round(max(0.5, (search or 1.0) / 2), 2)
            print(f"latency-bounded maximum (p99 <= {args.p99_ms:g} ms): {search} q/s; running at {args.qps}; "
                  f"steps: {[(r.get('qps'), r.get('p99_ms'), r.get('errors')) for r in (found['steps'] or [])]}",
                  flush=True)
        results["search"] = search
        # phase 1: no updates
        server.reset_peak()
        record = _load(server, args.qps, args.baseline, 1, lambda start: None)
        results["none"] = {**_split(record, []), "rss_peak": server.peak}
        print("none:", results["none"], flush=True)

        # phase 2: deltas every --every s
        applies = []

        def apply_deltas(start: float) -> None:
            for k, delta in enumerate(deltas):
                due = start + args.every / 2 + k * args.every
                time.sleep(max(0.0, due - time.perf_counter()))
                a = time.perf_counter()
                answer = server.load({"sixfold.delta_path": str(delta.path)})
                b = time.perf_counter()
                applies.append({"start": a, "end": b, "seconds": b - a,
                                "server_seconds": answer.get("seconds"), "held_s": answer.get("held_seconds"),
                                "check_s": answer.get("check_seconds"), "prepare_s": answer.get("prepare_seconds"),
                                "wait_s": answer.get("wait_seconds"), "commit_s": answer.get("commit_seconds"),
                                "sequence": answer.get("sequence")})

        server.reset_peak()
        record = _load(server, args.qps, args.duration, 2, apply_deltas)
        windows = [(a["start"] - record.t0, a["end"] - record.t0) for a in applies]
        results["deltas"] = {**_split(record, windows), "rss_peak": server.peak, "applies": applies}
        print("deltas:", {k: v for k, v in results["deltas"].items() if k != "applies"}, flush=True)

        # phase 3: a full version swap through RepositoryModelLoad
        t0 = time.perf_counter()
        shutil.copytree(version, repo / MODEL / "2", ignore=shutil.ignore_patterns("deltas", "fp32"))
        copy_s = time.perf_counter() - t0
        swap = {}

        def swap_version(start: float) -> None:
            time.sleep(max(0.0, start + args.swap_at - time.perf_counter()))
            a = time.perf_counter()
            server.load({})
            b = time.perf_counter()
            swap.update(start=a, end=b, seconds=b - a)

        server.reset_peak()
        rss_before = server.rss()
        record = _load(server, args.qps, args.swap_load, 3, swap_version)
        window = [(swap["start"] - record.t0, swap["end"] - record.t0)]
        results["swap"] = {**_split(record, window), "rss_peak": server.peak, "rss_before": rss_before,
                           "seconds": swap["seconds"], "copy_s": copy_s}
        print("swap:", results["swap"], flush=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    load_end = os.getloadavg()
    text = _section(args, results, rows, table_bytes, build_s, start_s, load_start, load_end,
                    time.perf_counter() - t_start)
    publish("deltas", text, write=not args.no_write)
    return 0


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _section(args, results, rows, table_bytes, build_s, start_s, load_start, load_end, wall_s) -> str:
    applies = results["deltas"]["applies"]
    took = [a["seconds"] * 1e3 for a in applies]
    held = [a["held_s"] * 1e3 for a in applies if a.get("held_s") is not None]
    med = {k: np.median([a[k] * 1e3 for a in applies if a.get(k) is not None] or [np.nan])
           for k in ("check_s", "prepare_s", "wait_s", "commit_s")}
    size = "full size" if args.max_rows is None else f"capped at {args.max_rows:,} rows"
    search = results.get("search")
    rate = (f"{args.qps:g} q/s, half of the latency-bounded maximum measured first in the same run "
            f"({search:g} q/s at p99 <= {args.p99_ms:g} ms, sixfold.loadgen.find_max_qps, 6 s steps)" if search
            else f"{args.qps:g} q/s")
    lines = [
        f"Command: `.venv/bin/python bench/deltas.py{'' if args.max_rows is None else f' --max-rows {args.max_rows}'}"
        f"{'' if search else f' --qps {args.qps:g}'}` ({wall_s / 60:.1f} min; "
        f"{machine_line(f'load average {load_start[0]:.1f} at start, {load_end[0]:.1f} at end (a shared machine)')}).",
        f"Model: rm2 ({size}: {len(rows)} x {rows[0]:,} rows x 64 fp32, {table_bytes / 2**30:.2f} GiB), one "
        f"`sixfold-serve` process (6 simcards, default batching), tables resident (memory-mapped). Load: open-loop "
        f"Poisson at {rate}, MLPerf query sizes (100..700 items), Zipf ids. Deltas: {len(applies)}, one "
        f"every {args.every:g} s, each {args.share:.0%} of every table's rows "
        f"({sum(rows) * args.share:,.0f} rows, {sum(rows) * args.share * 256 / 2**20:.0f} MiB), "
        f"applied through REST load with `sixfold.delta_path`. Build {build_s:.0f} s, server start {start_s:.0f} s.",
        "",
        "| phase | requests | failed (during an apply/swap) | p50 ms | p99 ms | p99 ms during an apply/swap | p99 ms between | server RSS peak MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, label in (("none", "no updates"), ("deltas", f"a {args.share:.0%} delta every {args.every:g} s"),
                        ("swap", "full version swap (RepositoryModelLoad)")):
        r = results[name]
        lines.append(f"| {label} | {r['all']['requests']} | {r['not_answered']} ({r['during']['failed']}) "
                     f"| {_ms(r['all']['p50_ms'])} | {_ms(r['all']['p99_ms'])} | {_ms(r['during']['p99_ms'])} "
                     f"({r['during']['requests']} req) | {_ms(r['between']['p99_ms'])} | {r['rss_peak'] / 2**20:.0f} |")
    lines += [
        "",
        f"Apply to visible (REST call to answer; the swap is done before the answer): median "
        f"{np.median(took):.0f} ms, max {max(took):.0f} ms (server side, medians: check {med['check_s']:.0f} ms, "
        f"convert + persist + prepare {med['prepare_s']:.0f} ms, waiting for batches in the host stage "
        f"{med['wait_s']:.1f} ms, the swap itself {med['commit_s']:.1f} ms); host stage held (new batches waiting): "
        f"median {np.median(held):.1f} ms, max {max(held):.1f} ms. Failed requests by reason: "
        f"{ {k: results[k]['errors'] for k in ('none', 'deltas', 'swap')} }. Full version swap: {results['swap']['seconds']:.1f} s "
        f"(RSS {results['swap']['rss_before'] / 2**20:.0f} MiB before, peak {results['swap']['rss_peak'] / 2**20:.0f} "
        f"MiB; the version folder copy, {results['swap']['copy_s']:.0f} s, not counted).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
