#!/usr/bin/env bash
# The CUDA check of the card backends, on a lent GPU machine with no internet (see docs/backends.md).
#
# Run from anywhere in the repository with the wheels of what the machine lacks in .whl/ and the project's
# sixfold.egg-info (its entry points register the backends), both carried along:
#     scripts/device_check.sh [extra bench/cuda_backends.py arguments, e.g. --quick]
# Installs .whl/*.whl into /tmp/site (no project install: PYTHONPATH is the repo root), prints the
# versions that matter, checks that the project imports, then runs bench/cuda_backends.py with its
# JSON and log under $OUT (default /tmp/out).
set -uo pipefail

OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
SITE=/tmp/site
WHL="${WHL_DIR:-.whl}"
export PYTHONUNBUFFERED=1

{
  echo "== device_check $(date -u +%FT%TZ) in $PWD, OUT=$OUT"
  if ls "$WHL"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
      || { echo "WARNING: pip install of $WHL/ failed; unpacking the wheels into $SITE instead"
           "$PY" - "$SITE" "$WHL"/*.whl <<'UNPACK'
import sys, zipfile
site, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:  # a wheel is a zip: its files go to site, *.data/{purelib,platlib}/ to site too
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            info.filename = "/".join(parts)
            z.extract(info, site)
    print("unpacked", wheel)
UNPACK
         }
  else
    echo "WARNING: no $WHL/*.whl here (carry .whl); relying on what is installed"
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "== versions"
  "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("torch", "numpy", "onnx", "onnxscript", "onnxruntime", "grpc", "google.protobuf",
             "tritonclient", "grpc_health", "starlette", "uvicorn", "onnxconverter_common", "rapidjson"):
    try:
        m = importlib.import_module(name)
        print(f"{name:22s} {getattr(m, '__version__', '?'):24s} {getattr(m, '__file__', '')}")
    except Exception as exc:
        print(f"{name:22s} MISSING: {type(exc).__name__}: {exc}")
try:
    import torch
    print("torch.version.cuda", torch.version.cuda, "cuda available", torch.cuda.is_available(),
          "devices", torch.cuda.device_count(),
          torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
except Exception as exc:
    print("torch.cuda: error", exc)
try:
    import onnxruntime
    print("onnxruntime providers", onnxruntime.get_available_providers(), "device", onnxruntime.get_device())
except Exception as exc:
    print("onnxruntime: error", exc)
EOF
  nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
  echo "== imports"
  "$PY" -c 'import sixfold.server, sixfold.backends, sixfold.partitioner, sixfold.models
import sixfold.server.loading.loader, sixfold.server.app, sixfold.server.transport.http_app, sixfold.server.cli, sixfold.partitioner.precision.dense
import tritonclient.grpc, grpc_health.v1.health_pb2, starlette, uvicorn
print("project imports ok")' || echo "WARNING: a project import failed (the bench may still run)"
  echo "== bench/cuda_backends.py $*"
  "$PY" bench/cuda_backends.py --json "$OUT/cuda_backends.json" "$@"
  rc=$?
  echo "== bench rc $rc"
  exit $rc
} 2>&1 | tee "$OUT/cuda_backends.log"
exit "${PIPESTATUS[0]}"
