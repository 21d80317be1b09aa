"""Derive the JSON Schemas the manifest tests use from KServe's published CRDs.

KServe's CRDs are structural OpenAPI schemas: the API server silently *prunes* a field it does not
know, so a misspelt `protocolVersoin` would vanish instead of failing. These schemas keep only the
parts of the CRD that sixfold's manifests use (a whitelist, below) and close every object the CRD
describes field by field (``additionalProperties: false``), so the same typo fails a test offline.
Fields not whitelisted are rejected too: using a new CRD field means adding it here and re-deriving.

    python tests/docker/schemas/derive_kserve.py /path/to/kserve-git-dir

reads ``config/crd/full/serving.kserve.io_{servingruntimes,inferenceservices}.yaml`` at that
repository's HEAD (``git show``) and rewrites the two ``*.schema.json`` files beside this script,
recording the commit in each schema's description.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["derive", "WHITELISTS"]

ALL = True
"""Whitelist leaf: keep the CRD's whole subtree below this field (closed where the CRD is)."""

WHITELISTS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    # file stem: (CRD file, version, kind, whitelist of spec fields)
    "servingruntime": ("config/crd/full/serving.kserve.io_servingruntimes.yaml", "v1alpha1", "ServingRuntime", {
        "annotations": ALL, "supportedModelFormats": ALL, "protocolVersions": ALL, "multiModel": ALL,
        "containers": ALL}),
    "inferenceservice": ("config/crd/full/serving.kserve.io_inferenceservices.yaml", "v1beta1", "InferenceService", {
        "predictor": {"minReplicas": ALL, "maxReplicas": ALL, "model": {
            "modelFormat": ALL, "runtime": ALL, "protocolVersion": ALL, "storageUri": ALL, "ports": ALL,
            "resources": ALL, "args": ALL, "env": ALL}}}),
}


def _close(schema: Any) -> Any:
    """Copy of a CRD subtree where every object listing its properties rejects any other."""
    if isinstance(schema, list):
        return [_close(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _close(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _pick(schema: dict[str, Any], whitelist: dict[str, Any], where: str) -> dict[str, Any]:
    """The object ``schema`` cut down to the whitelisted properties, closed."""
    if schema.get("type") == "array":
        return {**schema, "items": _pick(schema["items"], whitelist, where + "[]")}
    props = schema.get("properties", {})
    missing = sorted(set(whitelist) - set(props))
    if missing:
        raise KeyError(f"{where}: the CRD has no field {missing}")
    picked = {name: _close(props[name]) if sub is ALL else _pick(props[name], sub, f"{where}.{name}")
              for name, sub in whitelist.items()}
    out = {k: v for k, v in schema.items() if k not in ("properties", "required")}
    out["properties"] = picked
    required = [r for r in schema.get("required", []) if r in picked]
    if required:
        out["required"] = required
    out["additionalProperties"] = False
    return out


def derive(kserve_git_dir: Path) -> dict[str, dict[str, Any]]:
    """Schema per file stem, from the CRDs at the checkout's HEAD."""
    git = ["git", f"--git-dir={kserve_git_dir}"] if (kserve_git_dir / "HEAD").is_file() else ["git", "-C", str(kserve_git_dir)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    schemas = {}
    for stem, (path, version, kind, whitelist) in WHITELISTS.items():
        crd = yaml.safe_load(subprocess.run([*git, "show", f"HEAD:{path}"], check=True, capture_output=True,
                                            text=True).stdout)
        [served] = [v for v in crd["spec"]["versions"] if v["name"] == version]
        root = served["schema"]["openAPIV3Schema"]
        spec = _pick(root["properties"]["spec"], whitelist, "spec")
        schemas[stem] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"{kind} ({crd['spec']['group']}/{version}), the fields sixfold's manifests use",
            "description": (f"Derived by tests/docker/schemas/derive_kserve.py from kserve/kserve {path} at commit "
                            f"{commit}. Objects are closed (additionalProperties false): the API server would "
                            f"prune an unknown field silently."),
            "type": "object",
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "additionalProperties": False,
            "properties": {
                "apiVersion": {"const": f"{crd['spec']['group']}/{version}"},
                "kind": {"const": kind},
                "metadata": {"type": "object", "required": ["name"],
                             "properties": {"name": {"type": "string", "minLength": 1}}},
                "spec": spec,
            },
        }
    return schemas


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    here = Path(__file__).parent
    for stem, schema in derive(Path(argv[0])).items():
        (here / f"{stem}.schema.json").write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
        print(f"wrote {here / f'{stem}.schema.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
