"""A model's Triton ``config.pbtxt`` <-> sixfold's batching settings.

The file is read with Triton's own ModelConfig message
(``tritonclient.grpc.model_config_pb2``) and ``google.protobuf.text_format``, so
every name means what it means in Triton, with one unit change: batch sizes
count rows (items), not requests. What is read:

* ``max_batch_size``: rows per batch at most (0 or unset: parameter
  ``sixfold.max_batch_rows`` if given, else sixfold's default, 1024).
* ``dynamic_batching``: ``max_queue_delay_microseconds``, ``preferred_batch_size``
  (rows), ``priority_levels``, ``default_priority_level``,
  ``default_queue_policy`` and ``priority_queue_policy`` (``max_queue_size``,
  ``default_timeout_microseconds``, ``timeout_action`` REJECT|DELAY,
  ``allow_timeout_override``). A queue policy that is written has proto3
  defaults for what it leaves out (as in Triton: unbounded, no timeout,
  REJECT, no client override); with no ``default_queue_policy`` at all,
  sixfold's defaults apply (at most 256 queued, client timeouts honoured).
* ``parameters``: ``sixfold.*`` keys (see ``SIXFOLD_PARAMETERS``) are typed and
  checked; other keys pass through untouched.
* ``name``, ``input``, ``output`` and ``version_policy`` are kept in
  ``ModelSettings.proto`` for the caller (the plan defines the signature).

Any other field (``instance_group``, ``sequence_batching``, ``optimization``,
``preserve_ordering: true``, ...) means something sixfold does not do, and is
refused with a ValueError that names the field and the file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from sixfold.server.scheduling.batcher import BatchingConfig, QueuePolicy
from sixfold.server.scheduling.card_gate import CARD_SCHEDULING

__all__ = ["ModelSettings", "SIXFOLD_PARAMETERS", "load_model_config", "parse_model_config", "settings_from_proto",
           "to_model_config", "batching_from_proto"]

_ACCEPTED = {"name", "platform", "backend", "max_batch_size", "dynamic_batching", "parameters", "input", "output",
             "version_policy"}
_BACKENDS = ("", "sixfold")
_DEFAULT_ROWS = BatchingConfig().max_batch_rows


def _int(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise ValueError(f"must be an integer >= {low}")
        return value
    parse.__doc__ = f"integer >= {low}"
    return parse


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return parse


def _nonnegative(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a finite number >= 0")
    return value


def _table_memory(text: str) -> int | float:
    from sixfold.backends.host.table_store import parse_table_memory
    value = parse_table_memory(text)
    if value is None:
        raise ValueError("must be a size such as 4GiB or a share such as 10%")
    return value


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered not in ("true", "false"):
        raise ValueError("must be true or false")
    return lowered == "true"


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


SIXFOLD_PARAMETERS: dict[str, Callable[[str], Any]] = {
    "sixfold.model": str,
    "sixfold.max_rows": _int(1),
    "sixfold.seed": _int(0),
    "sixfold.cards": _int(1),
    "sixfold.backend": str,
    "sixfold.backend_options": _json_object,
    "sixfold.card_spec": str,
    "sixfold.table_precision": _choice("fp32", "fp16", "int8", "int4"),
    "sixfold.max_card_batch_rows": _int(1),
    "sixfold.min_split_rows": _int(0),
    "sixfold.card_scheduling": _choice(*CARD_SCHEDULING),  # how batches get cards (PlanRuntime.card_scheduling)
    "sixfold.max_inflight_batches": _int(0),
    "sixfold.host_dense_max_rows": _int(-1),
    "sixfold.allow_nonfinite": _bool,
    "sixfold.card_timeout_multiple": _nonnegative,
    "sixfold.card_timeout_floor_ms": _int(0),
    "sixfold.max_queue_work_ms": _int(0),  # admission by work (BatchingConfig.max_queue_work_ms; 0: off)
    "sixfold.max_queue_bytes_mb": _int(0),  # admission by bytes (BatchingConfig.max_queue_bytes in MiB; 0: off)
    "sixfold.max_batch_rows": _int(1),  # what to_model_config writes when it reports max_batch_size 0
    "sixfold.table_memory": _table_memory,  # tiered tables: DRAM budget, bytes ("4GiB") or a share ("10%")
    "sixfold.table_cache_policy": _choice("tinylfu", "clock"),
    "sixfold.warm_from": str,  # a loadgen recording warming the row cache at load (relative to the model folder)
    # Facts a server publishes for load generators (read back as written).
    "sixfold.table_rows": str,
    "sixfold.pooling": str,
    "sixfold.zipf": str,
}
"""The ``sixfold.*`` parameters a config.pbtxt may set, each with its parser (text -> value)."""


@dataclass(frozen=True)
class ModelSettings:
    """What a config.pbtxt says: batching, the typed sixfold extras, and the parsed message."""

    name: str
    batching: BatchingConfig
    extras: dict[str, Any] = field(default_factory=dict)
    """Typed ``sixfold.*`` parameters, keyed without the prefix (e.g. ``cards``, ``host_dense_max_rows``)."""
    parameters: dict[str, str] = field(default_factory=dict)
    """Every parameter as written (string values), ``sixfold.*`` ones included."""
    proto: model_config_pb2.ModelConfig = field(default_factory=model_config_pb2.ModelConfig)
    source: str = "config.pbtxt"


def _unsupported(message: Any, prefix: str, accepted: set[str]) -> list[str]:
    return [f"{prefix}{fd.name}" for fd, _ in message.ListFields() if fd.name not in accepted]


def _policy(message: model_config_pb2.ModelQueuePolicy) -> QueuePolicy:
    action = model_config_pb2.ModelQueuePolicy.TimeoutAction.Name(message.timeout_action)
    return QueuePolicy(max_queue_size=message.max_queue_size,
                       default_timeout_microseconds=message.default_timeout_microseconds,
                       timeout_action=action,  # type: ignore[arg-type]
                       allow_timeout_override=message.allow_timeout_override)


_PROTO_NAMES = {
    "max_batch_rows": "max_batch_size",
    "preferred_batch_rows": "dynamic_batching.preferred_batch_size",
    "max_queue_delay_microseconds": "dynamic_batching.max_queue_delay_microseconds",
    "default_priority_level": "dynamic_batching.default_priority_level",
    "priority_levels": "dynamic_batching.priority_levels",
    "priority_queue_policy": "dynamic_batching.priority_queue_policy",
}


def _in_file_terms(message: str) -> str:
    """A BatchingConfig error in the file's own field names."""
    return re.sub(r"\b(" + "|".join(_PROTO_NAMES) + r")\b", lambda m: _PROTO_NAMES[m.group(1)], message)


