"""What the loadgen must send: readiness, then the model's request shape from the server.

ModelMetadata gives the canonical inputs (``dense_features`` [-1, D] FP32,
``sparse_lengths`` [-1, T] INT32, ``sparse_indices`` [-1] INT64). Table sizes,
pooling and id skew are not part of KServe v2, so a sixfold server publishes
them as ModelConfig parameters (``sixfold.table_rows``, ``sixfold.pooling``,
``sixfold.zipf``: comma-separated strings). Another server (Triton, MLServer)
has none: the user gives ``--table-rows`` (required then) and ``--pooling``.
Flags always win over what the server says.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tritonclient.utils import InferenceServerException

from sixfold.models.signature import DENSE, INDICES, LENGTHS

from sixfold.loadgen.config import parse_int_list
from sixfold.loadgen.errors import LoadgenError

__all__ = ["ModelShape", "ShapeOverrides", "wait_until_ready", "unreachable_hint", "discover_shape", "shape_from", "published_facts",
           "PARAM_TABLE_ROWS", "PARAM_POOLING", "PARAM_ZIPF", "DEFAULT_POOLING", "DEFAULT_ZIPF"]

PARAM_TABLE_ROWS = "sixfold.table_rows"
PARAM_POOLING = "sixfold.pooling"
PARAM_ZIPF = "sixfold.zipf"
PARAM_FIXED_POOLING = "sixfold.fixed_pooling"
"""``true`` for a model traced at one pooling: every (item, table) gets exactly ``pooling`` ids."""
DEFAULT_POOLING = 1
"""Ids per (item, table) when neither the server nor --pooling says (one-hot, as MLPerf DLRM)."""
DEFAULT_ZIPF = 1.05


@dataclass(frozen=True)
class ShapeOverrides:
    """User-given shape facts; ``table_rows``/``pooling`` of length 1 apply to every table."""

    table_rows: tuple[int, ...] | None = None
    pooling: tuple[int, ...] | None = None
    dense_dim: int | None = None
    zipf: float | tuple[float, ...] | None = None
    batch_dim: bool = False
    """The model's inputs have a leading batch dimension (``LoadConfig.batch_dim``): read shapes past it."""


@dataclass(frozen=True)
class ModelShape:
    """Everything needed to generate valid, realistic requests for one model."""

    dense_dim: int
    table_rows: tuple[int, ...]
    pooling: tuple[int, ...]
    zipf: float | tuple[float, ...]
    """One exponent for all tables, or one per table."""
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    """Where each fact came from: ``metadata``, ``server``, ``flag`` or ``default``."""
    fixed_pooling: bool = False
    """Exactly ``pooling`` ids per (item, table) (the server's ``sixfold.fixed_pooling``)."""

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def to_dict(self) -> dict[str, Any]:
        return {"dense_dim": self.dense_dim, "num_tables": self.num_tables, "table_rows": list(self.table_rows),
                "pooling": list(self.pooling),
                "zipf": list(self.zipf) if isinstance(self.zipf, tuple) else self.zipf,
                "fixed_pooling": self.fixed_pooling, "sources": dict(self.sources)}


def _status(exc: InferenceServerException) -> str:
    return (exc.status() or "").rsplit(".", 1)[-1]


async def wait_until_ready(client: Any, url: str, model: str, version: str, timeout_s: float,
                           *, poll_s: float = 0.2, hint: str = "") -> None:
    """Poll ServerReady then ModelReady until both hold or ``timeout_s`` passes.

    Fails at once, without waiting, when the server is up but does not know the
    model (it answers NOT_FOUND): waiting would not help. ``hint`` ends the
    message when nothing answered (what to check: port, protocol, TLS).
    """
    deadline = time.monotonic() + timeout_s
    last, reached = "no answer", False
    while True:
        call_timeout = max(0.2, min(2.0, deadline - time.monotonic()))
        try:
            if not await client.is_server_ready(client_timeout=call_timeout):
                last, reached = "server not ready", True
            else:
                reached = True
                if await client.is_model_ready(model, version, client_timeout=call_timeout):
                    return
                last = "model not ready"
                await client.get_model_metadata(model, version, client_timeout=call_timeout)
        except InferenceServerException as exc:
            if reached and _status(exc) == "NOT_FOUND":
                raise LoadgenError(f"unknown model {model!r} on {url}: {exc.message()}") from None
            last = f"{_status(exc) or 'error'}: {exc.message()}"
        if time.monotonic() >= deadline:
            break
        await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
    if not reached:
        raise LoadgenError(f"cannot reach a KServe v2 server at {url} within {timeout_s:g} s ({last})"
                           + (f"; {hint}" if hint else ""))
    raise LoadgenError(f"server at {url} or model {model!r} not ready within {timeout_s:g} s ({last})")


