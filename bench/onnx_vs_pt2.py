"""An ONNX export served against the same model's .pt2: same server, same requests (issue 31 item 3).

A DLRM-style model (26 ``nn.EmbeddingBag`` tables of ``--rows`` rows, a bottom and a top MLP, sum
bags) is exported three ways: ``torch.export`` (.pt2) and ONNX with both of torch's exporters
(dynamo and legacy ``dynamo=False``; both write each bag as a ``Loop``). Each is partitioned with
``sixfold-partition --cards 2``, all are served by one ``sixfold-serve --model-repository``, and
the same ``--requests`` requests (MLPerf's 100..700 items) go to each export in turn, one at a
time; p50 per export and the ONNX/.pt2 ratio are reported, and every answer is checked against
the model's own forward. ``--form jagged`` feeds the bags through offsets (1..3 ids per bag)
instead of one id each.

    .venv/bin/python bench/onnx_vs_pt2.py --no-write
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the checkout, not bench/ (bench/triton shadows triton)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench.harness.commands import command  # noqa: E402
from bench.harness.process import ServerProc  # noqa: E402
from bench.harness.report import machine_line, md_row, md_rule, publish  # noqa: E402

TABLES, DENSE, DIM = 26, 13, 16
NAMES = ("dense_features", "sparse_lengths", "sparse_indices")
MLPERF_ITEMS = (100, 100, *[200] * 12, 300, 300, 400, 500, 600, 700)


class DLRMish(nn.Module):
    """26 sum bags, a bottom MLP, concat, a top MLP: the DLRM shape without the dot interaction."""

    def __init__(self, rows: int, jagged: bool, repeat_interleave: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, DIM, mode="sum") for _ in range(TABLES))
        self.bottom = nn.Sequential(nn.Linear(DENSE, 64), nn.ReLU(), nn.Linear(64, DIM), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(DIM * (TABLES + 1), 256), nn.ReLU(), nn.Linear(256, 64), nn.ReLU(),
                                 nn.Linear(64, 1))
        self.jagged, self.repeat_interleave = jagged, repeat_interleave

    def table_of_id(self, sparse_lengths: torch.Tensor, ids: int) -> torch.Tensor:
        """Which table each id belongs to (sample-major). ``repeat_interleave`` exports to a [bags x ids]
        comparison (dynamo) or a Loop (legacy), so by default: a 1 at each bag's start, summed up."""
        per_bag = sparse_lengths.reshape(-1).long()
        if self.repeat_interleave:
            return torch.arange(TABLES).repeat(sparse_lengths.shape[0]).repeat_interleave(per_bag)
        starts = torch.cumsum(per_bag, 0) - per_bag
        marks = torch.zeros(ids + 1, dtype=torch.long).index_add(0, starts, torch.ones_like(starts))
        return (torch.cumsum(marks[:ids], 0) - 1) % TABLES

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        n = sparse_lengths.shape[0]
        if self.jagged:
            table_of_id = self.table_of_id(sparse_lengths, sparse_indices.shape[0])
            pooled = []
            for t, bag in enumerate(self.bags):
                lengths = sparse_lengths[:, t].long()
                pooled.append(bag(sparse_indices[table_of_id == t], torch.cumsum(lengths, 0) - lengths))
        else:
            ids = sparse_indices.reshape(n, TABLES)
            pooled = [bag(ids[:, t:t + 1]) for t, bag in enumerate(self.bags)]
        return torch.sigmoid(self.top(torch.cat([self.bottom(dense_features), *pooled], dim=1)))


def make_request(items: int, rows: int, jagged: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4, size=(items, TABLES)) if jagged else np.ones((items, TABLES))
    return {"dense_features": rng.standard_normal((items, DENSE)).astype(np.float32),
            "sparse_lengths": lengths.astype(np.int32),
            "sparse_indices": rng.integers(0, rows, size=int(lengths.sum())).astype(np.int64)}


def export_all(model: DLRMish, rows: int, folder: Path) -> dict[str, Path]:
    example = make_request(4, rows, model.jagged, seed=0)
    args = tuple(torch.from_numpy(example[n]) for n in NAMES)
    batch, ids = torch.export.Dim("batch", min=2, max=4096), torch.export.Dim("ids", min=2, max=1 << 22)
    shapes = {"dense_features": {0: batch}, "sparse_lengths": {0: batch},
              "sparse_indices": {0: ids if model.jagged else TABLES * batch}}
    files = {"pt2": folder / "m_pt2.pt2", "onnx_dynamo": folder / "m_onnx_dynamo.onnx",
             "onnx_legacy": folder / "m_onnx_legacy.onnx"}
    for noisy in ("torch.onnx", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.export.save(torch.export.export(model, args, dynamic_shapes=shapes), files["pt2"])
    torch.onnx.export(model, args, str(files["onnx_dynamo"]), dynamo=True, verbose=False, input_names=list(NAMES),
                      output_names=["scores"], dynamic_shapes=shapes)
    torch.onnx.export(model, args, str(files["onnx_legacy"]), dynamo=False, input_names=list(NAMES),
                      output_names=["scores"], dynamic_axes={n: {0: n} for n in [*NAMES, "scores"]})
    return files


def partition(files: dict[str, Path], repo: Path, jagged: bool) -> dict[str, float]:
    seconds = {}
    for name, path in files.items():
        start = time.monotonic()
        argv = [*command("sixfold-partition"), str(path), "--cards", "2", "--name", name, "--out", str(repo / name / "1")]
        if path.suffix == ".onnx" and not jagged:
            argv += ["--pooling", "1"]
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"sixfold-partition {path.name} failed ({done.returncode}): {done.stderr[-2000:]}")
        seconds[name] = time.monotonic() - start
    return seconds


