"""Table deltas on a served model: apply, roll back, persist, replay, watch a folder.

A served model version starts at its tables' fingerprint and delta sequence 0. Applying a
delta (``sixfold.partitioner.tables.deltas``), under the model's delta lock:

1. read and check it whole (files, checksums, shapes, dtypes, ids) and against the model
   (name, base sequence and fingerprint, tables, id ranges, dims): any fault is a
   ``DeltaError`` (INVALID_ARGUMENT; FAILED_PRECONDITION for a wrong base or a gap) and
   nothing changes;
2. convert its rows to the form each table is stored in and read the rows they replace;
3. persist: ``VERSION/deltas/NNNNNN/`` (ids, stored rows, replaced rows, delta.json) written
   beside and renamed into place, then ``VERSION/deltas/applied.json`` replaced atomically;
4. swap between two host-stage batches (``PlanRuntime.between_batches``): every request is
   scored with the old rows or the new ones, never a mix; batches wait only for the swap.

Steps 1-3 run on one worker thread at a lower CPU priority (niceness ``NICE``), so on a busy
host they take the CPU serving leaves; the swap itself runs at normal priority.

Why a log rather than rewriting the table files: the base files stay as ``sixfold-partition``
wrote them (their plan.json checksums hold, and the version a rollback returns to is on disk),
a delta costs its own bytes to persist (1% of the rows, not every table it touches), and a
restart replays the log onto the tables before serving (``attach``): rows in memory are
written, a tiered store reads the changed rows from the log's files. To start a new base,
fold the deltas into a new version (``sixfold-delta make`` the other way: partition the
trained tables as a new version and load it).

Rollback undoes the last applied delta with the rows it replaced (kept in its log entry).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from sixfold.backends.host.derived_cache import remove_stale_temporaries, write_npy
from sixfold.backends.os_threads import start_worker_thread
from sixfold.backends.processes import process_alive
from sixfold.partitioner.tables.deltas import DELTA_FILE, Delta, DeltaError, read_delta, version_fingerprint

from sixfold.server.errors import InvalidInput, ModelNotFound, ServingError, clip, clip_names

__all__ = ["DeltaLog", "DeltaRejected", "DeltaOutOfOrder", "DeltaNotStored", "attach", "DeltaWatcher", "delta_request",
           "LOG_DIR", "STATE_FILE", "SEQUENCE_PARAMETER"]

log = logging.getLogger(__name__)

LOG_DIR = "deltas"
STATE_FILE = "applied.json"
SEQUENCE_PARAMETER = "sixfold.delta_sequence"
FINGERPRINT_PARAMETER = "sixfold.delta_fingerprint"


class DeltaRejected(InvalidInput):
    """A delta that is malformed, damaged or not for this model: nothing was applied."""

    reason = "delta_rejected"


class DeltaOutOfOrder(InvalidInput):
    """A delta whose base is not what the model serves now (a gap, an old delta, another base): FAILED_PRECONDITION."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "delta_out_of_order"


class DeltaNotStored(ServingError):
    """A delta whose log entry could not be written (a full disk, a read-only folder): nothing was applied."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "delta_not_stored"


@dataclass
class _Entry:
    name: str
    sequence: int
    fingerprint: str
    base_fingerprint: str


_POOL: ThreadPoolExecutor | None = None
NICE = 10
"""Delta work off the serving path (checks, conversion, persisting, page faults) runs at this niceness."""


async def _background(fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` on the delta worker thread (one, at a lower CPU priority than serving)."""
    global _POOL
    if _POOL is None:
        # serving threads win the CPU from delta work
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="sixfold-delta", initializer=start_worker_thread,
                                   initargs=("sixfold-delta", NICE))
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


