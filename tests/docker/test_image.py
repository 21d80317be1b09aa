"""docker/Dockerfile and docker/compose.yaml: the arguments parse, the ports agree, the health check works
against a real server, and compose builds one image, waits for health and keeps the report."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import yaml

from sixfold.loadgen.cli import build_parser as loadgen_parser
from sixfold.server.app import ServerConfig
from sixfold.server.cli import _parser
from tests.docker.conftest import Pod
from tests.docker.manifests import DOCKER, DRAIN_PHASES, Dockerfile

COMPOSE = yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _seconds(text: str) -> float:
    """Docker's durations as these files use them: '45s', '2m', '120s'."""
    units = {"s": 1, "m": 60}
    return float(text[:-1]) * units[text[-1]]


def test_entrypoint_and_cmd_parse_and_expose_the_ports():
    dockerfile = Dockerfile.read()
    entrypoint, cmd = dockerfile.exec_form("ENTRYPOINT"), dockerfile.exec_form("CMD")
    assert entrypoint[0] == "sixfold-serve"
    args = _parser().parse_args(entrypoint[1:] + cmd)
    assert args.host == "0.0.0.0"
    assert dockerfile.exposed() == {args.http_port, args.grpc_port, args.metrics_port} == {8000, 8001, 8002}


def test_healthcheck_asks_the_ready_endpoint_of_the_rest_port():
    dockerfile = Dockerfile.read()
    options, command = dockerfile.healthcheck()
    args = _parser().parse_args(dockerfile.exec_form("ENTRYPOINT")[1:])
    assert command[:2] == ["python", "-c"]
    assert f"http://127.0.0.1:{args.http_port}/v2/health/ready" in command[2]
    assert _seconds(options["start-period"]) >= 60 and _seconds(options["timeout"]) < _seconds(options["interval"])


def _run_healthcheck(port: int) -> int:
    _, command = Dockerfile.read().healthcheck()
    code = command[2].replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    assert code != command[2]
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode


def test_the_healthcheck_passes_on_a_ready_server_and_fails_without_one(pod: Pod):
    assert _run_healthcheck(pod.ports["http"]) == 0
    assert _run_healthcheck(pod.ports["grpc"]) != 0  # a port that does not speak the REST API
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert _run_healthcheck(closed) == 1


def test_compose_builds_one_image_and_both_services_run_it():
    services = COMPOSE["services"]
    built = [name for name, s in services.items() if "build" in s]
    assert built == ["sixfold"]
    image = services["sixfold"]["image"]
    assert image == "sixfold:local"
    assert all(s["image"] == image for s in services.values())
    build = services["sixfold"]["build"]
    assert (DOCKER / build["context"] / build["dockerfile"]).resolve() == (DOCKER / "Dockerfile").resolve()


def test_compose_server_publishes_every_port_and_drains():
    server = COMPOSE["services"]["sixfold"]
    dockerfile = Dockerfile.read()
    args = _parser().parse_args(dockerfile.exec_form("ENTRYPOINT")[1:] + server["command"])
    published = {tuple(int(p) for p in spec.split(":")) for spec in server["ports"]}
    assert published == {(p, p) for p in (args.http_port, args.grpc_port, args.metrics_port)}
    assert _seconds(server["stop_grace_period"]) >= args.drain_seconds + DRAIN_PHASES * ServerConfig().grace_seconds


def test_compose_loadgen_waits_for_health_and_keeps_its_report():
    loadgen = COMPOSE["services"]["loadgen"]
    assert loadgen["depends_on"] == {"sixfold": {"condition": "service_healthy"}}
    # service_healthy needs a health check: the image's HEALTHCHECK (compose may not override it away)
    assert "HEALTHCHECK" in {word for word, _ in Dockerfile.read().instructions}
    assert "healthcheck" not in COMPOSE["services"]["sixfold"]
    assert loadgen["entrypoint"] == ["sixfold-loadgen"]
    args = loadgen_parser().parse_args(loadgen["command"])
    host, port = args.url.rsplit(":", 1)
    server_args = _parser().parse_args(Dockerfile.read().exec_form("ENTRYPOINT")[1:])
    assert (host, int(port)) == ("sixfold", server_args.grpc_port)
    assert args.model == _parser().parse_args(COMPOSE["services"]["sixfold"]["command"]).model
    assert args.plot
    mounts = dict(m.split(":", 1) for m in loadgen["volumes"])
    [(volume, target)] = mounts.items()
    assert volume in COMPOSE["volumes"], "a named volume (the image's user cannot write a root-owned bind mount)"
    assert Path(args.report).parent == Path(target) and Path(args.plot).parent == Path(target)
    run_dirs = [rest for word, rest in Dockerfile.read().instructions if word == "RUN" and f"mkdir {target}" in rest]
    assert run_dirs and f"chown sixfold:sixfold {target}" in run_dirs[0], "the volume starts owned by the image's user"
