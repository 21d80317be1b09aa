"""bench/request_path_stages.py: every stage of a real tiny request is timed and printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "request_path_stages.py"
STAGES = ("parse", "decode", "params", "validate", "encode", "serialize", "stats")


def test_each_stage_gets_a_time_and_the_total_is_their_sum() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--number", "20", "--repeat", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    figures = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(\w+)\s+([\d.]+)$", proc.stdout, re.M)}
    assert set(figures) == {*STAGES, "total"}, proc.stdout
    assert all(figures[s] > 0 for s in STAGES), figures
    assert abs(figures["total"] - sum(figures[s] for s in STAGES)) < 0.05


def test_a_count_below_one_is_refused_naming_the_flags() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--number", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--number" in proc.stderr


def test_the_engine_hop_of_workers_is_timed_over_a_real_socket_and_can_be_left_out() -> None:
    hop = re.compile(r"^front end -> engine hop .*, (\d+) requests, 4 in flight\): ([\d.]+) us per request$", re.M)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--number", "20", "--repeat", "1", "--hop-seconds", "0.3",
                           "--hop-concurrency", "4"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    match = hop.search(proc.stdout)
    assert match and int(match.group(1)) > 0 and float(match.group(2)) > 0, proc.stdout
    proc = subprocess.run([sys.executable, str(SCRIPT), "--number", "20", "--repeat", "1", "--hop-seconds", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "hop" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--hop-seconds", "-1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--hop-seconds" in proc.stderr


def test_a_batch_through_the_runtime_is_timed_per_batch_and_per_request_and_can_be_left_out() -> None:
    line = re.compile(r"^batch of 2 request\(s\) through PlanRuntime.run .*, (\d+) batches\): ([\d.]+) us per batch, "
                      r"([\d.]+) us per request$", re.M)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--number", "20", "--repeat", "1", "--hop-seconds", "0",
                           "--batch-rows", "2", "--batch-seconds", "0.3"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    match = line.search(proc.stdout)
    assert match and int(match.group(1)) > 0 and float(match.group(2)) > 0, proc.stdout
    assert abs(float(match.group(3)) - float(match.group(2)) / 2) < 0.01
    proc = subprocess.run([sys.executable, str(SCRIPT), "--number", "20", "--repeat", "1", "--hop-seconds", "0",
                           "--batch-rows", "0"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "PlanRuntime" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--batch-rows", "-1"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "--batch-rows" in proc.stderr