def batching_from_proto(config: model_config_pb2.ModelConfig, *, max_inflight_batches: int = 0,
                        max_batch_rows: int | None = None, source: str = "config.pbtxt",
                        admission: Mapping[str, int] | None = None) -> BatchingConfig:
    """The BatchingConfig of a ModelConfig message (errors name the field and ``source``)."""
    rows = config.max_batch_size or max_batch_rows or _DEFAULT_ROWS
    if config.max_batch_size and max_batch_rows and config.max_batch_size != max_batch_rows:
        raise ValueError(f"{source}: max_batch_size {config.max_batch_size} and parameters "
                         f"'sixfold.max_batch_rows' {max_batch_rows} disagree; give one")
    kwargs: dict[str, Any] = {"max_batch_rows": rows, "max_inflight_batches": max_inflight_batches}
    admission = admission or {}
    if "max_queue_work_ms" in admission:
        kwargs["max_queue_work_ms"] = admission["max_queue_work_ms"]
    if "max_queue_bytes_mb" in admission:
        kwargs["max_queue_bytes"] = admission["max_queue_bytes_mb"] << 20
    if config.HasField("dynamic_batching"):
        db = config.dynamic_batching
        if db.preserve_ordering:
            raise ValueError(f"{source}: dynamic_batching.preserve_ordering is not supported: sixfold answers "
                             "each request as soon as its batch is done")
        kwargs.update(max_queue_delay_microseconds=db.max_queue_delay_microseconds,
                      preferred_batch_rows=tuple(db.preferred_batch_size),
                      priority_levels=db.priority_levels, default_priority_level=db.default_priority_level)
        policies = {}
        for where, message in [("default_queue_policy", db.default_queue_policy)] + [
                (f"priority_queue_policy[{level}]", p) for level, p in sorted(db.priority_queue_policy.items())]:
            try:
                policies[where] = _policy(message)
            except ValueError as exc:
                raise ValueError(f"{source}: dynamic_batching.{where}.{exc}") from None
        if db.HasField("default_queue_policy"):
            p = policies["default_queue_policy"]
            kwargs.update(max_queue_size=p.max_queue_size, default_timeout_microseconds=p.default_timeout_microseconds,
                          timeout_action=p.timeout_action, allow_timeout_override=p.allow_timeout_override)
        kwargs["priority_queue_policy"] = {int(level): policies[f"priority_queue_policy[{level}]"]
                                           for level in db.priority_queue_policy}
    try:
        return BatchingConfig(**kwargs)
    except ValueError as exc:
        raise ValueError(f"{source}: {_in_file_terms(str(exc))}") from None


