"""Strict checking of Kubernetes objects against the `kubernetes` client's models.

The client's deserializer fills a model from a dict and *ignores* keys it does not know, so a
manifest with `readinesProbe:` deserializes fine and the probe is silently missing, as the API
server would also drop it. ``unknown_fields`` walks the same type information the deserializer
uses (each model's ``openapi_types`` and ``attribute_map``) and reports every key that is not a
field, and every scalar of the wrong JSON type; ``load`` deserializes only a clean object, so the
model's own checks (required fields, enums) run too.
"""

from __future__ import annotations

import re
from typing import Any

import kubernetes.client
from kubernetes.client import ApiClient

__all__ = ["load", "model_name", "unknown_fields"]

_SCALARS: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,),
                                         "date": (str,), "datetime": (str,)}


def model_name(api_version: str, kind: str) -> str:
    """The client's model class for ``apiVersion``/``kind``: ``apps/v1`` Deployment -> V1Deployment."""
    version = api_version.rsplit("/", 1)[-1]
    name = version[0].upper() + version[1:] + kind
    if not hasattr(kubernetes.client.models, name):
        raise KeyError(f"no kubernetes client model for {api_version} {kind} (looked for {name})")
    return name


def _inner(type_name: str) -> tuple[str, str] | None:
    """('list', X) for List[X] / list[X]; ('dict', X) for Dict[str, X] / dict(str, X); else None."""
    m = re.fullmatch(r"(?:List|list)\[(.*)\]", type_name)
    if m:
        return "list", m.group(1)
    m = re.fullmatch(r"(?:Dict\[|dict\()[^,]*, (.*)[\])]", type_name)
    if m:
        return "dict", m.group(1)
    return None


def unknown_fields(data: Any, type_name: str, path: str = "") -> list[str]:
    """Every key in ``data`` that is not a field of ``type_name`` (recursively), and every wrong scalar type."""
    optional = re.fullmatch(r"Optional\[(.*)\]", type_name)
    if optional:
        return unknown_fields(data, optional.group(1), path)
    inner = _inner(type_name)
    if inner is not None:
        kind, item = inner
        if kind == "list":
            if not isinstance(data, list):
                return [f"{path}: expected a list of {item}, got {type(data).__name__}"]
            return [p for i, v in enumerate(data) for p in unknown_fields(v, item, f"{path}[{i}]")]
        if not isinstance(data, dict):
            return [f"{path}: expected a map of {item}, got {type(data).__name__}"]
        return [p for k, v in data.items() for p in unknown_fields(v, item, f"{path}.{k}")]
    if type_name == "object":  # IntOrString, RawExtension: any JSON value
        return []
    if type_name in _SCALARS:
        ok = isinstance(data, _SCALARS[type_name]) and not (type_name != "bool" and isinstance(data, bool))
        return [] if ok else [f"{path}: expected {type_name}, got {type(data).__name__} {data!r}"]
    cls = getattr(kubernetes.client.models, type_name)
    if not isinstance(data, dict):
        return [f"{path}: expected an object ({type_name}), got {type(data).__name__}"]
    by_json = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    problems = []
    for key, value in data.items():
        if key not in by_json:
            problems.append(f"{path}.{key}: not a field of {type_name} (it has: {', '.join(sorted(by_json))})")
        elif value is not None:
            problems += unknown_fields(value, cls.openapi_types[by_json[key]], f"{path}.{key}")
    return problems


def load(data: dict[str, Any]) -> Any:
    """The client model object for a manifest document; ValueError naming every unknown or mistyped field."""
    name = model_name(data["apiVersion"], data["kind"])
    problems = unknown_fields(data, name)
    if problems:
        raise ValueError(f"{data['kind']} {data.get('metadata', {}).get('name')}: " + "; ".join(problems))
    return ApiClient()._ApiClient__deserialize(data, name)
