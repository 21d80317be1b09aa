"""docker/Dockerfile and docker/compose.yaml: the arguments parse, the ports agree, the health check works
against a real server, and compose builds one image, waits for health and keeps the report."""

from __future__ import annotations

import ast
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from sixfold.loadgen.cli import build_parser as loadgen_parser
from sixfold.server.app import ServerConfig
from sixfold.server.cli import _parser
from tests.conftest import make_certificate
from tests.docker.conftest import Pod, deployment_container, start_like_the_pod
from tests.docker.manifests import DOCKER, DRAIN_PHASES, ROOT, Dockerfile, distribution, healthcheck

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


HEALTHCHECK_SCRIPT = DOCKER / "healthcheck.py"


def _run_probe(*args: str) -> subprocess.CompletedProcess:
    """docker/healthcheck.py as Docker runs it (a process of its own), here with ``args``."""
    return subprocess.run([sys.executable, str(HEALTHCHECK_SCRIPT), *args], capture_output=True, text=True,
                          timeout=30)


def test_the_healthcheck_runs_the_copied_probe_with_sane_timings():
    dockerfile = Dockerfile.read()
    options, command = dockerfile.healthcheck()
    assert command[0] == "python" and len(command) == 2, "exec form: no shell, so no arguments to lose"
    workdir = Path(dockerfile.last("WORKDIR"))
    copied = {workdir / dest: src for src, dest in dockerfile.copies()}
    assert copied.get(Path(command[1])) == "docker/healthcheck.py"
    assert _seconds(options["start-period"]) >= 60 and _seconds(options["timeout"]) < _seconds(options["interval"])
    # What Docker asks is what the Kubernetes readiness probe asks.
    assert healthcheck.READY_PATH == deployment_container()["readinessProbe"]["httpGet"]["path"]


def test_the_probe_needs_nothing_the_slim_image_lacks():
    tree = ast.parse(HEALTHCHECK_SCRIPT.read_text())
    top = {alias.name.split(".")[0] for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top |= {node.module.split(".")[0] for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
            and node.level == 0}
    assert top - {"__future__"} <= sys.stdlib_module_names, top - sys.stdlib_module_names
    # grpc only where REST is off: a package the server itself needs (pyproject's dependencies).
    inner = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    inner |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert inner - sys.stdlib_module_names == {"grpc", "grpc_health"}
    deps = " ".join(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])
    assert "grpcio>=" in deps and "grpcio-health-checking" in deps


@pytest.mark.parametrize("run_args", [
    [], ["--http-port", "9000"], ["--http-port=9100", "--grpc-port", "9101"], ["--host", "10.1.2.3"],
    ["--tls-cert", "certs/tls.crt", "--tls-key", "certs/tls.key", "--http-port", "8443"],
    ["--http-port", "-1", "--grpc-port", "50051"], ["--model", "rm2", "--host-spec", "h.json", "--http-port", "1"],
])
def test_the_probe_reads_the_flags_as_the_server_does(run_args):
    """ENTRYPOINT + `docker run` arguments: the probe and sixfold-serve agree on host, ports and TLS."""
    argv = Dockerfile.read().exec_form("ENTRYPOINT")[1:] + run_args
    served = _parser().parse_args(argv)
    probed = healthcheck.server_flags(argv, "/opt/sixfold")
    assert (probed.host, probed.http_port, probed.grpc_port) == (served.host, served.http_port, served.grpc_port)
    assert probed.tls_cert == (str(Path("/opt/sixfold") / served.tls_cert) if served.tls_cert else None)


def test_the_probe_finds_the_server_in_a_command_line():
    find = healthcheck._server_args
    assert find(["sixfold-serve", "--http-port", "1"]) == ["--http-port", "1"]  # ENTRYPOINT, exec form
    assert find(["/usr/local/bin/python3.11", "/usr/local/bin/sixfold-serve", "--model", "rm2"]) == ["--model", "rm2"]
    assert find(["/sbin/docker-init", "--", "sixfold-serve"]) is None  # --init: the server is its child
    assert find(["sixfold-serve", "--as-engine", "/tmp/w"]) is None  # the engine under --workers, not the server
    assert find(["python", "docker/healthcheck.py"]) is None


