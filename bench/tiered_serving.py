"""A model larger than memory, served end to end: the highest rate at p99 <= 60 ms with a warm row cache.

Issue 12's benchmark 2. Every step is the user's own CLI, run as a subprocess:

1. build    ``sixfold-partition tables build MODEL --table-precision int8 --packed-only`` into a
            repository (dlrm-mlperf: 26 tables, 188M rows, 23.8 GiB of packed int8 rows), with
            ``sixfold.table_memory`` (``--table-memory``, default 4GiB) in its config.pbtxt;
            skipped when ``--repo`` already holds it (``--keep`` leaves it for the next run)
2. record   a cold ``sixfold-serve`` of it, ``sixfold-loadgen --record`` at ``--record-qps`` for
            ``--record-s`` (seed 1): "yesterday's traffic"
3. serve    ``sixfold-serve --warm-from`` that recording (the cache loaded before READY), RSS
            sampled every 0.5 s from start to stop
4. search   ``sixfold-loadgen --find-max-qps --p99-ms 60`` with MLPerf query sizes and another
            seed (7): new queries from the same distribution, ``--pool 300`` so that none repeats
            within a step; the row cache's hits and misses from /metrics before and after

    .venv/bin/python bench/tiered_serving.py                       # ~25 min; writes BENCHMARKS.md
    .venv/bin/python bench/tiered_serving.py --repo /data/r --keep --no-write
    .venv/bin/python bench/tiered_serving.py --model rm1 --max-rows 20000 --table-memory 10% --no-write \
        --record-s 5 --step 3 --warmup 1 --max-steps 2                  # a smoke run, ~1 min

The repository is deleted at the end unless ``--keep`` (it is tens of GB).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness.commands import command  # noqa: E402
from bench.harness.report import machine_line, publish  # noqa: E402


def _run(cmd: list[str], log: Path) -> None:
    print("$", " ".join(cmd), flush=True)
    with open(log, "a") as out:
        subprocess.run(cmd, check=True, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)


class Server:
    """``sixfold-serve`` in its own process; RSS sampled while it runs."""

    def __init__(self, repo: Path, log: Path, extra: list[str], port: int, metrics_port: int) -> None:
        self.cmd = [*command("sixfold-serve"), "--model-repository", str(repo), "--grpc-port", str(port),
                    "--http-port", "-1", "--metrics-port", str(metrics_port), "--drain-seconds", "0", *extra]
        self.log, self.port, self.metrics_port = log, port, metrics_port
        self.rss: list[float] = []
        self.ready_s = 0.0

    def __enter__(self) -> "Server":
        print("$", " ".join(self.cmd), flush=True)
        t0 = time.monotonic()
        seen = self.log.stat().st_size if self.log.exists() else 0  # the log is shared: only this run's READY
        self.out = open(self.log, "a")
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=subprocess.STDOUT, cwd=ROOT, text=True)
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()
        while "READY grpc=" not in self.log.read_text()[seen:]:
            if self.proc.poll() is not None or time.monotonic() - t0 > 900:
                self.__exit__()
                raise SystemExit(f"server did not start; see {self.log}")
            time.sleep(0.5)
        self.ready_s = time.monotonic() - t0
        self.rss_at_ready = self.rss[-1] if self.rss else 0.0
        return self

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                status = Path(f"/proc/{self.proc.pid}/status").read_text()
                self.rss.append(int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024)
            except (OSError, AttributeError):
                pass
            self._stop.wait(0.5)

    def cache(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out: dict[str, float] = {}
        for name in ("hits_total", "misses_total", "bytes", "budget_bytes", "rows", "slots"):
            values = re.findall(rf"^sixfold_table_cache_{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
            out[name] = sum(float(v) for v in values)
        return out

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.out.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dlrm-mlperf")
    p.add_argument("--repo", default="runs/tiered-serving", help="repository folder (deleted at the end unless --keep)")
    p.add_argument("--keep", action="store_true")
    p.add_argument("--table-memory", default="4GiB")
    p.add_argument("--max-rows", type=int, help="cap every table (a smoke run; the benchmark is full size)")
    p.add_argument("--cards", type=int, default=6)
    p.add_argument("--record-qps", type=float, default=4.0)
    p.add_argument("--record-s", type=float, default=60.0)
    p.add_argument("--p99-ms", type=float, default=60.0)
    p.add_argument("--min-qps", type=float, default=4.0)
    p.add_argument("--step", type=float, default=20.0, help="measured seconds per search step")
    p.add_argument("--warmup", type=float, default=5.0, help="warmup seconds per search step")
    p.add_argument("--max-steps", type=int, default=7)
    p.add_argument("--port", type=int, default=18301)
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)

    repo = (ROOT / args.repo).resolve()
    name = "dlrm"
    version = repo / name / "1"
    log = repo.parent / f"{repo.name}.log"
    repo.parent.mkdir(parents=True, exist_ok=True)
    load = [os.getloadavg()[0]]
    started = time.monotonic()
    figures: dict[str, object] = {}
    try:
        if not (version / "plan.json").exists():
            t0 = time.monotonic()
            _run([*command("sixfold-partition"), "tables", "build", args.model, "--table-precision", "int8",
                  "--packed-only", "--cards", str(args.cards), "--out", str(version),
                  *(["--max-rows", str(args.max_rows)] if args.max_rows else [])], log)
            figures["build_s"] = time.monotonic() - t0
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\nparameters {{ key: "sixfold.table_memory" value {{ string_value: "{args.table_memory}" }} }}\n')
        tables = sum(f.stat().st_size for f in (version / "tables").rglob("*.npy"))
        figures["table_bytes"] = tables
        recording = repo / "yesterday.npz"
        url = f"127.0.0.1:{args.port}"
        loadgen = [*command("sixfold-loadgen"), "--url", url, "--model", name, "--query-size", "mlperf",
                   "--pool", "300", "--wait-ready", "120"]
        if not recording.exists():
            with Server(repo, log, ["--cards", str(args.cards)], args.port, args.port + 2):
                _run([*loadgen, "--qps", str(args.record_qps), "--duration", str(args.record_s), "--seed", "1",
                      "--report", str(repo / "record-report.json"), "--record", str(recording)], log)
        with Server(repo, log, ["--cards", str(args.cards), "--warm-from", str(recording)], args.port,
                    args.port + 2) as server:
            figures["ready_s"] = server.ready_s
            before = server.cache()
            figures["warm"] = before
            report = repo / "search.json"
            _run([*loadgen, "--find-max-qps", "--p99-ms", str(args.p99_ms), "--min-qps", str(args.min_qps),
                  "--step-duration", str(args.step), "--warmup", str(args.warmup), "--max-steps",
                  str(args.max_steps), "--seed", "7", "--report", str(report)], log)
            after = server.cache()
            figures["search"] = json.loads(report.read_text())
            figures["cache_after"] = after
            hits, misses = after["hits_total"] - before["hits_total"], after["misses_total"] - before["misses_total"]
            figures["hit_rate"] = hits / (hits + misses) if hits + misses else 0.0
        figures["rss_mib"] = {"max": max(server.rss), "at_ready": server.rss_at_ready}
    finally:
        load.append(os.getloadavg()[0])
        if not args.keep:
            shutil.rmtree(repo, ignore_errors=True)
    search = figures["search"]
    assert isinstance(search, dict)
    rows = ["| offered q/s | achieved | p50 ms | p99 ms | errors | passed |", "|---|---|---|---|---|---|"]
    for step in search.get("sweep") or []:
        rows.append(f"| {step.get('qps', 0):.2f} | {step.get('achieved_qps', 0):.2f} | "
                    f"{step.get('p50_ms') or 0:.1f} | {step.get('p99_ms') or 0:.1f} | {step.get('errors', 0)} | "
                    f"{'yes' if step.get('pass') else 'no'} |")
    budget = figures["warm"]["budget_bytes"] if isinstance(figures.get("warm"), dict) else 0
    rss = figures["rss_mib"]
    text = "\n".join([
        "## Tiered tables served end to end (issue 12, benchmark 2)", "",
        f"Command: `.venv/bin/python bench/tiered_serving.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({(time.monotonic() - started) / 60:.0f} min; {machine_line(f'load average {load[0]:.1f} at start, {load[1]:.1f} at end')}).",
        f"{args.model} {f'capped at {args.max_rows:,} rows a table' if args.max_rows else 'at full size'}: "
        f"{figures['table_bytes'] / 2**30:.1f} GiB of packed int8 rows on disk"
        + (f", built in {figures['build_s'] / 60:.1f} min" if "build_s" in figures else "")
        + f"; served with `sixfold.table_memory: {args.table_memory}` on {args.cards} simcards, the row cache "
          f"warmed at start (`--warm-from`) from {args.record_s:g} s of recorded traffic at {args.record_qps:g} q/s "
          f"(seed 1); READY after {figures['ready_s']:.0f} s. Search: `sixfold-loadgen --find-max-qps --p99-ms "
          f"{args.p99_ms:g}`, MLPerf query sizes, seed 7 (other queries than the recording's), pool 300, "
          f"{args.warmup:g} s + {args.step:g} s per step.", "",
        *rows, "",
        f"**Highest rate with p99 <= {args.p99_ms:g} ms: {search.get('max_qps_under_slo') or 0:.2f} q/s.** "
        f"Row cache hit rate over the search: {figures['hit_rate']:.1%} (cache after warming: "
        f"{figures['warm']['rows']:,.0f} of {figures['warm']['slots']:,.0f} slots). Server RSS: "
        f"{rss['at_ready']:,.0f} MiB at READY, at most {rss['max']:,.0f} MiB over the run, against a budget of "
        f"{budget / 2**20:,.0f} MiB.",
    ])
    print(text)
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs" / "tiered-serving.json").write_text(json.dumps(figures, indent=1, default=str))
    publish("tiered-serving", text, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
