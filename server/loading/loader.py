"""Turn a model name into a ServedModel: partition it, load its partitions on backends."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Protocol

import numpy as np

from sixfold.backends import registry
from sixfold.backends.api import Backend, Executable, PartitionArtifact
from sixfold.backends.host.host_embedding import table_files
from sixfold.backends.spec import DeviceSpec
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION
from sixfold.partitioner.plan import PartitionPlan

from sixfold.server.scheduling.admission import PlanCost
from sixfold.server.scheduling.batcher import BatchingConfig, DynamicBatcher
from sixfold.server.execution.dense_loader import PipelineExecutable, load_dense
from sixfold.server.observability.metrics import ServerMetrics
from sixfold.server.model.served import ServedModel
from sixfold.server.loading.card_flags import check_card_flags
from sixfold.server.loading.card_memory import card_bytes, hold_until_closed, reserve_cards
from sixfold.server.loading.model_config import settings_from_proto
from sixfold.server.loading.repository import CONFIG_FILE, ModelRepository
from sixfold.server.execution.runtime import DEFAULT_CARD_SCHEDULING, DEFAULT_MIN_SPLIT_ROWS, PlanRuntime

__all__ = ["load_partitioned", "load_host_dense", "load_builtin", "load_from_repository", "load_host_stage", "host_id_check"]

log = logging.getLogger(__name__)

# The host (sparse) stage runs on the backend that takes its artifact's format.
_HOST_BACKENDS = {"torch-fx": "torch", "tables": "host-embedding", "onnx": "onnxruntime"}


class Loadable(Protocol):
    """A plan and its artifacts: a fresh PartitionedModel or a version read from a repository."""

    plan: PartitionPlan
    artifacts: dict[str, PartitionArtifact]

    def artifact_for(self, partition: str, backend: Backend) -> PartitionArtifact: ...


def _table_arrays(partitioned: Loadable) -> list[np.ndarray]:
    """The host stage's fp32 tables, one array each: mapped from a repository, or views of the model's weight."""
    artifact = partitioned.artifacts[HOST_PARTITION]
    if artifact.format == "tables" and isinstance(artifact.payload, (str, Path)):
        return [np.load(f, mmap_mode="r") for f in table_files(artifact.payload)]
    if artifact.format == "tables":
        return list(artifact.payload)
    from sixfold.partitioner.placement.sharding import host_table_arrays
    return host_table_arrays(partitioned)  # type: ignore[arg-type]


def load_host_stage(partitioned: Loadable, host_device: DeviceSpec, *, table_memory: int | float | None = None,
                    cache_policy: str = "tinylfu", cache_dir: str | Path | None = None) -> Executable:
    """The sparse stage: on the host backend its artifact's format needs, or split over host + cards.

    ``table_memory`` (bytes, or a share of the table bytes): keep the tables on disk behind a
    DRAM row cache of that size (``sixfold.backends.host.table_store``); None: every row resident.
    A repository's tables are checked against the checksums in plan.json first; tables derived
    from them (fused, fp16/int8/int4) go to ``cache_dir`` (None: the user's cache folder), keyed by
    those checksums (``sixfold.backends.host.derived_cache``), never into the repository.
    """
    plan = partitioned.plan
    artifact = partitioned.artifacts[HOST_PARTITION]
    if artifact.format == "tables" and isinstance(artifact.payload, (str, Path)) and plan.tables.get("checksums"):
        from sixfold.partitioner.tables.checksums import verify_tables
        verify_tables(artifact.payload, plan.tables["checksums"])
    if artifact.format == "tables":
        artifact = dataclasses.replace(artifact, metadata={**artifact.metadata, "cache_dir": cache_dir,
                                                           "fingerprints": plan.tables.get("checksums") or None})
    if table_memory is not None:
        if getattr(plan, "shards", None):
            raise ValueError("table memory (tiered tables) and tables on cards cannot be combined yet")
        if artifact.format != "tables":
            raise ValueError(f"table memory needs a table-batched host stage; this model's host stage is "
                             f"{artifact.format!r}")
        payload = artifact.payload
        if not isinstance(payload, (str, Path)):
            payload = _spill_tables(payload)
        pooling = plan.tables.get("pooling") or [1]
        artifact = dataclasses.replace(artifact, payload=payload, metadata={
            **artifact.metadata, "table_memory": table_memory, "cache_policy": cache_policy,
            "item_ids": int(sum(pooling))})
        return registry.get_backend("host-embedding", check_ids=not plan.tables.get("rows")).load(artifact,
                                                                                                  host_device)
    if getattr(plan, "shards", None):
        from sixfold.backends.builtin.sharded_embedding import load_sharded_stage
        devices = {s.device for s in plan.shards if s.device != "host"}
        specs = {d: dataclasses.replace(plan.device(d).spec, name=f"{plan.device(d).spec.name}/{d}") for d in devices}
        return load_sharded_stage(plan, _table_arrays(partitioned), host_device, specs)
    backend = _HOST_BACKENDS.get(artifact.format)
    if backend is None:
        raise ValueError(f"no host backend takes {artifact.format!r} partitions")
    options = {}
    if backend == "host-embedding" and plan.tables.get("rows"):
        # sixfold.server.model.validation checks every id against these tables before a request is queued;
        # checking again per batch is an O(ids) pass (~5-15% of a large batch's host stage).
        options["check_ids"] = False
    return registry.get_backend(backend, **options).load(artifact, host_device)


def host_id_check(partitioned: Loadable):
    """A per-lookup range check of the host stage (``sixfold.partitioner.tables.id_check``), or None when it has none."""
    artifact = partitioned.artifacts[HOST_PARTITION]
    if artifact.format == "torch-fx" and hasattr(artifact.payload, "graph"):
        from sixfold.partitioner.tables.id_check import IdCheck
        return IdCheck.from_module(artifact.payload, artifact.input_names)
    if artifact.format == "onnx":
        from sixfold.partitioner.frontends.onnx_frontend import onnx_id_check
        return onnx_id_check(artifact.payload, artifact.input_names)
    return None


def _spill_tables(arrays: list[np.ndarray]) -> Path:
    """Write in-memory tables (a built-in model's) to a temporary tables directory, removed at exit."""
    import atexit
    import shutil
    import tempfile

    from sixfold.backends.host.derived_cache import write_npy

    directory = Path(tempfile.mkdtemp(prefix="sixfold-tables-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    for t, array in enumerate(arrays):
        # allocated before written, no memory map: a full disk is an OSError naming the file and the bytes
        write_npy(directory / f"table_{t:03d}.npy", np.asarray(array).dtype, array.shape, [array])
    return directory


def load_host_dense(partitioned: Loadable, host_device: DeviceSpec, name: str) -> Executable | None:
    """The whole dense part on the host CPU (onnxruntime), or None where the host cannot run it.

    It answers small batches when that is faster (DeepRecSys) and every batch while no card can
    (the fallback), so a model stays ready when its cards fail. A pipelined plan gets its whole
    stage chain on the host (a fallback only: its dense part was too big for one card, so small
    batches stay on the cards). Plans with tables on the cards have none: their host stage needs
    the cards. Without onnxruntime (filtered by ``SIXFOLD_BACKENDS``) there is none either, and
    readiness follows the cards alone.
    """
    plan = partitioned.plan
    if getattr(plan, "shards", None):
        return None
    try:
        ort = registry.get_backend("onnxruntime")
    except registry.BackendNotFound as exc:  # e.g. filtered by SIXFOLD_BACKENDS: the cards alone serve
        log.warning("%s: no dense fallback on the host CPU (%s); every batch goes to a card, and the model is "
                    "not ready while no card is", name, exc)
        return None
    stages = plan.dense_stages()
    if stages == [DENSE_PARTITION]:
        return ort.load(partitioned.artifact_for(DENSE_PARTITION, ort), host_device)
    loaded: list[Executable] = []
    try:
        for stage in stages:
            loaded.append(ort.load(partitioned.artifact_for(stage, ort), host_device))
        return PipelineExecutable(loaded, name="dense/host")
    except BaseException:
        for executable in loaded:
            executable.close()
        raise


def load_partitioned(partitioned: Loadable, *, backend: str, metrics: ServerMetrics,
                     batching: BatchingConfig, version: str = "1", name: str | None = None,
                     backend_options: dict | None = None, max_card_rows: int | None = None,
                     min_split_rows: int = DEFAULT_MIN_SPLIT_ROWS, host_dense_max_rows: int = -1,
                     allow_nonfinite: bool = False, card_timeout_multiple: float = 10.0,
                     card_timeout_floor_s: float = 0.5, table_memory: int | float | None = None,
                     cache_policy: str = "tinylfu", host_chunk_rows: int = 0,
                     warm_from: str | Path | None = None,
                     card_scheduling: str = DEFAULT_CARD_SCHEDULING,
                     cache_dir: str | Path | None = None, lanes_on_host: bool = False) -> ServedModel:
    """Load the host stage (host backend by artifact format, or host + card shards) and every dense lane.

    ``card_timeout_multiple``/``card_timeout_floor_s``: a card batch's hang deadline (see ``PlanRuntime``).
    ``table_memory``/``cache_policy``: tiered tables (see ``load_host_stage``).
    ``warm_from``: a loadgen recording whose queries fill the row cache before anything else loads
    (``sixfold.server.model.warm``; a model without tiered tables says it has nothing to warm).
    ``host_chunk_rows``: pipeline large batches' host and card stages in chunks (see ``PlanRuntime``).
    ``card_scheduling``: how batches get cards, "fifo" or "greedy" (see ``PlanRuntime``).
    ``cache_dir``: where tables derived from the model's go (see ``load_host_stage``).
    ``lanes_on_host``: the dense lanes are the host's own cores (``sixfold.backends.cpu_layout``): a lane
    takes a batch of any size, and a batch is split across lanes only from the size where halves were
    measured to finish sooner (``sixfold.server.execution.lane_split``), not from ``min_split_rows``.
    """
    plan = partitioned.plan
    if lanes_on_host:
        max_card_rows = None
    host_device = plan.device(plan.devices_of(HOST_PARTITION)[0]).spec
    host = load_host_stage(partitioned, host_device, table_memory=table_memory, cache_policy=cache_policy,
                           cache_dir=cache_dir)
    if warm_from:
        from sixfold.server.model.warm import warm_from_recording
        try:
            warm_from_recording(getattr(host, "stage", None), warm_from, model=name or plan.model)
        except BaseException:
            host.close()
            raise
    card_backend = registry.get_backend(backend, **(backend_options or {}))
    # One lane per card (replicate) or per pipeline replica (stages on several cards).
    cards, reload_lane = load_dense(plan, lambda name: partitioned.artifact_for(name, card_backend), card_backend)
    try:
        host_dense = None if host_dense_max_rows == 0 else load_host_dense(partitioned, host_device,
                                                                            name or plan.model)
    except BaseException:
        for lane in cards:
            lane.close()
        host.close()
        raise
    pipelined = plan.dense_stages() != [DENSE_PARTITION]
    runtime = PlanRuntime(host, cards, reload_card=reload_lane, max_card_rows=max_card_rows,
                          min_split_rows=min_split_rows, card_timeout_multiple=card_timeout_multiple,
                          card_timeout_floor_s=card_timeout_floor_s, host_dense=host_dense,
                          host_dense_max_rows=host_dense_max_rows if host_dense and not pipelined else 0,
                          host_chunk_rows=host_chunk_rows, card_scheduling=card_scheduling)
    try:  # this version's bytes on each card, beside every other model's (sixfold.server.loading.card_memory)
        holds = reserve_cards(cards, f"model {name or plan.model} version {version}")
    except BaseException:
        runtime.close()
        raise
    hold_until_closed(runtime, holds)
    inflight = batching.max_inflight_batches or len(cards) + 1
    served = ServedModel(name=name or plan.model, version=version, plan=plan, runtime=runtime,
                         batcher=None, metrics=metrics, allow_nonfinite=allow_nonfinite)  # type: ignore[arg-type]
    served.batcher = DynamicBatcher(served.run_batch, batching, max_inflight=inflight, cost=PlanCost.from_plan(plan))
    runtime.on_card_fault = metrics.for_model(served.name, version).card_fault
    stage = getattr(host, "stage", None)
    if getattr(stage, "stores", None):
        metrics.watch_table_cache(served.name, version, stage)
        served.parameters["sixfold.table_memory"] = str(stage.table_memory)
    if not plan.tables.get("rows"):  # lookups not matched to tables: check each lookup's rows instead
        served.id_check = host_id_check(partitioned)
    tables = plan.tables
    if tables.get("rows"):
        served.parameters["sixfold.table_rows"] = ",".join(str(r) for r in tables["rows"])
    if tables.get("pooling"):
        served.parameters["sixfold.pooling"] = ",".join(str(p) for p in tables["pooling"])
    if tables.get("fixed_pooling"):  # a model file traced at one pooling: exactly that many ids per (item, table)
        served.parameters["sixfold.fixed_pooling"] = "true"
    if tables.get("zipf"):
        served.parameters["sixfold.zipf"] = str(tables["zipf"])
    served.parameters["sixfold.cards"] = str(len(cards))
    served.parameters["sixfold.card_memory_bytes"] = ",".join(f"{c}={b}" for c, b in card_bytes(cards).items())
    served.parameters["sixfold.backend"] = backend
    if lanes_on_host:
        served.parameters["sixfold.layout"] = "cpu"
        try:
            _split_where_it_pays(served)
        except BaseException:
            runtime.close()
            raise
    return served


def _split_where_it_pays(served: ServedModel) -> None:
    """Set the runtime's split size from lanes timed whole and halved on a synthetic batch (``lane_split``)."""
    from sixfold.server.execution.lane_split import SPLIT_PROBE_ROWS, measure_split
    from sixfold.server.model.warmup import synthetic_batch

    runtime = served.runtime
    rows = max(SPLIT_PROBE_ROWS)
    inputs = synthetic_batch(served, rows)
    host_out = runtime.host.run({n: inputs[n] for n in runtime.host.input_names})
    decision = measure_split(runtime.cards, {**inputs, **host_out}, rows)
    runtime.min_split_rows = decision.min_split_rows
    served.split_decision = decision  # type: ignore[attr-defined]
    served.parameters["sixfold.min_split_rows"] = str(decision.min_split_rows)
    log.info("%s: %s", served.name, decision.describe())


def load_builtin(name: str, *, max_rows: int | None, seed: int, cards: int, backend: str,
                 card_spec: str | DeviceSpec, metrics: ServerMetrics, batching: BatchingConfig, host_spec: str = "host-cpu",
                 table_precision: str = "fp32", backend_options: dict | None = None,
                 max_card_rows: int | None = None, sparse_on_cards: str | None = None,
                 dense_precision: str = "fp32", host_dense_max_rows: int = -1,
                 min_split_rows: int = DEFAULT_MIN_SPLIT_ROWS, allow_nonfinite: bool = False,
                 card_timeout_multiple: float = 10.0, card_timeout_floor_s: float = 0.5,
                 table_memory: int | float | None = None, cache_policy: str = "tinylfu",
                 host_chunk_rows: int = 0, warm_from: str | Path | None = None,
                 card_scheduling: str = DEFAULT_CARD_SCHEDULING, cache_dir: str | Path | None = None,
                 lanes_on_host: bool = False) -> ServedModel:
    """Partition built-in model ``name`` onto ``cards`` cards of ``card_spec`` (a name, a file or a DeviceSpec)
    plus the host, and load it (``lanes_on_host``: the cards are host cores, see ``load_partitioned``)."""
    _, partitioned = partition_builtin(name, max_rows=max_rows, seed=seed, cards=cards, card_spec=card_spec,
                                       host_spec=host_spec, table_precision=table_precision)
    if dense_precision != "fp32":
        from sixfold.partitioner.precision.dense import apply_dense_precision
        apply_dense_precision(partitioned, dense_precision)
    if sparse_on_cards:
        from sixfold.partitioner.placement.sharding import shard_tables
        shard_tables(partitioned, sparse_on_cards)  # type: ignore[arg-type]
    return load_partitioned(partitioned, backend=backend, metrics=metrics, batching=batching,
                            backend_options=backend_options, max_card_rows=max_card_rows,
                            min_split_rows=min_split_rows, host_dense_max_rows=host_dense_max_rows,
                            allow_nonfinite=allow_nonfinite, card_timeout_multiple=card_timeout_multiple,
                            card_timeout_floor_s=card_timeout_floor_s, table_memory=table_memory,
                            cache_policy=cache_policy, host_chunk_rows=host_chunk_rows, warm_from=warm_from,
                            card_scheduling=card_scheduling, cache_dir=cache_dir, lanes_on_host=lanes_on_host)


def load_from_repository(repository: ModelRepository, name: str, version: str, *, backend: str,
                         metrics: ServerMetrics, batching: BatchingConfig, backend_options: dict | None = None,
                         max_card_rows: int | None = None, host_dense_max_rows: int = -1,
                         min_split_rows: int = DEFAULT_MIN_SPLIT_ROWS, allow_nonfinite: bool = False,
                         card_timeout_multiple: float = 10.0, card_timeout_floor_s: float = 0.5,
                         table_memory: int | float | None = None, cache_policy: str = "tinylfu",
                         host_chunk_rows: int = 0, warm_from: str | Path | None = None,
                         card_scheduling: str = DEFAULT_CARD_SCHEDULING,
                         cache_dir: str | Path | None = None, cards: int | None = None,
                         card_spec: str | None = None) -> ServedModel:
    """Load version ``version`` of repository model ``name`` (served under the folder's name).

    ``cards``/``card_spec`` (sixfold-serve's ``--cards``/``--card-spec``, None: not given) must
    agree with the version's plan, else the load is refused (``card_flags.check_card_flags``).

    The model's config.pbtxt, when it has one, overrides the server-wide settings
    given here: its ``dynamic_batching`` replaces ``batching``, and its
    ``sixfold.*`` parameters the backend, backend options and row limits.
    ``sixfold.warm_from`` (a recording; relative to the model's folder; empty: none)
    replaces ``warm_from``.
    """
    settings = settings_from_proto(repository.config(name), source=str(repository.model_dir(name) / CONFIG_FILE))
    extras = settings.extras
    if settings.proto.HasField("dynamic_batching") or {"max_batch_rows", "max_queue_work_ms", "max_queue_bytes_mb"} & set(extras):
        batching = settings.batching
    if "warm_from" in extras:
        warm_from = repository.model_dir(name) / extras["warm_from"] if extras["warm_from"] else None
    read = repository.read(name, version)
    check_card_flags(read.plan, name, version, cards=cards, card_spec=card_spec)
    served = load_partitioned(
        read, backend=extras.get("backend", backend), metrics=metrics, batching=batching, version=version, name=name,
        backend_options=extras.get("backend_options", backend_options),
        max_card_rows=extras.get("max_card_batch_rows", max_card_rows),
        min_split_rows=extras.get("min_split_rows", min_split_rows),
        host_dense_max_rows=extras.get("host_dense_max_rows", host_dense_max_rows),
        allow_nonfinite=extras.get("allow_nonfinite", allow_nonfinite),
        card_timeout_multiple=extras.get("card_timeout_multiple", card_timeout_multiple),
        card_timeout_floor_s=extras["card_timeout_floor_ms"] / 1e3 if "card_timeout_floor_ms" in extras
        else card_timeout_floor_s, table_memory=extras.get("table_memory", table_memory),
        cache_policy=extras.get("table_cache_policy", cache_policy), host_chunk_rows=host_chunk_rows,
        warm_from=warm_from, card_scheduling=extras.get("card_scheduling", card_scheduling), cache_dir=cache_dir)
    served.parameters.update({k: v for k, v in settings.parameters.items() if not k.startswith("sixfold.")})
    from sixfold.server.deltas.delta_log import attach
    try:
        attach(served, read.path)  # table deltas applied before: replayed before serving (sixfold.server.deltas.delta_log)
    except BaseException:
        served.runtime.close()
        raise
    return served