class DeltaLog:
    """One served model version's applied deltas (see the module docstring)."""

    def __init__(self, served: Any, version_dir: Path) -> None:
        from sixfold.backends.host.host_embedding import HostEmbeddingStage

        self.served = served
        self.version_dir = Path(version_dir)
        self.folder = self.version_dir / LOG_DIR
        stage = getattr(served.runtime.host, "stage", None)
        if not isinstance(stage, HostEmbeddingStage):
            raise DeltaRejected(f"model '{served.name}': deltas need a table-batched host stage (tables/); this "
                                f"model's host stage is {type(served.runtime.host).__name__}")
        self.stage = stage
        remove_stale_temporaries(self.folder)  # entries a killed process was writing
        _remove_stale_uploads()
        self.base_fingerprint = version_fingerprint(self.version_dir)
        self.entries: list[_Entry] = []
        self._lock: asyncio.Lock | None = None
        self.last_apply_s = 0.0
        """Seconds the last swap held the host stage."""

    # ---- state --------------------------------------------------------------------------------

    @property
    def sequence(self) -> int:
        return self.entries[-1].sequence if self.entries else 0

    @property
    def fingerprint(self) -> str:
        return self.entries[-1].fingerprint if self.entries else self.base_fingerprint

    def _publish(self) -> None:
        self.served.parameters[SEQUENCE_PARAMETER] = str(self.sequence)
        self.served.parameters[FINGERPRINT_PARAMETER] = self.fingerprint
        self.served.metrics.delta_sequence.labels(self.served.name, self.served.version).set(self.sequence)

    def _write_state(self, entries: list[_Entry]) -> None:
        """Replace applied.json with ``entries``: a temporary, allocated whole, written, synced and renamed.

        Any OSError (a full disk, a read-only folder) is DeltaNotStored naming the file and the bytes,
        and leaves the previous applied.json whole (the temporary is removed)."""
        state = {"sequence": entries[-1].sequence if entries else 0,
                 "fingerprint": entries[-1].fingerprint if entries else self.base_fingerprint,
                 "base_fingerprint": self.base_fingerprint,
                 "entries": [e.__dict__ for e in entries]}
        data = json.dumps(state, indent=1).encode()
        path = self.folder / STATE_FILE
        tmp = self.folder / f".{STATE_FILE}.tmp{os.getpid()}"
        try:
            self.folder.mkdir(exist_ok=True)
            _write_synced(tmp, data)
            os.replace(tmp, path)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            raise DeltaNotStored(f"{path}: the delta log's state ({len(data)} bytes) could not be written: "
                                 f"{exc.strerror or exc}; nothing changed, the model serves sequence "
                                 f"{self.sequence} (the previous {STATE_FILE} is whole)") from None
        _fsync_dir(self.folder)

    def _entry_updates(self, entry: str, kind: str) -> tuple[dict[int, tuple[np.ndarray, np.ndarray]],
                                                            dict[int, np.ndarray]]:
        """(table -> (ids, rows), table -> rows as a map of the entry's file) for ``kind`` stored | undo."""
        folder = self.folder / entry
        meta = json.loads((folder / "entry.json").read_text())
        updates, sources = {}, {}
        for t in meta["tables"]:
            ids = np.load(folder / f"table_{t:03d}.ids.npy")
            rows = np.load(folder / f"table_{t:03d}.{kind}.npy", mmap_mode="r")
            if self.stage.precisions[t] != meta["precisions"][str(t)]:
                raise DeltaRejected(f"{folder}: stored for table {t} in {meta['precisions'][str(t)]}; the model "
                                    f"serves it in {self.stage.precisions[t]}")
            updates[t], sources[t] = (ids, np.asarray(rows)), rows
        return updates, sources

    def replay(self) -> None:
        """At load, before serving: apply the persisted log to the tables (no lock needed: nothing runs)."""
        from sixfold.backends.host.row_updates import prepare

        path = self.folder / STATE_FILE
        if path.is_file():
            state = json.loads(path.read_text())
            entries = [_Entry(**e) for e in state.get("entries", [])]
            if entries and entries[0].base_fingerprint != self.base_fingerprint:
                raise DeltaRejected(f"{path}: its deltas apply to tables {entries[0].base_fingerprint}, but "
                                    f"{self.version_dir / 'tables'} is {self.base_fingerprint}; move {self.folder} "
                                    "away to serve the tables alone")
            t0 = time.perf_counter()
            for e in entries:
                updates, sources = self._entry_updates(e.name, "stored")
                prepare(self.stage, updates, sources, undo=False).commit()
            self.entries = entries
            if entries:
                log.info("model %s version %s: replayed %d delta(s) to sequence %d in %.2f s", self.served.name,
                         self.served.version, len(entries), self.sequence, time.perf_counter() - t0)
        self._publish()

    # ---- apply and roll back ------------------------------------------------------------------

    def _lock_now(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def apply(self, folder: str | Path) -> dict[str, Any]:
        """Check, persist and swap in the delta at ``folder``; returns what was applied (see the module docstring)."""
        async with self._lock_now():
            t0 = time.perf_counter()
            try:
                delta = await _background(read_delta, folder)
            except DeltaError as exc:
                raise DeltaRejected(str(exc)) from None
            self._check_order(delta)
            try:
                delta.check_against([self.served.name, self.served.plan.model], self.stage.table_rows, self.stage.dim, self.stage.precisions,
                                    sorted(self.stage.packed))
            except DeltaError as exc:
                raise DeltaRejected(str(exc)) from None
            checked = time.perf_counter()
            swap, entry = await _background(self._prepare_apply, delta)
            entries = [*self.entries, entry]
            try:
                await _background(self._write_state, entries)
            except BaseException:
                shutil.rmtree(self.folder / entry.name, ignore_errors=True)
                raise
            prepared = time.perf_counter()
            held = await self._swap(swap)
            self.entries = entries
            self._publish()
            took = time.perf_counter() - t0
            log.info("model %s version %s: delta %d applied (%d rows in %d tables; %.3f s, host stage held %.1f ms)",
                     self.served.name, self.served.version, delta.sequence, delta.rows, len(delta.tables), took,
                     held["held_seconds"] * 1e3, extra={"event": "delta_applied", "model": self.served.name,
                                                        "sequence": delta.sequence})
            return {"model": self.served.name, "version": self.served.version, "sequence": self.sequence,
                    "rows": delta.rows, "seconds": took, "check_seconds": checked - t0,
                    "prepare_seconds": prepared - checked, **held}

    def _check_order(self, delta: Delta) -> None:
        where = delta.path / DELTA_FILE
        if delta.base_sequence != self.sequence:
            if delta.base_sequence > self.sequence:
                why = (f"a gap: the model serves sequence {self.sequence}, this delta applies on top of sequence "
                       f"{delta.base_sequence} (apply deltas {self.sequence + 1}..{delta.base_sequence} first)")
            else:
                why = (f"the model serves sequence {self.sequence} already; this delta applies on top of "
                       f"sequence {delta.base_sequence}")
            raise DeltaOutOfOrder(f"{where}: {why}")
        if delta.base_fingerprint != self.fingerprint:
            raise DeltaOutOfOrder(f"{where}: wrong base: base.fingerprint {delta.base_fingerprint}, the model's "
                                  f"tables at sequence {self.sequence} are {self.fingerprint}")

    def _prepare_apply(self, delta: Delta):
        """In a thread: stored rows, the log entry on disk, and the swap made ready."""
        from sixfold.backends.host.row_updates import prepare, read_rows, stored_rows

        stage = self.stage
        try:
            updates = {t.table: (t.ids, stored_rows(stage, t.table, t.values, t.packed, t.packed_precision))
                       for t in delta.tables}
        except ValueError as exc:
            raise DeltaRejected(f"{delta.path}: {exc}") from None
        name = f"{delta.sequence:06d}"
        final = self.folder / name
        tmp = self.folder / f".{name}.tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            for t, (ids, rows) in updates.items():
                for kind, array in (("ids", ids), ("stored", rows), ("undo", read_rows(stage, t, ids))):
                    write_npy(tmp / f"table_{t:03d}.{kind}.npy", array.dtype, array.shape, [array])
            shutil.copyfile(delta.path / DELTA_FILE, tmp / DELTA_FILE)
            (tmp / "entry.json").write_text(json.dumps({
                "sequence": delta.sequence, "tables": sorted(updates),
                "precisions": {str(t): stage.precisions[t] for t in updates}}))
            _fsync_tree(tmp)
            shutil.rmtree(final, ignore_errors=True)  # a leftover of a crash before applied.json named it
            os.replace(tmp, final)
            _fsync_dir(self.folder)
        except OSError as exc:  # e.g. a full disk: nothing applied, nothing half-written left
            shutil.rmtree(tmp, ignore_errors=True)
            raise DeltaNotStored(f"{delta.path}: not applied: its log entry could not be written to {final}: "
                                 f"{exc.strerror or exc}") from None
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        try:
            _, sources = self._entry_updates(name, "stored")
            swap = prepare(stage, updates, sources, undo=False)
        except BaseException:
            shutil.rmtree(final, ignore_errors=True)
            raise
        return swap, _Entry(name, delta.sequence, delta.fingerprint, delta.base_fingerprint)

    async def _swap(self, swap: Any) -> dict[str, float]:
        """Commit ``swap`` between batches: seconds waiting for batches in the host stage, and committing."""
        t0 = time.perf_counter()
        started = []

        def commit() -> Any:
            started.append(time.perf_counter())
            return asyncio.to_thread(swap.commit)

        await self.served.runtime.between_batches(commit)
        end = time.perf_counter()
        self.last_apply_s = end - t0
        return {"held_seconds": end - t0, "wait_seconds": started[0] - t0, "commit_seconds": end - started[0]}

    async def rollback(self, expected: int | None = None) -> dict[str, Any]:
        """Undo the last applied delta (its replaced rows back, the log one entry shorter).

        ``expected``: the sequence the caller believes the model serves; another one refuses the rollback
        (FAILED_PRECONDITION), so a rollback retried after its reply was lost undoes nothing more."""
        from sixfold.backends.host.row_updates import prepare

        async with self._lock_now():
            if expected is not None and expected != self.sequence:
                raise DeltaOutOfOrder(f"model '{self.served.name}' version {self.served.version}: rollback expects "
                                      f"sequence {expected} but the model serves sequence {self.sequence}; nothing "
                                      "rolled back (a retried rollback whose first try took effect?)")
            if not self.entries:
                raise DeltaOutOfOrder(f"model '{self.served.name}' version {self.served.version}: no delta to roll "
                                      "back (sequence 0)")
            t0 = time.perf_counter()
            last = self.entries[-1]
            updates, sources = await _background(self._entry_updates, last.name, "undo")
            swap = await _background(functools.partial(prepare, undo=False), self.stage, updates, sources)
            entries = self.entries[:-1]
            await _background(self._write_state, entries)
            held = await self._swap(swap)
            self.entries = entries
            self._publish()
            # NOTE: a tiered store's overlay may still map its files: POSIX keeps a mapped file until unmapped.
            await _background(shutil.rmtree, self.folder / last.name, True)
            log.info("model %s version %s: delta %d rolled back to sequence %d", self.served.name,
                     self.served.version, last.sequence, self.sequence,
                     extra={"event": "delta_rolled_back", "model": self.served.name, "sequence": self.sequence})
            return {"model": self.served.name, "version": self.served.version, "sequence": self.sequence,
                    "rows": sum(ids.shape[0] for ids, _ in updates.values()),
                    "seconds": time.perf_counter() - t0, **held}


def _write_synced(path: Path, data: bytes) -> None:
    """``data`` to a new file at ``path``, allocated first (a full disk fails before a byte is written) and synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            os.posix_fallocate(fd, 0, len(data))
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (its directory entry)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def attach(served: Any, version_dir: str | Path) -> DeltaLog | None:
    """Give a repository-loaded model its delta log and replay it; None for models deltas cannot reach."""
    try:
        deltas = DeltaLog(served, Path(version_dir))
    except DeltaRejected as exc:
        log.debug("%s", exc)
        return None
    except DeltaError as exc:  # e.g. no tables folder
        log.debug("model %s: no deltas (%s)", served.name, exc)
        return None
    deltas.replay()
    served.deltas = deltas
    return deltas


def _log_of(core: Any, name: str) -> DeltaLog:
    model = core.model(name)
    deltas = getattr(model, "deltas", None)
    if deltas is None:
        raise DeltaRejected(f"model '{name}' takes no deltas: deltas need a model loaded from a repository "
                            "(--model-repository) with a table-batched host stage (tables/)")
    return deltas


async def apply(core: Any, name: str, folder: str | Path) -> dict[str, Any]:
    """Apply the delta at ``folder`` to model ``name`` (its newest version)."""
    return await _log_of(core, name).apply(folder)


async def rollback(core: Any, name: str, expected: int | None = None) -> dict[str, Any]:
    return await _log_of(core, name).rollback(expected)


# ---- the repository-load surface ----------------------------------------------------------------

DELTA_PATH = "sixfold.delta_path"
DELTA_ROLLBACK = "sixfold.delta_rollback"
DELTA_ROLLBACK_FROM = "sixfold.delta_rollback_from"
"""Roll back only if the model serves this sequence now: a retried rollback undoes nothing more."""
_TRUE = ("1", "true", "yes")


def delta_request(parameters: Mapping[str, Any]) -> tuple[str, Any] | None:
    """What a RepositoryModelLoad's parameters ask of deltas: ("apply", folder) | ("upload", files) |
    ("rollback", expected sequence or None) | None (a plain load).

    ``parameters``: plain values (str, bool, int, bytes). Recognised: ``sixfold.delta_path`` (a delta
    folder on the server), ``sixfold.delta_rollback`` (true: roll back whatever is served),
    ``sixfold.delta_rollback_from`` (N: roll back only from sequence N), ``file:<name>`` (a delta's files, uploaded),
    and ``config`` (a ModelConfig as JSON, tritonclient's ``load_model(config=...)``) whose ``parameters``
    carry the same keys.
    """
    params = dict(parameters)
    config = params.pop("config", None)
    if config is not None:
        try:
            data = json.loads(config if isinstance(config, str) else bytes(config).decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidInput(f"RepositoryModelLoad: parameter 'config' is not JSON ({clip(str(exc))})") from None
        for key, value in ((data or {}).get("parameters") or {}).items():
            params.setdefault(key, value.get("string_value") if isinstance(value, dict) else value)
    files = {k[5:]: v for k, v in params.items() if k.startswith("file:")}
    rollback, expected = params.get(DELTA_ROLLBACK), params.get(DELTA_ROLLBACK_FROM)
    if expected is not None:
        if not str(expected).strip().isdigit():
            raise InvalidInput(f"RepositoryModelLoad: parameter {DELTA_ROLLBACK_FROM} is {clip(str(expected))!r}; give "
                               "the sequence the model serves now (the rollback happens only if it still does)")
        return "rollback", int(str(expected).strip())
    if rollback is not None and str(rollback).lower() in _TRUE:
        return "rollback", None
    if params.get(DELTA_PATH):
        return "apply", str(params[DELTA_PATH])
    if files:
        if DELTA_FILE not in files:
            raise InvalidInput(f"RepositoryModelLoad: uploaded files {clip_names(sorted(files))} hold no '{DELTA_FILE}' "
                               "(sixfold takes uploaded files as a table delta only)")
        return "upload", files
    unknown = sorted(k for k in params if k.startswith("sixfold.delta"))
    if unknown:
        raise InvalidInput(f"RepositoryModelLoad: unknown delta parameter(s) {clip_names(unknown)}; known: {DELTA_PATH}, "
                           f"{DELTA_ROLLBACK}, {DELTA_ROLLBACK_FROM}, file:<name>")
    return None


_UPLOAD_PREFIX = "sixfold-delta-"
"""Deltas uploaded over RepositoryModelLoad are written to ``$TMPDIR/sixfold-delta-PID-*`` while applied."""


def _remove_stale_uploads() -> None:
    """Remove uploaded-delta folders of processes that no longer run (a kill during an apply leaves one)."""
    for entry in Path(tempfile.gettempdir()).glob(f"{_UPLOAD_PREFIX}*-*"):
        pid = entry.name[len(_UPLOAD_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


async def serve_request(core: Any, name: str, request: tuple[str, Any]) -> dict[str, Any]:
    """Carry out ``delta_request``'s answer for model ``name``."""
    kind, arg = request
    if kind == "rollback":
        return await rollback(core, name, arg)
    if kind == "apply":
        return await apply(core, name, arg)
    with tempfile.TemporaryDirectory(prefix=f"{_UPLOAD_PREFIX}{os.getpid()}-") as tmp:
        for file, content in arg.items():
            if "/" in file or file.startswith(".") or not file:
                raise InvalidInput(f"RepositoryModelLoad: uploaded file name {clip(repr(file))} must be a plain file name")
            data = content if isinstance(content, (bytes, bytearray)) else base64.b64decode(content)
            Path(tmp, file).write_bytes(data)
        return await apply(core, name, tmp)


# ---- a watched folder ---------------------------------------------------------------------------


class DeltaWatcher:
    """Apply delta folders that appear under ``folder`` in sequence order (``sixfold-serve --watch-deltas``).

    Every ``interval_s`` the folder's sub-folders holding a delta.json are read (their delta.json
    only); a delta whose base sequence is what its model serves is applied; one that is older is
    skipped; one with a gap waits for the deltas before it. A delta that fails (malformed, damaged,
    wrong base) is logged and not tried again until its delta.json changes. Folders are read once
    they stop changing: a trainer should write a delta beside the folder and rename it in.
    """

    def __init__(self, core: Any, folder: str | Path, interval_s: float = 1.0) -> None:
        self.core, self.folder, self.interval_s = core, Path(folder), interval_s
        self.failed: dict[Path, float] = {}
        self.applied: list[Path] = []
        self._task: asyncio.Task | None = None
        self._waiting: set[Path] = set()

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            try:
                await self.scan()
            except Exception:  # noqa: BLE001 - the watcher keeps watching
                log.exception("watching %s for deltas failed; trying again", self.folder)
            await asyncio.sleep(self.interval_s)

    def _candidates(self) -> list[tuple[str, int, Path, float]]:
        found = []
        for sub in sorted(self.folder.iterdir()) if self.folder.is_dir() else []:
            meta_path = sub / DELTA_FILE
            if sub.name.startswith(".") or not meta_path.is_file():
                continue
            mtime = meta_path.stat().st_mtime
            if self.failed.get(sub) == mtime:
                continue
            try:
                meta = json.loads(meta_path.read_text())
                found.append((str(meta["model"]), int(meta["base"]["sequence"]), sub, mtime))
            except (ValueError, KeyError, TypeError, OSError) as exc:
                self.failed[sub] = mtime
                log.error("delta %s is not readable and is skipped: %s", sub, exc,
                          extra={"event": "delta_rejected", "path": str(sub)})
        return sorted(found, key=lambda c: (c[0], c[1], c[2].name))

    async def scan(self) -> int:
        """One pass: apply every delta that is next in its model's sequence; returns how many applied."""
        applied = 0
        progress = True
        while progress:
            progress = False
            for model, base, sub, mtime in await asyncio.to_thread(self._candidates):
                try:
                    deltas = _log_of(self.core, model)
                except (ModelNotFound, DeltaRejected):
                    continue  # not served (yet): wait
                if base < deltas.sequence or sub in self.applied:
                    continue
                if base > deltas.sequence:
                    if sub not in self._waiting:
                        self._waiting.add(sub)
                        log.info("delta %s waits: model %s serves sequence %d, it applies on top of %d",
                                 sub, model, deltas.sequence, base)
                    continue
                try:
                    await deltas.apply(sub)
                except ServingError as exc:
                    self.failed[sub] = mtime
                    log.error("delta %s rejected, nothing applied: %s", sub, exc.message,
                              extra={"event": "delta_rejected", "path": str(sub)})
                    continue
                self.applied.append(sub)
                self._waiting.discard(sub)
                applied += 1
                progress = True
        return applied
