"""Memory of ``sixfold-serve --workers N``: PSS summed over the server's processes, by worker count.

Issue 35's goal: ``--workers 4`` holds at most 1.2x the PSS of ``--workers 1`` (one engine holds the
tables, models and cards once; each front end holds only its protocol stack and its arenas). Each
server is started alone, sent ``--requests`` queries of ``--items`` items over ``--connections`` gRPC
connections (so every front end serves some), left a second to settle, and measured: PSS from
``/proc/PID/smaps_rollup`` of every process in its tree (shared pages split between them, so the sum
is the server's real share of memory).

    .venv/bin/python bench/workers_memory.py --model rm2 --max-rows 100000 --workers 1 4
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.harness.peers import sixfold_server  # noqa: E402
from sixfold import models  # noqa: E402

MIB = 1 << 20


def pss_bytes(pid: int) -> int:
    """The process's proportional set size (its private pages plus its share of shared ones)."""
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    match = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) * 1024 if match else 0


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant (the supervisor, the engine, the front ends)."""
    found = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return found
    for child in children:
        found += process_tree(int(child))
    return found


def _send(url: str, model: str, queries: list[dict], connections: int) -> None:
    import tritonclient.grpc as tc

    def one_connection(k: int) -> None:
        with tc.InferenceServerClient(url, channel_args=[("grpc.use_local_subchannel_pool", 1)]) as client:
            for query in queries[k::connections]:
                inputs = []
                for name, array in query.items():
                    item = tc.InferInput(name, list(array.shape), {"float32": "FP32", "int32": "INT32",
                                                                   "int64": "INT64"}[str(array.dtype)])
                    item.set_data_from_numpy(array)
                    inputs.append(item)
                client.infer(model, inputs, client_timeout=120)

    threads = [threading.Thread(target=one_connection, args=(k,)) for k in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)


def measure(model: str, max_rows: int, workers: int, requests: int, items: int, connections: int) -> dict:
    server = sixfold_server(model, max_rows, None, batching=True, workers=workers)
    started = time.monotonic()
    server.start(model, timeout_s=600)
    try:
        start_s = time.monotonic() - started
        generator = models.RequestGenerator.for_config(models.get_config(model, max_rows=max_rows), seed=1)
        _send(server.url, model, [generator.make(items) for _ in range(requests)], connections)
        time.sleep(1.0)
        assert server.proc is not None
        pids = process_tree(server.proc.pid)
        each = {pid: pss_bytes(pid) for pid in pids}
        return {"workers": workers, "processes": len(pids), "pss_mib": round(sum(each.values()) / MIB, 1),
                "per_process_mib": [round(b / MIB, 1) for b in each.values()], "start_s": round(start_s, 1)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="rm2")
    p.add_argument("--max-rows", type=int, default=100_000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="worker counts, each its own server")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--items", type=int, default=100)
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    for workers in args.workers:
        row = measure(args.model, args.max_rows, workers, args.requests, args.items, args.connections)
        rows.append(row)
        print(f"--workers {workers}: {row['processes']} processes, PSS {row['pss_mib']:,.0f} MiB "
              f"(each {row['per_process_mib']}), started in {row['start_s']:g} s", flush=True)
    base = rows[0]["pss_mib"]
    for row in rows[1:]:
        print(f"--workers {row['workers']} / --workers {rows[0]['workers']}: {row['pss_mib'] / base:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