def infer(client, name: str, req: dict[str, np.ndarray]) -> np.ndarray:
    import tritonclient.grpc as tc
    inputs = []
    for key, dtype in zip(NAMES, ("FP32", "INT32", "INT64")):
        inputs.append(tc.InferInput(key, list(req[key].shape), dtype))
        inputs[-1].set_data_from_numpy(req[key])
    return client.infer(name, inputs).as_numpy("scores")


def measure(url: str, names: list[str], model: DLRMish, rows: int, requests: int) -> dict[str, dict]:
    """Each request to every export in turn (the same load at the same moment); p50/p90 and max |diff| per export."""
    import tritonclient.grpc as tc
    client = tc.InferenceServerClient(url)
    rng = np.random.default_rng(1)
    sizes = rng.choice(MLPERF_ITEMS, size=requests)
    times: dict[str, list[float]] = {n: [] for n in names}
    gaps: dict[str, float] = {n: 0.0 for n in names}
    for name in names:  # warm-up, not timed
        infer(client, name, make_request(100, rows, model.jagged, seed=99))
    for i, items in enumerate(sizes):
        req = make_request(int(items), rows, model.jagged, seed=100 + i)
        with torch.inference_mode():
            want = model(*(torch.from_numpy(req[n]) for n in NAMES)).numpy()
        for name in names:
            start = time.perf_counter()
            got = infer(client, name, req)
            times[name].append(time.perf_counter() - start)
            gaps[name] = max(gaps[name], float(np.max(np.abs(got - want))))
    client.close()
    return {n: {"p50_ms": 1e3 * float(np.percentile(times[n], 50)), "p90_ms": 1e3 * float(np.percentile(times[n], 90)),
                "max_abs_diff": gaps[n]} for n in names}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1000, help="rows per table (default 1000)")
    p.add_argument("--requests", type=int, default=40, help="requests sent to each export (default 40)")
    p.add_argument("--form", choices=["onehot", "jagged"], default="onehot", help="one id per bag, or 1..3 via offsets")
    p.add_argument("--repeat-interleave", action="store_true",
                   help="jagged: find each id's table with repeat_interleave (slow in both ONNX exports)")
    p.add_argument("--quick", action="store_true", help="10 requests (run_all's smoke run)")
    p.add_argument("--no-write", action="store_true", help="print the section, leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    if args.quick:
        args.requests = min(args.requests, 10)
    jagged = args.form == "jagged"
    model = DLRMish(args.rows, jagged, args.repeat_interleave).eval()
    with tempfile.TemporaryDirectory(prefix="onnx_vs_pt2_") as tmp:
        folder = Path(tmp)
        files = export_all(model, args.rows, folder)
        part_s = partition(files, folder / "repo", jagged)
        server = ServerProc("sixfold", [*command("sixfold-serve"), "--model-repository", str(folder / "repo"),
                                        "--host", "127.0.0.1", "--grpc-port", "0", "--metrics-port", "-1",
                                        "--http-port", "-1", "--drain-seconds", "0"], ready_line="READY grpc=")
        try:
            url = server.start("pt2")
            results = measure(url, list(files), model, args.rows, args.requests)
        finally:
            server.stop()
    base = results["pt2"]["p50_ms"]
    flags = f"--form {args.form}" + (" --repeat-interleave" if args.repeat_interleave else "")
    lines = [f"`python bench/onnx_vs_pt2.py {flags}` ({machine_line(f'{TABLES} tables x {args.rows} rows')}; "
             f"{args.requests} requests of 100..700 items, each sent to every export in turn, one at a time; "
             "one sixfold-serve, 2 simulated cards):", "",
             md_row("export", "p50 ms", "p90 ms", "p50 / .pt2", "max abs diff vs torch", "partition s"), md_rule(6)]
    for name, r in results.items():
        lines.append(md_row(name, f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}", f"{r['p50_ms'] / base:.2f}x",
                            f"{r['max_abs_diff']:.1e}", f"{part_s[name]:.1f}"))
    publish(f"onnx_vs_pt2_{args.form}" + ("_repeat_interleave" if args.repeat_interleave else ""), "\n".join(lines), write=not args.no_write)
    worst = max(r["p50_ms"] / base for n, r in results.items() if n != "pt2")
    return 0 if worst <= 1.5 and all(r["max_abs_diff"] < 1e-4 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
