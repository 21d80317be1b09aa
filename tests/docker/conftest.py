"""A real sixfold-serve started exactly as docker/k8s/deployment.yaml starts it (image ENTRYPOINT + args)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sixfold.server.workers.process import ReadyProcess
from tests.conftest import free_port
from tests.docker.manifests import Dockerfile, container_ports, documents, only, serve_command

SMALL_ROWS = "2000"
"""Appended --max-rows (argparse keeps the last): the manifest's 100,000-row tables take ~10 s to build."""


@dataclass
class Pod:
    """The server process, and where each of the manifest's named container ports is served here."""

    proc: ReadyProcess
    ports: dict[str, int]


def deployment_container() -> dict:
    return only(documents("k8s"), "Deployment", "sixfold")["spec"]["template"]["spec"]["containers"][0]


def start_like_the_pod(extra: tuple[str, ...] = ()) -> Pod:
    container = deployment_container()
    named = container_ports(container)
    local = {port: free_port() for port in named.values()}
    entrypoint = Dockerfile.read().exec_form("ENTRYPOINT")
    command = serve_command(entrypoint, container["args"], local)
    command[0] = str(Path(sys.executable).parent / command[0])
    proc = ReadyProcess([*command, "--max-rows", SMALL_ROWS, *extra], timeout_s=180)
    return Pod(proc, {name: local[port] for name, port in named.items()})


@pytest.fixture(scope="package")
def pod():
    started = start_like_the_pod()
    try:
        assert started.proc.url, started.proc.output
        yield started
    finally:
        started.proc.kill()
