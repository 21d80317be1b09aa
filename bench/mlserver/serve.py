"""Serve a zoo model with Seldon MLServer (for loadgen checks and serving benchmarks).

    make mlserver-venv                       # once: .venv-mlserver with mlserver 1.7 + torch CPU
    .venv-mlserver/bin/python bench/mlserver/serve.py --model rm2 --max-rows 50000 --grpc-port 8081

Writes MLServer's settings into a temporary folder and runs `mlserver start` on it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # NOTE: .venv-mlserver does not install sixfold; the zoo is read from the checkout

from sixfold import models  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="rm2")
    p.add_argument("--max-rows", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grpc-port", type=int, default=8081)
    p.add_argument("--http-port", type=int, default=8080)
    p.add_argument("--max-batch-size", type=int, default=0, help="MLServer adaptive batching (0: off)")
    p.add_argument("--max-batch-time", type=float, default=0.002, help="seconds an adaptive batch may wait")
    args = p.parse_args()
    config = models.get_config(args.model, max_rows=args.max_rows)
    folder = Path(tempfile.mkdtemp(prefix="sixfold-mlserver-"))
    (folder / "settings.json").write_text(json.dumps({
        "grpc_port": args.grpc_port, "http_port": args.http_port, "metrics_port": 0,
        "host": "127.0.0.1", "load_models_at_startup": True, "parallel_workers": 0,
        "grpc_max_message_length": 1 << 30}))
    settings = {
        "name": args.model, "implementation": "runtime.ZooModel",
        "inputs": [{"name": "dense_features", "datatype": "FP32", "shape": [-1, config.dense_dim]},
                   {"name": "sparse_lengths", "datatype": "INT32", "shape": [-1, config.num_tables]},
                   {"name": "sparse_indices", "datatype": "INT64", "shape": [-1]}],
        "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 1]}],
        "parameters": {"extra": {"model": args.model, "max_rows": args.max_rows, "seed": args.seed}},
    }
    if args.max_batch_size:
        settings.update(max_batch_size=args.max_batch_size, max_batch_time=args.max_batch_time)
    model_dir = folder / args.model
    model_dir.mkdir()
    (model_dir / "model-settings.json").write_text(json.dumps(settings))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO)])}
    mlserver = Path(sys.executable).parent / "mlserver"
    return subprocess.call([str(mlserver), "start", str(folder)], env=env)


if __name__ == "__main__":
    sys.exit(main())