def unreachable_hint(protocol: str, ssl: bool) -> str:
    """What to check when nothing answered at the URL, for the protocol and TLS asked."""
    port = "its gRPC port (REST: --protocol http)" if protocol == "grpc" else "its REST port (gRPC: --protocol grpc)"
    tls = ("does it serve TLS there, and do --root-certificates trust its certificate?" if ssl
           else "does it serve TLS? then add --ssl")
    return f"is the URL {port}? {tls}"


def _dims(metadata: Any, name: str) -> list[int]:
    for tensor in metadata.inputs:
        if tensor.name == name:
            return list(tensor.shape)
    takes = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in metadata.inputs) or "nothing"
    raise LoadgenError(f"model {metadata.name!r} has no input {name!r}; the loadgen sends the canonical "
                       f"recommendation request ({DENSE}, {LENGTHS}, {INDICES}) but the model takes: {takes}")


def _param(config: Any, key: str) -> str | None:
    if config is not None and key in config.parameters:
        value = config.parameters[key].string_value.strip()
        return value or None
    return None


def _per_table(values: tuple[int, ...], tables: int, what: str) -> tuple[int, ...]:
    if len(values) == 1:
        return values * tables
    if len(values) != tables:
        raise LoadgenError(f"{what} has {len(values)} values but the model has {tables} tables "
                           f"(give one value for all tables, or {tables})")
    return values


