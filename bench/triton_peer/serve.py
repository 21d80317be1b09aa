"""Serve a zoo model with NVIDIA Triton Inference Server (the serving benchmarks' Triton peer).

    make triton-venv                         # once: .venv-triton (distribution python3.11) with the
                                             # nvidia-pytriton 0.7.0 wheel (Triton 2.51) + torch CPU
    .venv-triton/bin/python bench/triton_peer/serve.py --model rm2 --max-rows 50000 --grpc-port 8101
    .venv-triton/bin/python bench/triton_peer/serve.py --model rm2 --dynamic-batching --max-batch-size 16

Triton comes from the ``nvidia-pytriton`` wheel, which carries ``tritonserver`` with the Python backend
only (no ONNX Runtime or libtorch backend): the model is torch behind the Python backend
(``bench/triton_peer/model.py``), the same weights (same seed) as sixfold's. This script writes a model
repository (``config.pbtxt`` + ``model.py``) into a temporary folder, puts the Python-backend stub of
this interpreter's version beside the backend, and runs ``tritonserver`` in the foreground; it prints
``READY grpc=HOST:PORT`` once the model answers.

Configurations: ``--instances N`` (``instance_group`` count: N stub processes, each its own model copy),
``--threads T`` (torch threads per instance), ``--dynamic-batching``, and ``--empty`` (the same signature
answered with zeros: Triton's own cost per request, the serving-overhead bench's empty model). Triton's dynamic batcher needs
every input to share its first dimension (the batch), which a recommendation request's inputs do not
(rows per item, ids per request), so with it each input takes a leading batch dimension of 1 with
``allow_ragged_batch``: Triton batches whole requests, and clients send them with
``sixfold-loadgen --batch-dim``. ``OMP_WAIT_POLICY=PASSIVE`` is set for the stubs: torch's spinning OpenMP
threads otherwise starve everything else on a small host.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pytriton() -> Path:
    import pytriton  # noqa: the wheel's package folder holds tritonserver

    return Path(pytriton.__file__).parent


def _config(args: argparse.Namespace, dense_dim: int, tables: int, table_rows: str, pooling: str) -> str:
    batched = args.dynamic_batching
    ragged = " allow_ragged_batch: true" if batched else ""
    params = {"zoo_model": args.model, "max_rows": str(args.max_rows), "seed": str(args.seed),
              "threads": str(args.threads), "empty": "true" if args.empty else "false", "sixfold.table_rows": table_rows, "sixfold.pooling": pooling}
    lines = [
        f'name: "{args.model}"', 'backend: "python"',
        f"max_batch_size: {args.max_batch_size if batched else 0}",
        "input [",
        f'  {{ name: "dense_features" data_type: TYPE_FP32 dims: [ -1, {dense_dim} ]{ragged} }},',
        f'  {{ name: "sparse_lengths" data_type: TYPE_INT32 dims: [ -1, {tables} ]{ragged} }},',
        f'  {{ name: "sparse_indices" data_type: TYPE_INT64 dims: [ -1 ]{ragged} }}',
        "]",
        'output [ { name: "scores" data_type: TYPE_FP32 dims: [ -1, 1 ] } ]',
        f"instance_group [ {{ count: {args.instances} kind: KIND_CPU }} ]",
    ]
    if batched:
        lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {args.max_queue_delay_us} }}")
    for key, value in params.items():
        lines.append(f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    return "\n".join(lines) + "\n"


def _die_with_parent() -> None:
    """tritonserver gets SIGTERM when this script dies, however it dies (PR_SET_PDEATHSIG)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


def _wait_ready(http_port: int, model: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{http_port}/v2/models/{model}/ready"
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.2)
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="rm2")
    p.add_argument("--max-rows", type=int, default=50_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grpc-port", type=int, default=8101)
    p.add_argument("--http-port", type=int, default=8100)
    p.add_argument("--metrics-port", type=int, default=8102)
    p.add_argument("--instances", type=int, default=1, help="model instances (instance_group count)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    p.add_argument("--dynamic-batching", action="store_true",
                   help="Triton's dynamic batcher over whole requests (clients send --batch-dim requests)")
    p.add_argument("--max-batch-size", type=int, default=16, help="requests per dynamic batch")
    p.add_argument("--max-queue-delay-us", type=int, default=2000, help="dynamic batcher's window")
    p.add_argument("--empty", action="store_true",
                   help="answer zeros without running the model: what Triton itself costs a request")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    args = p.parse_args()
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # NOTE: .venv-triton does not install sixfold; the zoo comes from the checkout
    from sixfold import models

    cfg = models.get_config(args.model, max_rows=args.max_rows)
    folder = Path(tempfile.mkdtemp(prefix="sixfold-triton-"))
    try:
        server = folder / "tritonserver"
        shutil.copytree(_pytriton() / "tritonserver", server, ignore=shutil.ignore_patterns("python_backend_stubs"))
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = _pytriton() / "tritonserver" / "python_backend_stubs" / version / "triton_python_backend_stub"
        shutil.copy2(stub, server / "backends" / "python" / stub.name)
        model_dir = folder / "repository" / args.model
        (model_dir / "1").mkdir(parents=True)
        shutil.copy2(Path(__file__).with_name("model.py"), model_dir / "1" / "model.py")
        site = [p for p in sys.path if p.endswith("site-packages")]
        (model_dir / "1" / "sys_path.json").write_text(json.dumps([str(REPO), *site]))
        (model_dir / "config.pbtxt").write_text(_config(
            args, cfg.dense_dim, len(cfg.table_rows), ",".join(map(str, cfg.table_rows)),
            ",".join(map(str, cfg.pooling))))
        libs = Path(_pytriton()).parent / "nvidia_pytriton.libs"
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE",
               "LD_LIBRARY_PATH": os.pathsep.join(filter(None, (str(libs), os.environ.get("LD_LIBRARY_PATH"))))}
        argv = [str(server / "bin" / "tritonserver"), "--model-repository", str(folder / "repository"),
                "--backend-directory", str(server / "backends"), "--grpc-port", str(args.grpc_port),
                "--http-port", str(args.http_port), "--metrics-port", str(args.metrics_port),
                "--grpc-address", "127.0.0.1", "--http-address", "127.0.0.1", "--log-verbose", "0",
                "--allow-gpu-metrics", "false", "--exit-on-error", "true"]
        proc = subprocess.Popen(argv, env=env, preexec_fn=_die_with_parent)
        signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
        if not _wait_ready(args.http_port, args.model, proc, args.ready_timeout):
            proc.terminate()
            proc.wait(30)
            print(f"triton did not get {args.model} ready in {args.ready_timeout:g} s", file=sys.stderr)
            return 1
        print(f"READY grpc=127.0.0.1:{args.grpc_port}", flush=True)
        return proc.wait()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