def _extras(parameters: Mapping[str, str], source: str) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    for key, text in parameters.items():
        if not key.startswith("sixfold."):
            continue
        parse = SIXFOLD_PARAMETERS.get(key)
        if parse is None:
            raise ValueError(f"{source}: unknown parameter '{key}'; sixfold knows {', '.join(SIXFOLD_PARAMETERS)}")
        try:
            extras[key.removeprefix("sixfold.")] = parse(text.strip())
        except ValueError as exc:
            raise ValueError(f"{source}: parameters '{key}' = {text!r}: {exc}") from None
    return extras


def parse_model_config(text: str, *, source: str = "config.pbtxt") -> ModelSettings:
    """Read config.pbtxt text; ``source`` (a path) names the file in errors."""
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise ValueError(f"{source}:{exc}") from None
    return settings_from_proto(config, source=source)


def settings_from_proto(config: model_config_pb2.ModelConfig, *, source: str = "config.pbtxt") -> ModelSettings:
    """Check and read an already parsed ModelConfig (e.g. a model repository's); errors name ``source``."""
    bad = _unsupported(config, "", _ACCEPTED)
    if bad:
        raise ValueError(f"{source}: field(s) {', '.join(bad)} not supported by sixfold (it reads name, "
                         f"max_batch_size, dynamic_batching, parameters, input, output, version_policy; "
                         f"set cards with parameters 'sixfold.cards')")
    for name in ("platform", "backend"):
        value = getattr(config, name)
        if value not in _BACKENDS:
            raise ValueError(f"{source}: {name} '{value}' is not sixfold's; leave it out or write \"sixfold\" "
                             "(the card backend is parameters 'sixfold.backend')")
    parameters = {key: p.string_value for key, p in config.parameters.items()}
    extras = _extras(parameters, source)
    batching = batching_from_proto(config, max_inflight_batches=extras.get("max_inflight_batches", 0),
                                   max_batch_rows=extras.get("max_batch_rows"), source=source,
                                   admission={k: v for k, v in extras.items() if k.startswith("max_queue_")})
    return ModelSettings(name=config.name, batching=batching, extras=extras, parameters=parameters,
                         proto=config, source=source)


def load_model_config(path: str | Path) -> ModelSettings:
    """Read a model's ``config.pbtxt`` (a file, or a model directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.pbtxt"
    return parse_model_config(path.read_text(), source=str(path))


def _queue_policy(policy: QueuePolicy) -> model_config_pb2.ModelQueuePolicy:
    return model_config_pb2.ModelQueuePolicy(
        max_queue_size=policy.max_queue_size, default_timeout_microseconds=policy.default_timeout_microseconds,
        timeout_action=model_config_pb2.ModelQueuePolicy.TimeoutAction.Value(policy.timeout_action),
        allow_timeout_override=policy.allow_timeout_override)


def to_model_config(name: str, batching: BatchingConfig, *, parameters: Mapping[str, str] | None = None,
                    inputs: Iterable[Any] = (), outputs: Iterable[Any] = (),
                    max_batch_size: int | None = 0) -> model_config_pb2.ModelConfig:
    """The ModelConfig a ModelConfig RPC returns for a model served with ``batching``.

    ``inputs``/``outputs``: objects with ``name``, ``datatype`` (KServe, e.g.
    "FP32") and ``shape``. ``max_batch_size`` defaults to 0 on purpose: sixfold's
    inputs are ragged (``sparse_indices`` holds every id of the query, not a
    per-item row), so clients such as perf_analyzer must send whole tensors, not
    stack per-item ones; the batch limit in rows is in ``dynamic_batching`` and in
    the ``sixfold.max_batch_rows`` parameter. Pass ``None`` to report
    ``max_batch_rows`` as ``max_batch_size`` (Triton's batching clients then
    prepend a batch dimension).
    """
    config = model_config_pb2.ModelConfig(
        name=name, platform="sixfold", backend="sixfold",
        max_batch_size=batching.max_batch_rows if max_batch_size is None else max_batch_size)
    for t in inputs:
        config.input.add(name=t.name, data_type=model_config_pb2.DataType.Value(f"TYPE_{t.datatype}"), dims=t.shape)
    for t in outputs:
        config.output.add(name=t.name, data_type=model_config_pb2.DataType.Value(f"TYPE_{t.datatype}"), dims=t.shape)
    db = config.dynamic_batching
    db.max_queue_delay_microseconds = batching.max_queue_delay_microseconds
    db.preferred_batch_size.extend(batching.preferred_batch_rows)
    db.priority_levels = batching.priority_levels
    db.default_priority_level = batching.default_priority_level
    db.default_queue_policy.CopyFrom(_queue_policy(batching.default_policy))
    for level, policy in batching.priority_queue_policy.items():
        db.priority_queue_policy[level].CopyFrom(_queue_policy(policy))
    for key, value in (parameters or {}).items():
        config.parameters[key].string_value = str(value)
    config.parameters["sixfold.max_batch_rows"].string_value = str(batching.max_batch_rows)
    return config