def shape_from(metadata: Any, config: Any, overrides: ShapeOverrides = ShapeOverrides()) -> ModelShape:
    """Combine ModelMetadata, ModelConfig (may be None) and the user's overrides into a ModelShape."""
    sources: dict[str, str] = {}
    dense_dims = _dims(metadata, DENSE)
    length_dims = _dims(metadata, LENGTHS)
    if overrides.batch_dim:
        dense_dims, length_dims = dense_dims[1:], length_dims[1:]
    _dims(metadata, INDICES)
    if overrides.dense_dim is not None:
        dense_dim, sources["dense_dim"] = overrides.dense_dim, "flag"
    elif len(dense_dims) == 2 and dense_dims[1] > 0:
        dense_dim, sources["dense_dim"] = dense_dims[1], "metadata"
    else:
        lead = (" (a leading batch dimension: a model with max_batch_size > 0? pass --batch-dim)"
                if len(dense_dims) == 3 and not overrides.batch_dim else "")
        raise LoadgenError(f"cannot tell the dense feature count from {DENSE} shape {dense_dims}{lead}; "
                           "pass --dense-dim")

    if overrides.table_rows is not None:
        rows, sources["table_rows"] = overrides.table_rows, "flag"
    elif (text := _param(config, PARAM_TABLE_ROWS)) is not None:
        rows, sources["table_rows"] = parse_int_list(text, f"server parameter {PARAM_TABLE_ROWS}"), "server"
    else:
        raise LoadgenError(f"model {metadata.name!r} does not publish its table sizes "
                           f"(no ModelConfig parameter {PARAM_TABLE_ROWS!r}: not a sixfold server?); "
                           f"pass --table-rows N or --table-rows N1,N2,...")
    if len(length_dims) == 2 and length_dims[1] > 0:
        tables = length_dims[1]
    elif len(rows) > 1:
        tables = len(rows)
    else:
        raise LoadgenError(f"cannot tell the table count from {LENGTHS} shape {length_dims}; "
                           f"pass one --table-rows value per table")
    rows = _per_table(rows, tables, "--table-rows" if sources["table_rows"] == "flag" else PARAM_TABLE_ROWS)

    if overrides.pooling is not None:
        pooling, sources["pooling"] = overrides.pooling, "flag"
    elif (text := _param(config, PARAM_POOLING)) is not None:
        pooling, sources["pooling"] = parse_int_list(text, f"server parameter {PARAM_POOLING}"), "server"
    else:
        pooling, sources["pooling"] = (DEFAULT_POOLING,), "default"
    pooling = _per_table(pooling, tables, "--pooling" if sources["pooling"] == "flag" else PARAM_POOLING)

    zipf: float | tuple[float, ...]
    if isinstance(overrides.zipf, tuple):
        if len(overrides.zipf) not in (1, tables):
            raise LoadgenError(f"--zipf has {len(overrides.zipf)} values but the model has {tables} tables "
                               f"(give one value for all tables, or {tables})")
        zipf = overrides.zipf[0] if len(overrides.zipf) == 1 else overrides.zipf
        sources["zipf"] = "flag"
    elif overrides.zipf is not None:
        zipf, sources["zipf"] = overrides.zipf, "flag"
    elif (text := _param(config, PARAM_ZIPF)) is not None:
        try:
            zipf, sources["zipf"] = float(text), "server"
        except ValueError:
            raise LoadgenError(f"server parameter {PARAM_ZIPF}={text!r} is not a number") from None
    else:
        zipf, sources["zipf"] = DEFAULT_ZIPF, "default"
    fixed = (_param(config, PARAM_FIXED_POOLING) or "").strip().lower() == "true"
    if fixed and sources["pooling"] == "flag":
        raise LoadgenError(f"this model was traced at pooling {list(pooling)} ({PARAM_FIXED_POOLING}): "
                           "it takes exactly that many ids per item and table; drop --pooling")
    return ModelShape(dense_dim, rows, pooling, zipf, sources, fixed_pooling=fixed)


async def discover_shape(client: Any, model: str, version: str = "",
                         overrides: ShapeOverrides = ShapeOverrides(), *, timeout_s: float = 10.0) -> ModelShape:
    """Ask the server for ModelMetadata and (if it has it) ModelConfig, then build the shape."""
    try:
        metadata = await client.get_model_metadata(model, version, client_timeout=timeout_s)
    except InferenceServerException as exc:
        raise LoadgenError(f"ModelMetadata for {model!r} failed: {_status(exc)}: {exc.message()}") from None
    try:
        config = (await client.get_model_config(model, version, client_timeout=timeout_s)).config
    except InferenceServerException:
        config = None  # model configuration is an optional KServe extension
    return shape_from(metadata, config, overrides)


async def published_facts(client: Any, model: str, version: str = "", *, timeout_s: float = 10.0) -> dict[str, Any]:
    """What the server itself says of the shape, with no flags and no defaults.

    Keys present only when published: ``dense_dim``, ``tables`` (from
    ModelMetadata dims > 0) and ``table_rows`` (``sixfold.table_rows``).
    """
    try:
        metadata = await client.get_model_metadata(model, version, client_timeout=timeout_s)
    except InferenceServerException as exc:
        raise LoadgenError(f"ModelMetadata for {model!r} failed: {_status(exc)}: {exc.message()}") from None
    facts: dict[str, Any] = {}
    dense, lengths = _dims(metadata, DENSE), _dims(metadata, LENGTHS)
    if len(dense) == 2 and dense[1] > 0:
        facts["dense_dim"] = dense[1]
    if len(lengths) == 2 and lengths[1] > 0:
        facts["tables"] = lengths[1]
    try:
        config = (await client.get_model_config(model, version, client_timeout=timeout_s)).config
    except InferenceServerException:
        config = None
    if (text := _param(config, PARAM_TABLE_ROWS)) is not None:
        try:
            facts["table_rows"] = parse_int_list(text, f"server parameter {PARAM_TABLE_ROWS}")
        except ValueError:
            pass
    return facts