def test_the_probe_passes_on_a_ready_server_and_fails_without_one(pod: Pod):
    itself = _run_probe("--pid", str(pod.proc.pid))  # the server's own command line, read from /proc
    assert itself.returncode == 0, itself.stdout + itself.stderr
    assert f"http://127.0.0.1:{pod.ports['http']}/v2/health/ready: 200" in itself.stdout
    assert _run_probe("--http-port", str(pod.ports["http"])).returncode == 0
    # REST off: the grpc.health.v1 service answers instead
    assert _run_probe("--http-port", "-1", "--grpc-port", str(pod.ports["grpc"])).returncode == 0
    wrong = _run_probe("--http-port", str(pod.ports["grpc"]))  # a port that does not speak the REST API
    assert wrong.returncode == 1 and wrong.stdout.startswith("unhealthy: ")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert _run_probe("--http-port", str(closed)).returncode == 1
    assert _run_probe("--http-port", "-1", "--grpc-port", str(closed)).returncode == 1
    assert _run_probe("--http-port", "0").returncode == 1  # a port picked at start cannot be known
    assert _run_probe("--pid", str(os.getpid())).returncode == 1  # not a sixfold-serve


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A certificate for a public name, not for loopback: the probe must not verify it."""
    return make_certificate(tmp_path_factory.mktemp("tls"), common_name="sixfold.example",
                            alt_names="DNS:sixfold.example")


@pytest.mark.parametrize("rest", ["https", "off"])
def test_the_probe_follows_tls_and_a_server_without_rest(certificate, rest):
    """A certificate for the public name (not loopback): HTTPS unverified on loopback, gRPC by its name;
    unhealthy from SIGTERM on (draining: ready answers 400)."""
    cert, key = certificate
    extra = ("--tls-cert", str(cert), "--tls-key", str(key)) + (("--http-port", "-1") if rest == "off"
                                                                 else ("--drain-seconds", "30"))
    started = start_like_the_pod(extra)
    try:
        assert started.proc.url, started.proc.output
        itself = _run_probe("--pid", str(started.proc.pid))
        assert itself.returncode == 0, itself.stdout + itself.stderr
        if rest == "https":
            assert itself.stdout.startswith(f"healthy: https://127.0.0.1:{started.ports['http']}/v2/health/ready")
            plain = _run_probe("--http-port", str(started.ports["http"]))  # http:// to an HTTPS port
            assert plain.returncode == 1, plain.stdout
            # SIGTERM: still serving for --drain-seconds, but no longer ready, so no longer healthy
            started.proc.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            while (answer := _run_probe("--pid", str(started.proc.pid))).returncode == 0 \
                    and time.monotonic() < deadline:
                time.sleep(0.2)
            assert answer.returncode == 1 and ": 400 " in answer.stdout, answer.stdout
        else:
            assert "grpc.health.v1" in itself.stdout and "SERVING" in itself.stdout
            plain = _run_probe("--http-port", "-1", "--grpc-port", str(started.ports["grpc"]))
            assert plain.returncode == 1, plain.stdout
    finally:
        started.proc.kill()


# --- the image holds what the distribution installs -----------------------------------------------------

def missing_from_image(dockerfile: Dockerfile) -> list[str]:
    """What `pip install .` in the image needs and no COPY brings to the same path: each installed
    package's folder, setup.py, pyproject.toml and the readme pyproject names."""
    dist = distribution()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = [Path("setup.py"), Path("pyproject.toml"), Path(project["readme"])]
    roots = sorted(dist["package_dir"], key=len, reverse=True)
    for package in dist["packages"]:
        name = next(r for r in roots if package == r or package.startswith(r + "."))
        needed.append(Path(dist["package_dir"][name], *package[len(name):].split(".")[1:]))
    copied = [(Path(src), Path(lands)) for src, lands in dockerfile.copies()]
    return [str(path) for path in needed
            if not any(src == lands and (path == src or path.is_relative_to(src)) for src, lands in copied)]


def test_the_image_copies_every_package_the_distribution_installs():
    dockerfile = Dockerfile.read()
    dist = distribution()
    assert "sixfold" in dist["packages"] and dist["package_dir"]["sixfold"] == "sixfold"
    assert {f"sixfold.{folder}" for folder in dist["SUBPACKAGES"]} <= set(dist["packages"])
    assert {dist["package_dir"][f"sixfold.{folder}"] for folder in dist["SUBPACKAGES"]} == set(dist["SUBPACKAGES"])
    assert missing_from_image(dockerfile) == []
    # the guard catches what the hand fix put back: sixfold/, setup.py, simulate/
    for dropped in ("sixfold", "simulate", "setup.py"):
        cut = Dockerfile([(w, r) for w, r in dockerfile.instructions
                          if not (w == "COPY" and dropped in r.split()[:-1])])
        assert any(m == dropped or m.startswith(dropped + "/") for m in missing_from_image(cut)), dropped


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
