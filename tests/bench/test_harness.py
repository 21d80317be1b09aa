"""bench/harness: sections and JSON, reading a search answer, and a real server started, probed, searched, stopped."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.harness.process import ServerProc
from bench.harness.report import md_row, md_rule, write_json, write_section
from bench.harness.sweep import INF, fmt_qps, fmt_ratio, interval, median_ratio, ratio

MODEL, ROWS = "tiny", 100


def test_a_section_replaces_only_its_own_block(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    write_section("a", "first", path)  # no file yet: a title, then the block
    write_section("b", "other", path)
    assert path.read_text().startswith("# Benchmarks\n\n<!-- bench:a begin -->\nfirst\n<!-- bench:a end -->\n")
    path.write_text(path.read_text().replace("<!-- bench:a end -->\n", "<!-- bench:a end -->\nprose under a\n"))
    write_section("a", "second\n\n", path)
    text = path.read_text()
    assert "second\n<!-- bench:a end -->\nprose under a\n" in text and "first" not in text
    assert text.count("<!-- bench:b begin -->\nother\n<!-- bench:b end -->") == 1
    write_json(tmp_path / "run.json", {"path": tmp_path, "bounds": {60.0: 1}})
    assert json.loads((tmp_path / "run.json").read_text()) == {"path": str(tmp_path), "bounds": {"60.0": 1}}
    assert md_row("m", "", 1.5) == "| m |  | 1.5 |" and md_rule(3) == "|---|---|---|"


def _answer(max_qps: float | None, queries: int | None = 200, at_ceiling: bool = False) -> dict:
    return {"max_qps": max_qps, "floor": 1.0, "queries": queries, "at_ceiling": at_ceiling}


def test_a_search_answer_is_an_interval_and_so_are_ratios() -> None:
    assert interval(None) is None
    assert interval({"max_qps": 0.0, "infeasible": True}) == (0.0, 0.0)
    assert interval(_answer(None, None)) == (0.0, 1.0)  # failed even the floor: below it
    assert interval(_answer(10.0, queries=12)) == (0.0, 10.0)  # † a handful of queries: at most
    assert interval(_answer(10.0, at_ceiling=True)) == (10.0, INF)  # passed the highest rate tried: at least
    assert interval(_answer(10.0)) == (10.0, 10.0)
    assert fmt_qps(_answer(None, None)) == "< 1" and fmt_qps(_answer(10.0, at_ceiling=True)) == "≥ 10.00"
    assert fmt_ratio(ratio((20.0, 20.0), (10.0, 10.0))) == "2.00"
    assert fmt_ratio(ratio((20.0, INF), (10.0, 10.0))) == "≥ 2.00"
    assert fmt_ratio(ratio((0.0, 20.0), (10.0, 10.0))) == "≤ 2.00"
    assert fmt_ratio(ratio((0.0, 0.0), (0.0, 0.0))) == "both 0"
    assert fmt_ratio(ratio((5.0, 5.0), (0.0, 0.0))) == "∞ (the other: 0)"
    assert fmt_ratio(ratio((5.0, 5.0), None)) == "n/a"
    runs = [ratio((a, a), (10.0, 10.0)) for a in (10.0, 30.0, 20.0)] + [None]
    assert median_ratio(runs) == {"low": 2.0, "high": 2.0, "both_zero": False}


def test_a_server_that_exits_at_once_says_why() -> None:
    server = ServerProc("broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
                        ready_line="READY grpc=")
    with pytest.raises(RuntimeError, match=r"broken did not start .*no model here"):
        server.start(MODEL, timeout_s=60)
    server.stop()
    assert not server.alive


def test_stop_ends_the_whole_process_group() -> None:
    server = ServerProc("group", [], ready_line="")
    server.proc = subprocess.Popen([sys.executable, "-c", "import subprocess, time\n"
                                    "print(subprocess.Popen(['sleep', '60']).pid, flush=True)\ntime.sleep(60)"],
                                   stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert server.proc.stdout is not None
    grandchild = int(server.proc.stdout.readline())
    server.stop()
    assert not server.alive
    deadline = time.monotonic() + 10
    while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:  # reaped by init
        time.sleep(0.05)
    gone = not Path(f"/proc/{grandchild}").exists()
    assert gone or Path(f"/proc/{grandchild}/stat").read_text().split()[2] == "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process groups and the parent-death signal")
def test_the_fifo_server_starts_answers_is_searched_and_stops() -> None:
    """The peers' start (READY line, model ready), wire's answers and idle latency in both input orders,
    and a two-step rate search, against the real FIFO server (tiny model, 1 thread)."""
    import torch

    from bench.harness.peers import fifo_server
    from bench.harness.sweep import search_max_qps
    from bench.harness.wire import DENSE_LAST, USUAL_ORDER, check_answers, idle_latency, inputs_in_order
    from sixfold import models
    from sixfold.loadgen import LoadConfig

    cfg = models.get_config(MODEL, max_rows=ROWS)
    model = models.build(MODEL, max_rows=ROWS, seed=0)
    queries = [models.RequestGenerator.for_config(cfg, seed=11).make(n) for n in (1, 30)]
    with torch.inference_mode():
        expected = [model(*[torch.from_numpy(q[k]) for k in USUAL_ORDER]).numpy() for q in queries]
    server = fifo_server(MODEL, ROWS, ["--threads", "1"])
    try:
        url = server.start(MODEL, timeout_s=180)
        assert server.alive and url.startswith("127.0.0.1:")
        for order in (USUAL_ORDER, DENSE_LAST):  # it takes inputs by name
            answers = asyncio.run(check_answers(url, MODEL, queries, expected, order, "int32"))
            assert answers["ok"] and answers["max_abs_diff"] < 1e-5, answers
        wrong = asyncio.run(check_answers(url, MODEL, queries, [e + 1 for e in expected], USUAL_ORDER))
        assert not wrong["ok"] and wrong["max_abs_diff"] == pytest.approx(1.0, abs=1e-5)
        gen = models.RequestGenerator.for_config(cfg, seed=13)
        median, fastest = asyncio.run(idle_latency(url, MODEL, gen, DENSE_LAST, (1, 50), 2))
        assert set(median) == set(fastest) == {1, 50} and all(fastest[n] <= median[n] for n in median)
        config = LoadConfig(url=url, model=MODEL, query_size="fixed:2", table_rows=cfg.table_rows,
                            pooling=cfg.pooling, zipf=cfg.zipf, dense_dim=cfg.dense_dim, qps=20.0, duration_s=1.0,
                            warmup_s=0.1, seed=1, wait_ready_s=30.0)
        with inputs_in_order(DENSE_LAST):
            found = asyncio.run(search_max_qps(config, p99_ms=5_000.0, lo=20.0, hi=40.0, floor=1.0, step_s=1.0,
                                               tolerance=0.5, max_steps=2, settle_s=0.1))
        # 20 then 40 q/s of 2-item queries, a 5 s bound: a server of some 300 q/s passes both
        assert found["max_qps"] is not None and found["max_qps"] >= 20.0, found
        assert found["at_ceiling"] == (found["max_qps"] == 40.0) and 1 <= len(found["steps"]) <= 2
        assert found["queries"] > 0 and found["p99_ms"] <= 5_000.0 and found["hi"] == 40.0
        pid = server.proc.pid
    finally:
        server.stop()
    assert not server.alive
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing of its group left
