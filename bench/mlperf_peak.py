"""The highest MLPerf Server-scenario QPS that MLCommons LoadGen judges VALID, this tree against a baseline.

Issue 35's goal "the MLPerf LoadGen Server scenario is VALID at a higher QPS than before this issue, on
the same host in the same run" needs both trees measured together: on a shared 2-core host the verdict
moves with whatever else runs, so a figure from another day says little. This bench:

- serves ``--model`` (default dlrm-mlperf, every table capped at ``--max-rows``) with this working tree
  and with a baseline tree (``--baseline-tree REF``, default 12a2768, the tree before issue 35's work:
  checked out with ``git worktree add`` in a temp folder, removed after; its server runs with this
  venv's python, the worktree first on sys.path, as bench/latency_bounded.py's baseline does);
- at each step of a QPS ladder (``--qps 6,8,10``) or of a bisection (``--bisect LO:HI --steps N``)
  runs LoadGen's Server scenario (``sixfold-loadgen --mlperf-scenario server``, this tree's client for
  both) against each tree in turn, alternating which goes first, one server alive at a time, each
  started fresh with the same flags (``sixfold-serve --model M --max-rows N`` plus the bench's
  address flags, defaults otherwise; ``--serve-arg`` adds flags to both);
- records per step LoadGen's verdict (read from the summary LoadGen wrote), the requests that failed,
  completed samples/s, p50/p99, queries, and the load average before and after; a step passes when
  LoadGen says VALID and no request failed (LoadGen cannot tell a failed request from an answer);
- prints a markdown table on stdout (``--json PATH``: every figure) and progress on stderr.

Each step lasts ``--duration`` s (LoadGen's min duration, with min query count = QPS x duration), and
is killed after ``--step-timeout`` s. These are not MLPerf-compliant runs (600 s and 270,336 queries
are), and at p99 LoadGen's early-stopping rule needs about 460 queries before any run can be VALID, so
QPS x duration below that is INVALID whatever the latencies. Ctrl-C or SIGTERM stops the server and
the load generator and removes the worktree.

    .venv/bin/python bench/mlperf_peak.py --qps 6,8,10,12,16,20,24,28,32 --json runs/mlperf_peak.json
    .venv/bin/python bench/mlperf_peak.py --bisect 6:40 --steps 5 --duration 60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness.commands import command  # noqa: E402
from bench.harness.peers import sixfold_server  # noqa: E402
from bench.harness.process import ServerProc, die_with_parent  # noqa: E402
from bench.harness.report import machine_line, md_row, write_json  # noqa: E402

DEFAULT_BASELINE = "12a2768"
DEFAULT_LADDER = "6,8,10,12,16,20,24,28,32"
THIS, BASELINE = "this", "baseline"


def log(msg: str) -> None:
    """Live progress: stderr, so stdout keeps only the table."""
    print(f"[mlperf_peak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_avg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


@contextlib.contextmanager
def baseline_tree(ref: str) -> Iterator[tuple[str, str]]:
    """(folder, label) of the baseline's code: REF checked out in a temporary git worktree, removed after.

    An existing folder is used as it is (not removed): a tree made some other way.
    """
    if Path(ref).is_dir():
        yield str(Path(ref).resolve()), f"folder {ref}"
        return
    try:
        commit = _git("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")
    except RuntimeError:
        raise SystemExit(f"--baseline-tree {ref!r}: neither a folder nor a commit of {ROOT}") from None
    with tempfile.TemporaryDirectory(prefix="mlperf_peak_") as tmp:
        folder = str(Path(tmp) / "baseline")
        _git("worktree", "add", "--detach", folder, commit)
        try:
            yield folder, f"{ref} ({commit[:10]})"
        finally:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _git("worktree", "remove", "--force", folder)
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _git("worktree", "prune")


@dataclass
class Tree:
    """One side of the comparison: which code serves, and how it is named in the report."""

    key: str             # THIS or BASELINE
    label: str           # e.g. "working tree at c4210ec" or "12a2768 (12a27685b6)"
    folder: str | None   # None: this checkout


def server_for(tree: Tree, args: argparse.Namespace) -> ServerProc:
    """The same sixfold-serve flags for both trees (cards None: each tree's own default layout)."""
    return sixfold_server(args.model, args.max_rows, None, batching=True, tree=tree.folder, extra=args.serve_arg,
                          name=tree.key)


def server_flags(args: argparse.Namespace) -> str:
    """The flags both servers get, for the report (the address flags are sixfold_server's)."""
    argv = server_for(Tree(THIS, "", None), args).argv
    start = argv.index("--model")
    return "sixfold-serve " + " ".join(argv[start:])


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
            return


def run_loadgen(url: str, qps: float, step_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One LoadGen Server-scenario run against ``url``, in its own process, killed after --step-timeout."""
    step_dir.mkdir(parents=True, exist_ok=True)
    report = step_dir / "report.json"
    report.unlink(missing_ok=True)
    min_queries = max(math.ceil(qps * args.duration), args.min_queries)
    argv = [*command("sixfold-loadgen"), "--url", url, "--model", args.model, "--mlperf-scenario", "server",
            "--qps", f"{qps:g}", "--duration", f"{args.duration:g}", "--mlperf-min-queries", str(min_queries),
            "--mlperf-latency-ms", f"{args.latency_ms:g}", "--mlperf-log-dir", str(step_dir), "--report", str(report)]
    out_path = step_dir / "loadgen.out"
    t0 = time.monotonic()
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                preexec_fn=die_with_parent)
        try:
            log(f"    LoadGen started (pid {proc.pid})")
            next_note = t0 + 15.0
            while proc.poll() is None:
                now = time.monotonic()
                if now - t0 > args.step_timeout:
                    _stop_group(proc)
                    return {"error": f"LoadGen run killed after --step-timeout {args.step_timeout:g} s",
                            "min_queries": min_queries, "wall_s": round(now - t0, 1)}
                if now >= next_note:
                    log(f"    ... {now - t0:.0f} s of about {args.duration:g} s")
                    next_note = now + 15.0
                time.sleep(0.5)
        finally:
            if proc.poll() is None:  # Ctrl-C while waiting
                _stop_group(proc)
    wall = round(time.monotonic() - t0, 1)
    if proc.returncode != 0 or not report.exists():
        tail = out_path.read_text(errors="replace").strip().splitlines()[-3:]
        return {"error": f"sixfold-loadgen exited {proc.returncode}: {' | '.join(tail)}", "min_queries": min_queries,
                "wall_s": wall}
    result = json.loads(report.read_text())
    return {"result": result["result"], "valid": bool(result["valid"]), "samples_per_s": result["samples_per_s"],
            "p50_ms": result["latency_ms"].get("p50"), "p99_ms": result["latency_ms"].get("p99"),
            "queries": result["samples_sent"], "failed": result["errors"], "checks": result["checks"],
            "min_queries": min_queries, "summary": result["summary_path"], "wall_s": wall}


def run_step(tree: Tree, qps: float, index: int, args: argparse.Namespace) -> dict[str, Any]:
    """A fresh server of ``tree``, one LoadGen run at ``qps``, the server stopped: one row of the table."""
    row: dict[str, Any] = {"step": index, "tree": tree.key, "qps": qps}
    server = server_for(tree, args)
    log(f"step {index}: {tree.key} ({tree.label}) at {qps:g} q/s: starting the server")
    try:
        try:
            url = server.start(args.model, timeout_s=args.start_timeout)
        except RuntimeError as exc:
            row.update(error=f"server did not start: {exc}", valid=False)
            return row
        row["load_before"] = load_avg()
        log(f"step {index}: {tree.key} at {qps:g} q/s: LoadGen for {args.duration:g} s (load {row['load_before']})")
        row.update(run_loadgen(url, qps, Path(args.log_dir) / f"step{index:02d}-{tree.key}-{qps:g}", args))
        row["load_after"] = load_avg()
        row.setdefault("valid", False)
        log(f"step {index}: {tree.key} at {qps:g} q/s: " + (
            f"{row['result']}, {row['failed']} failed, {_num(row['samples_per_s'], '.2f')} samples/s, "
            f"p99 {_num(row['p99_ms'])} ms"
            if "result" in row else row["error"]))
        return row
    finally:
        server.stop()


def _order(trees: list[Tree], index: int) -> list[Tree]:
    """Alternate which tree goes first, so neither always runs on the host the other just warmed."""
    return trees if index % 2 == 0 else trees[::-1]


def ladder_search(trees: list[Tree], ladder: list[float], args: argparse.Namespace,
                  rows: list[dict[str, Any]]) -> None:
    """Up the ladder, each step's row appended to ``rows``; a tree leaves after ``--patience`` failed steps in a row."""
    misses = {t.key: 0 for t in trees}
    for index, qps in enumerate(ladder):
        active = [t for t in trees if misses[t.key] < args.patience]
        if not active:
            break
        for tree in _order(active, index):
            row = run_step(tree, qps, index, args)
            rows.append(row)
            misses[tree.key] = 0 if row["valid"] else misses[tree.key] + 1


def bisect_search(trees: list[Tree], lo: float, hi: float, args: argparse.Namespace,
                  rows: list[dict[str, Any]]) -> None:
    """Each tree halves its own bracket [lo, hi]; every step runs both trees, at their own midpoints."""
    bracket = {t.key: [lo, hi] for t in trees}
    for index in range(args.steps):
        for tree in _order(trees, index):
            low, high = bracket[tree.key]
            qps = round((low + high) / 2, 2)
            row = run_step(tree, qps, index, args)
            rows.append(row)
            bracket[tree.key][0 if row["valid"] else 1] = qps


def peaks(rows: list[dict[str, Any]], trees: list[Tree]) -> dict[str, float | None]:
    """Per tree, the highest QPS of a passing step (None: no step passed)."""
    return {t.key: max((r["qps"] for r in rows if r["tree"] == t.key and r["valid"]), default=None) for t in trees}


def _num(value: Any, fmt: str = ".1f") -> str:
    return "" if value is None else format(value, fmt)


def format_table(report: dict[str, Any]) -> str:
    """The markdown the bench prints: what ran, the steps, the peaks."""
    trees = report["trees"]
    lines = [f"MLPerf LoadGen Server scenario, {report['model']} (tables capped at {report['max_rows']} rows), "
             f"p99 <= {report['latency_ms']:g} ms; {report['host']}.",
             f"Both servers: `{report['server_flags']}` (defaults otherwise), started fresh for every step, "
             "one alive at a time.",
             f"Trees: this = {trees[THIS]}; baseline = {trees[BASELINE]}.",
             f"{report['duration_s']:g} s per step, min queries = QPS x duration: not MLPerf-compliant runs "
             "(600 s and 270,336 queries are). Pass = LoadGen's VALID with no failed request.",
             "",
             md_row("step", "tree", "target q/s", "LoadGen's verdict", "failed", "pass", "samples/s", "p50 ms",
                    "p99 ms", "queries", "load before", "load after"),
             md_row(*["---"] * 3, "---", *["---:"] * 2, *["---:"] * 4, "---", "---")]
    for r in report["steps"]:
        missed = [name.replace("_", " ") for name, ok in r.get("checks", {}).items() if not ok]
        verdict = (r["result"] + (f" ({', '.join(missed)})" if missed else "") if "result" in r
                   else f"none ({r.get('error', '?')[:80]})")
        load = lambda key: " ".join(f"{x:.2f}" for x in r[key]) if key in r else ""  # noqa: E731
        lines.append(md_row(r["step"], r["tree"], f"{r['qps']:g}", verdict, _num(r.get("failed"), "d"),
                            "yes" if r["valid"] else "no", _num(r.get("samples_per_s"), ".2f"), _num(r.get("p50_ms")),
                            _num(r.get("p99_ms")), _num(r.get("queries"), "d"), load("load_before"),
                            load("load_after")))
    peak = report["peak_qps"]
    show = {k: ("none passed" if v is None else f"{v:g} q/s") for k, v in peak.items()}
    lines += ["", f"Highest passing QPS: this tree {show[THIS]}, baseline {show[BASELINE]}."
              + (" Interrupted: only the steps above ran." if report.get("interrupted") else "")]
    return "\n".join(lines)


def parse_ladder(text: str) -> list[float]:
    try:
        ladder = sorted({float(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--qps {text!r}: expected comma-separated numbers, e.g. 6,8,10") from None
    if not ladder or ladder[0] <= 0 or not all(math.isfinite(q) for q in ladder):
        raise SystemExit(f"--qps {text!r}: give one or more finite rates > 0")
    return ladder


def parse_bracket(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--bisect {text!r}: expected LO:HI, e.g. 6:40") from None
    if not (0 < lo < hi and math.isfinite(hi)):
        raise SystemExit(f"--bisect {text!r}: need 0 < LO < HI")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dlrm-mlperf", help="zoo model both trees serve (default dlrm-mlperf)")
    p.add_argument("--max-rows", type=int, default=100_000, help="rows per table, both servers (default 100000)")
    p.add_argument("--baseline-tree", default=DEFAULT_BASELINE, metavar="REF",
                   help=f"commit (or an existing folder) of the baseline's code (default {DEFAULT_BASELINE}, "
                        "before issue 35); a commit is checked out in a temporary git worktree, removed after")
    search = p.add_mutually_exclusive_group()
    search.add_argument("--qps", default=None, help=f"QPS ladder, ascending (default {DEFAULT_LADDER})")
    search.add_argument("--bisect", default=None, metavar="LO:HI", help="bisect between LO and HI q/s instead")
    p.add_argument("--steps", type=int, default=4, help="--bisect: steps per tree (default 4)")
    p.add_argument("--patience", type=int, default=1,
                   help="ladder: a tree leaves after this many failed steps in a row (default 1)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per step (default 60)")
    p.add_argument("--min-queries", type=int, default=1,
                   help="LoadGen's min query count is the larger of this and QPS x duration (default 1)")
    p.add_argument("--latency-ms", type=float, default=60.0, help="p99 bound (default 60, MLPerf DLRM's)")
    p.add_argument("--step-timeout", type=float, default=None,
                   help="kill a LoadGen run after this many seconds (default 2 x duration + 120)")
    p.add_argument("--start-timeout", type=float, default=240.0, help="seconds a server may take to start (240)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more sixfold-serve argument for both servers (repeat; e.g. --serve-arg=--cards)")
    p.add_argument("--log-dir", default="runs/mlperf_peak", help="LoadGen's logs, a folder per step")
    p.add_argument("--json", default=None, help="write every figure here")
    return p


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("duration", "latency_ms", "start_timeout"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) > 0):
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    if args.steps < 1 or args.patience < 1 or args.min_queries < 1 or args.max_rows < 1:
        raise SystemExit("--steps, --patience, --min-queries and --max-rows must be >= 1")
    args.step_timeout = args.step_timeout or 2 * args.duration + 120
    ladder = None if args.bisect else parse_ladder(args.qps or DEFAULT_LADDER)
    bracket = parse_bracket(args.bisect) if args.bisect else None
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a shell starts `cmd &` with it ignored
        signal.signal(sig, _interrupt)
    head = _git("rev-parse", "--short", "HEAD")
    dirty = " (+ uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else ""
    report: dict[str, Any] = {"model": args.model, "max_rows": args.max_rows, "latency_ms": args.latency_ms,
                              "duration_s": args.duration, "host": machine_line(), "server_flags": server_flags(args),
                              "search": {"ladder": ladder} if ladder else {"bisect": bracket, "steps": args.steps},
                              "load_start": load_avg(), "steps": []}
    trees: list[Tree] = []
    status = 0
    try:
        with baseline_tree(args.baseline_tree) as (folder, label):
            trees += [Tree(THIS, f"working tree at {head}{dirty}", None), Tree(BASELINE, label, folder)]
            report["trees"] = {t.key: t.label for t in trees}
            log(f"this = {trees[0].label}; baseline = {label}; {report['server_flags']}")
            if ladder:
                ladder_search(trees, ladder, args, report["steps"])
            else:
                bisect_search(trees, *bracket, args, report["steps"])  # type: ignore[misc]
    except KeyboardInterrupt:
        log("interrupted: servers and LoadGen stopped, worktree removed; the steps that finished follow")
        report["interrupted"], status = True, 130
    if not trees:
        return status
    report["load_end"] = load_avg()
    report["peak_qps"] = peaks(report["steps"], trees)
    if args.json:
        write_json(args.json, report)
    print(format_table(report))
    return status


if __name__ == "__main__":
    sys.exit(main())
