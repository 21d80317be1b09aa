"""Reading docker/: the Dockerfile's instructions, compose.yaml, and the Kubernetes/KServe manifests."""

from __future__ import annotations

import importlib.util
import json
import re
import runpy
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import setuptools
import yaml

__all__ = ["DOCKER", "DRAIN_PHASES", "ROOT", "Dockerfile", "container_ports", "distribution", "documents",
           "healthcheck", "only", "serve_command"]

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
DRAIN_PHASES = 4
"""sixfold.server.app.SixfoldServer.stop: queue drain, quiet period, REST close, gRPC close, each within the grace."""


def documents(folder: str) -> list[tuple[Path, dict[str, Any]]]:
    """Every YAML document under docker/``folder`` (sorted by file), with its file."""
    docs = []
    for path in sorted((DOCKER / folder).glob("*.yaml")):
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def only(docs: list[tuple[Path, dict[str, Any]]], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one document of ``kind`` (and ``name``): fails naming what there is otherwise."""
    found = [d for _, d in docs if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]
    kinds = [d.get("kind") for _, d in docs]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)} among {kinds}"
    return found[0]


def container_ports(container: dict[str, Any]) -> dict[str, int]:
    """Port name -> containerPort."""
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


@dataclass
class Dockerfile:
    """The instructions of docker/Dockerfile, continuation lines joined, comments dropped."""

    instructions: list[tuple[str, str]]

    @classmethod
    def read(cls, path: Path = DOCKER / "Dockerfile") -> "Dockerfile":
        text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                                if not line.lstrip().startswith("#")))
        instructions = []
        for line in text.splitlines():
            if line.strip():
                word, _, rest = line.strip().partition(" ")
                instructions.append((word.upper(), rest.strip()))
        return cls(instructions)

    def last(self, instruction: str) -> str:
        found = [rest for word, rest in self.instructions if word == instruction]
        assert found, f"the Dockerfile has no {instruction}"
        return found[-1]

    def exec_form(self, instruction: str) -> list[str]:
        """ENTRYPOINT/CMD in JSON (exec) form; the shell form would not take arguments from `docker run`."""
        value = json.loads(self.last(instruction))
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), value
        return value

    def exposed(self) -> set[int]:
        return {int(p.split("/")[0]) for word, rest in self.instructions if word == "EXPOSE" for p in rest.split()}

    def copies(self) -> list[tuple[str, str]]:
        """(source, where it lands relative to WORKDIR) for each source of each COPY (flags such as
        --chown dropped): a folder or file lands at the destination, or inside it when the destination
        is a folder ("./", ".", "dir/") or the COPY has several sources."""
        out = []
        for word, rest in self.instructions:
            if word != "COPY":
                continue
            parts = json.loads(rest) if rest.startswith("[") else shlex.split(rest)
            parts = [p for p in parts if not p.startswith("--")]
            *sources, dest = parts
            into = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
            for src in sources:
                out.append((str(Path(src)), str(Path(dest) / Path(src).name if into else Path(dest))))
        return out

    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        """(options, exec-form command) of HEALTHCHECK."""
        rest = self.last("HEALTHCHECK")
        options, _, command = rest.partition("CMD ")
        opts = dict(o[2:].split("=", 1) for o in shlex.split(options))
        return opts, json.loads(command)


def serve_command(entrypoint: list[str], args: list[str], ports: dict[int, int] | None = None,
                  host: str = "127.0.0.1") -> list[str]:
    """``entrypoint + args`` to run here: --host made loopback, and each --*-port P made ``ports[P]``."""
    ports = ports or {}
    out, i = [], 0
    words = [*entrypoint, *args]
    while i < len(words):
        word = words[i]
        if word == "--host":
            out += [word, host]
            i += 2
            continue
        if word.endswith("-port") and word.startswith("--") and i + 1 < len(words):
            out += [word, str(ports.get(int(words[i + 1]), words[i + 1]))]
            i += 2
            continue
        out.append(word)
        i += 1
    return out


def distribution() -> dict[str, Any]:
    """setup.py's arguments to setup() (``packages``, ``package_dir``) as pip gets them, and its
    ``SUBPACKAGES``."""
    captured: dict[str, Any] = {}
    real = setuptools.setup
    setuptools.setup = lambda **kwargs: captured.update(kwargs)
    try:
        names = runpy.run_path(str(ROOT / "setup.py"), run_name="__main__")
    finally:
        setuptools.setup = real
    return {**captured, "SUBPACKAGES": names["SUBPACKAGES"]}


def _load_healthcheck() -> Any:
    spec = importlib.util.spec_from_file_location("sixfold_docker_healthcheck", DOCKER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = _load_healthcheck()
"""docker/healthcheck.py, the image's HEALTHCHECK probe, as a module."""
