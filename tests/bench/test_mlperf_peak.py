"""bench/mlperf_peak.py end to end on the tiny model: two trees, a 2-step ladder, LoadGen's own verdicts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sixfold.loadgen.mlperf import parse_summary

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "mlperf_peak.py"


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _worktrees() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "worktree", "list"], capture_output=True, text=True,
                          timeout=60).stdout


def test_two_trees_alternate_on_a_two_step_ladder_and_the_verdicts_are_loadgens(tmp_path: Path) -> None:
    out_json, logs = tmp_path / "peak.json", tmp_path / "logs"
    done = _run("--model", "tiny", "--max-rows", "1000", "--baseline-tree", "HEAD", "--qps", "20,40",
                "--patience", "2", "--duration", "2", "--step-timeout", "90", "--log-dir", str(logs),
                "--json", str(out_json), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out_json.read_text())
    steps = report["steps"]
    # both trees at both rates, each step's first tree alternating, a fresh server per step
    assert [(s["step"], s["tree"], s["qps"]) for s in steps] == [
        (0, "this", 20.0), (0, "baseline", 20.0), (1, "baseline", 40.0), (1, "this", 40.0)], steps
    for s in steps:
        assert "error" not in s, s
        summary = parse_summary(Path(s["summary"]).read_text())  # what LoadGen itself wrote for this step
        assert Path(s["summary"]).parent.parent == logs
        assert s["result"] == summary["result"] and s["result"] in ("VALID", "INVALID"), s
        assert s["samples_per_s"] == summary["samples_per_s"] and s["samples_per_s"] > 0, s
        assert s["p99_ms"] == summary["latency_ms"]["p99"] and s["p50_ms"] <= s["p99_ms"], s
        assert s["checks"] == summary["checks"], s
        assert s["valid"] == (s["result"] == "VALID" and s["failed"] == 0), s
        assert s["queries"] >= s["min_queries"] == s["qps"] * 2, s
        assert len(s["load_before"]) == 3 and len(s["load_after"]) == 3, s
    for tree in ("this", "baseline"):
        passed = [s["qps"] for s in steps if s["tree"] == tree and s["valid"]]
        assert report["peak_qps"][tree] == (max(passed) if passed else None), report["peak_qps"]
    assert report["trees"]["baseline"].startswith("HEAD (")
    assert "--model tiny --max-rows 1000" in report["server_flags"]
    # the markdown table: a header and one row per step, with LoadGen's verdicts as written
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| step | tree | target q/s | LoadGen's verdict |") and len(table) == 2 + len(steps)
    for line, s in zip(table[2:], steps):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == s["tree"] and cells[3].split()[0] == s["result"], (line, s)
    assert "Highest passing QPS:" in done.stdout
    assert "LoadGen for 2 s" in done.stderr  # live progress goes to stderr
    assert str(tmp_path) not in _worktrees() and "mlperf_peak_" not in _worktrees()  # the worktree is removed


def test_bisection_halves_each_trees_bracket_after_a_step_loadgen_judges_invalid(tmp_path: Path) -> None:
    # 2 s at 20 q/s is 40 queries: LoadGen's early stopping needs ~460 at p99, so the first step is INVALID
    # for both trees whatever the latencies, and each bracket's top comes down to 20: the next step is at 15
    out_json = tmp_path / "peak.json"
    done = _run("--model", "tiny", "--max-rows", "1000", "--baseline-tree", "HEAD", "--bisect", "10:30", "--steps",
                "2", "--duration", "2", "--step-timeout", "90", "--log-dir", str(tmp_path / "logs"),
                "--json", str(out_json), timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads(out_json.read_text())["steps"]
    assert [(s["tree"], s["qps"]) for s in steps][:2] == [("this", 20.0), ("baseline", 20.0)], steps
    assert [s["result"] for s in steps[:2]] == ["INVALID", "INVALID"] and not steps[0]["checks"]["early_stopping"]
    assert [(s["tree"], s["qps"]) for s in steps[2:]] == [("baseline", 15.0), ("this", 15.0)], steps


def _servers_with(max_rows: str) -> list[int]:
    """Pids of live sixfold-serve processes started with ``--max-rows max_rows`` (a number only this test uses)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--max-rows" in argv and argv[argv.index(b"--max-rows") + 1:][:1] == [max_rows.encode()] \
                and any(b"sixfold" in a for a in argv) and b"mlperf_peak.py" not in b" ".join(argv):
            pids.append(int(proc.name))
    return pids


def test_ctrl_c_mid_step_stops_the_server_and_loadgen_and_removes_the_worktree(tmp_path: Path) -> None:
    rows = "1237"
    proc = subprocess.Popen([sys.executable, str(BENCH), "--model", "tiny", "--max-rows", rows, "--baseline-tree",
                             "HEAD", "--qps", "20", "--duration", "60", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 180
        seen = ""
        # NOTE: wait for LoadGen to be running, not only announced: a signal while Popen forks it raced
        while "LoadGen started" not in seen and time.monotonic() < deadline and proc.poll() is None:
            seen += proc.stderr.readline()
        assert "LoadGen started" in seen, seen
        assert _servers_with(rows), "the first step's server should be serving now"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Interrupted: only the steps above ran." in out
    assert _servers_with(rows) == [], "a server outlived the interrupted bench"
    assert str(tmp_path) not in _worktrees() and "mlperf_peak_" not in _worktrees()


def test_a_baseline_that_is_neither_a_folder_nor_a_commit_is_refused_by_name() -> None:
    done = _run("--baseline-tree", "no-such-ref-xyz", "--qps", "4", timeout=60)
    assert done.returncode != 0 and "--baseline-tree 'no-such-ref-xyz'" in done.stderr, done.stderr
    done = _run("--qps", "4,x", timeout=60)
    assert done.returncode != 0 and "--qps '4,x'" in done.stderr, done.stderr
