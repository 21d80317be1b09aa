"""A Triton-style model repository on disk, read into plans and loadable artifacts.

    REPO/NAME/config.pbtxt        optional; Triton's ModelConfig in text format
    REPO/NAME/VERSION/plan.json   what ``sixfold-partition --out REPO/NAME/VERSION`` writes
    REPO/NAME/VERSION/...         the artifacts plan.json names (dense.onnx, tables/, host.onnx, host.pt2)

The model's name is its folder's name; versions are the numeric sub-folders
holding a plan.json. Which versions are served follows the config's
``version_policy`` (Triton's default: the latest one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from sixfold.backends.api import PartitionArtifact, pick_artifact
from sixfold.partitioner.plan import PartitionPlan

__all__ = ["ModelRepository", "RepositoryVersion", "RepositoryError"]

CONFIG_FILE = "config.pbtxt"
PLAN_FILE = "plan.json"


class RepositoryError(ValueError):
    """The repository, a model or a version is missing or malformed; the message names the path."""


@dataclass
class RepositoryVersion:
    """One version folder, read: its plan and every partition's artifact (plus other formats of it)."""

    name: str
    version: str
    path: Path
    plan: PartitionPlan
    artifacts: dict[str, PartitionArtifact]
    variants: dict[str, list[PartitionArtifact]] = field(default_factory=dict)

    def artifact_for(self, partition: str, backend) -> PartitionArtifact:
        """The partition in a format ``backend`` takes (``pick_artifact``); RepositoryError naming the folder."""
        try:
            return pick_artifact(partition, [self.artifacts[partition], *self.variants.get(partition, [])], backend)
        except ValueError as exc:
            raise RepositoryError(f"{self.path}: {exc}") from None


class ModelRepository:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise RepositoryError(f"model repository {self.root} is not a directory")

    def names(self) -> list[str]:
        """Every folder that holds at least one version (or a config), sorted."""
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".")
                      and ((p / CONFIG_FILE).is_file() or self._version_dirs(p)))

    @staticmethod
    def _version_dirs(model_dir: Path) -> list[Path]:
        found = [p for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit() and (p / PLAN_FILE).is_file()]
        return sorted(found, key=lambda p: int(p.name))

    def model_dir(self, name: str) -> Path:
        path = self.root / name
        if not path.is_dir() or name.startswith(".") or "/" in name or name in ("", "..", "."):
            raise RepositoryError(f"no model '{name}' in repository {self.root}; it has {self.names()}")
        return path

    def config(self, name: str) -> model_config_pb2.ModelConfig:
        """The model's config.pbtxt (Triton's ModelConfig), or an empty one named after the folder."""
        path = self.model_dir(name) / CONFIG_FILE
        config = model_config_pb2.ModelConfig()
        if path.is_file():
            try:
                text_format.Parse(path.read_text(), config)
            except text_format.ParseError as exc:
                raise RepositoryError(f"{path}: {exc}") from None
            if config.name and config.name != name:
                raise RepositoryError(f"{path}: name '{config.name}' differs from the folder name '{name}'")
        config.name = name
        return config

    def versions(self, name: str) -> list[str]:
        """All version folders with a plan, oldest first."""
        return [p.name for p in self._version_dirs(self.model_dir(name))]

    def served_versions(self, name: str) -> list[str]:
        """The versions the config's version_policy selects (default: the latest)."""
        available = self.versions(name)
        if not available:
            raise RepositoryError(f"model '{name}' in {self.root} has no version folder with a {PLAN_FILE} "
                                  f"(expected {self.root / name}/1/{PLAN_FILE}, written by sixfold-partition --out)")
        policy = self.config(name).version_policy
        kind = policy.WhichOneof("policy_choice")
        if kind == "all":
            return available
        if kind == "specific":
            wanted = [str(v) for v in policy.specific.versions]
            missing = [v for v in wanted if v not in available]
            if missing:
                raise RepositoryError(f"model '{name}': version_policy asks for versions {missing}, "
                                      f"but the repository has {available}")
            return wanted
        count = policy.latest.num_versions if kind == "latest" and policy.latest.num_versions > 0 else 1
        return available[-count:]

    def read(self, name: str, version: str) -> RepositoryVersion:
        """Read one version: its plan and the artifacts it names (tables memory-mapped, not copied)."""
        path = self.model_dir(name) / version
        if not (path / PLAN_FILE).is_file():
            raise RepositoryError(f"model '{name}' has no version '{version}' in {self.root}; "
                                  f"versions: {self.versions(name)}")
        try:
            plan = PartitionPlan.load(path / PLAN_FILE)
        except (ValueError, KeyError, TypeError) as exc:
            raise RepositoryError(f"{path / PLAN_FILE}: not a sixfold plan ({exc})") from None
        artifacts, variants = {}, {}
        for info in plan.partitions:
            artifacts[info.name] = _read_artifact(path, plan, info)
            if info.format == "onnx" and info.kind == "dense":
                variants[info.name] = []
        return RepositoryVersion(name=name, version=version, path=path, plan=plan, artifacts=artifacts,
                                 variants=variants)


def _read_artifact(folder: Path, plan: PartitionPlan, info) -> PartitionArtifact:
    if not info.artifact:
        raise RepositoryError(f"{folder / PLAN_FILE}: partition '{info.name}' names no artifact file")
    where = folder / info.artifact
    if not where.exists():
        raise RepositoryError(f"{folder / PLAN_FILE}: partition '{info.name}' artifact {where} is missing")
    common = dict(name=info.name, input_names=tuple(t.name for t in info.inputs),
                  output_names=tuple(t.name for t in info.outputs), param_bytes=info.param_bytes,
                  flops_per_item=info.flops_per_item, bytes_per_item=info.bytes_per_item,
                  dtype=getattr(info, "dtype", "fp32"), layouts=info.layouts())
    if where.is_dir():  # row-wise tables for the host-embedding stage
        return PartitionArtifact(format="tables", payload=str(where),
                                 metadata={"precision": plan.tables.get("precision", "fp32")}, **common)
    if where.suffix == ".onnx":
        return PartitionArtifact(format="onnx", payload=where.read_bytes(), **common)
    if where.suffix == ".pt2":
        import torch

        from sixfold.partitioner.frontends.host_export import unguarded_module
        program = torch.export.load(str(where))
        return PartitionArtifact(format="torch-fx", payload=unguarded_module(program), **common)
    raise RepositoryError(f"{where}: unknown artifact type (expected a tables/ folder, .onnx or .pt2)")
