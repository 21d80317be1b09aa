"""`make serve` takes the ports and any other sixfold-serve flags as make variables (read from `make -n`)."""

from __future__ import annotations

import shlex
import shutil
import subprocess

import pytest

from sixfold.server.cli import _parser
from tests.docker.manifests import ROOT


def _serve_command(*variables: str) -> list[str]:
    if shutil.which("make") is None:
        pytest.skip("needs make")
    shown = subprocess.run(["make", "-n", "-s", "serve", *variables], cwd=ROOT, capture_output=True, text=True,
                           timeout=60, check=True).stdout.replace("\\\n", " ")
    [line] = [line for line in shown.splitlines() if "bin/sixfold-serve" in line]
    words = shlex.split(line)
    return words[words.index(next(w for w in words if w.endswith("bin/sixfold-serve"))) + 1:]


def test_make_serve_defaults_are_sixfold_serves_ports():
    args = _parser().parse_args(_serve_command())
    assert (args.http_port, args.grpc_port, args.metrics_port) == (8000, 8001, 8002)


def test_make_serve_takes_ports_and_arguments():
    args = _parser().parse_args(_serve_command("HTTP_PORT=9000", "GRPC_PORT=9001", "METRICS_PORT=-1",
                                               "SERVE_ARGS=--workers 2 --log-format json", "MODEL=tiny"))
    assert (args.http_port, args.grpc_port, args.metrics_port) == (9000, 9001, -1)
    assert (args.workers, args.log_format, args.model) == (2, "json", "tiny")
