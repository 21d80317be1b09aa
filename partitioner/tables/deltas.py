"""Table deltas: the rows that changed between two versions of a model, as a checksummed folder.

A model version is its base tables plus an ordered list of deltas (docs/deltas.md).
One delta is a folder::

    DELTA/delta.json            what it is (below)
    DELTA/table_NNN.ids.npy     int64 [n]: the changed rows of table NNN, ascending, distinct
    DELTA/table_NNN.rows.npy    float32 [n, dim]: their new values
    DELTA/table_NNN.int8.npy    optional uint8 [n, dim + 8]: the same rows row-wise quantized (int8/int4
                                tables: the server takes them as they are, no re-quantization)

``delta.json``::

    {"format": "sixfold-delta", "format_version": 1, "model": "rm2",
     "base": {"sequence": 0, "fingerprint": "sha256:..."},   # what it applies to
     "sequence": 1, "fingerprint": "sha256:...",             # what the tables are after it
     "tables": [{"table": 3, "rows": 120, "dim": 64,
                 "ids": {"file": "table_003.ids.npy", "checksum": "crc32:<hex>:<bytes>"},
                 "values": {"file": "table_003.rows.npy", "dtype": "float32", "checksum": "..."},
                 "packed": {"precision": "int8", "file": "table_003.int8.npy", "checksum": "..."}}]}

A version's *fingerprint* is a SHA-256 over its ``tables/table_NNN.npy`` checksums (plan.json's,
computed when plan.json has none): two folders with the same rows have the same fingerprint.
A served model starts at its version's fingerprint and sequence 0; each delta moves it to the
delta's own. ``read_delta`` checks a folder on its own (format, fields, files, checksums, shapes,
dtypes, ids distinct); ``Delta.check_against`` checks it against a model (name, base, tables, id
ranges, dims). Every error is a ``DeltaError`` naming the file or field; nothing is applied then.

``make_delta(old, new, out)`` compares two version folders table by table, streaming both
with positional reads in chunks of rows, each dropped from the page cache once compared (a
full-size table set is never in memory, nor pushed into the page cache; the changed
rows are), and writes only the rows whose bytes differ.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.partitioner.tables.checksums import file_checksum

__all__ = ["DeltaError", "Delta", "TableDelta", "read_delta", "make_delta", "write_delta", "version_fingerprint",
           "DELTA_FILE", "FORMAT", "FORMAT_VERSION"]

DELTA_FILE = "delta.json"
FORMAT = "sixfold-delta"
FORMAT_VERSION = 1
_CHUNK_ROWS = 1 << 16
_PACKED = ("int8", "int4")


class DeltaError(ValueError):
    """A delta that cannot be applied (malformed, damaged, or not for this model); the message names the file/field."""


@dataclass
class TableDelta:
    """One table's changed rows (arrays loaded; ``values`` fp32 or None, ``packed`` rows or None)."""

    table: int
    ids: np.ndarray
    values: np.ndarray | None
    packed: np.ndarray | None = None
    packed_precision: str | None = None
    packed_file: str | None = None

    @property
    def count(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class Delta:
    """A delta read and checked on its own (``read_delta``)."""

    path: Path
    model: str
    base_sequence: int
    base_fingerprint: str
    sequence: int
    fingerprint: str
    tables: list[TableDelta] = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return sum(t.count for t in self.tables)

    def check_against(self, model: str | Sequence[str], table_rows: Sequence[int], dim: int,
                      precisions: Sequence[str], packed_tables: Sequence[int] = ()) -> None:
        """DeltaError unless the model is one of ``model``'s names and every table, id, dim and row format fits."""
        where = self.path / DELTA_FILE
        names = [model] if isinstance(model, str) else list(model)
        if self.model not in names:
            raise DeltaError(f"{where}: model {self.model!r}, but it is being applied to model {names[0]!r}")
        for t in self.tables:
            if not 0 <= t.table < len(table_rows):
                raise DeltaError(f"{where}: unknown table {t.table}; the model has tables 0..{len(table_rows) - 1}")
            ids_file = self.path / f"table_{t.table:03d}.ids.npy"
            if t.count and (int(t.ids[0]) < 0 or int(t.ids[-1]) >= table_rows[t.table]):
                bad = int(t.ids[0]) if int(t.ids[0]) < 0 else int(t.ids[-1])
                raise DeltaError(f"{ids_file}: id {bad} is out of range for table {t.table} "
                                 f"({table_rows[t.table]} rows)")
            if t.values is not None and t.values.shape[1] != dim:
                raise DeltaError(f"{self.path / f'table_{t.table:03d}.rows.npy'}: rows of dim {t.values.shape[1]}; "
                                 f"table {t.table} has dim {dim}")
            precision = precisions[t.table]
            if t.packed is not None and t.packed_precision != precision and t.values is None:
                raise DeltaError(f"{where}: table {t.table} carries only {t.packed_precision} rows, but the model "
                                 f"serves it in {precision}")
            if t.values is None and t.table not in packed_tables and precision not in _PACKED:
                raise DeltaError(f"{where}: table {t.table} has no fp32 'values' rows; the model serves it in "
                                 f"{precision}")
            if t.packed is not None and t.packed_precision == precision:
                from sixfold.backends.host.host_embedding import bytes_per_row
                width = bytes_per_row(precision, dim)
                if t.packed.shape[1] != width:
                    raise DeltaError(f"{self.path / t.packed_file}: {precision} rows of {t.packed.shape[1]} bytes; "
                                     f"table {t.table} of dim {dim} needs {width}")


def _crc_entry(folder: Path, entry: Any, field_name: str) -> tuple[Path, np.ndarray]:
    """The entry's file, checked against its checksum, and its array (the file is read once)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not isinstance(entry.get("checksum"), str):
        raise DeltaError(f"{folder / DELTA_FILE}: {field_name} must be an object with 'file' and 'checksum'")
    name = entry["file"]
    if "/" in name or name.startswith(".") or not name.endswith(".npy"):
        raise DeltaError(f"{folder / DELTA_FILE}: {field_name}.file {name!r} must be a .npy file in the delta folder")
    path = folder / name
    if not path.is_file():
        raise DeltaError(f"{path}: missing ({field_name} in {DELTA_FILE} names it)")
    data = path.read_bytes()
    got = f"crc32:{zlib.crc32(data):08x}:{len(data)}"
    if got != entry["checksum"]:
        raise DeltaError(f"{path}: checksum mismatch: {got}, {DELTA_FILE} records {entry['checksum']}")
    try:
        return path, np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise DeltaError(f"{path}: not a readable .npy file ({exc})") from None


def _int(meta: dict, key: str, where: Path, minimum: int = 0) -> int:
    value = meta.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DeltaError(f"{where}: field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def read_delta(folder: str | Path) -> Delta:
    """Read and check a delta folder on its own; DeltaError naming the file or field on any fault."""
    folder = Path(folder)
    where = folder / DELTA_FILE
    try:
        meta = json.loads(where.read_text())
    except FileNotFoundError:
        raise DeltaError(f"{where}: missing; a delta folder holds {DELTA_FILE} and its table files") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise DeltaError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DeltaError(f"{where}: field 'format' must be {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise DeltaError(f"{where}: format_version {meta.get('format_version')!r} is not supported "
                         f"(this sixfold reads {FORMAT_VERSION})")
    model = meta.get("model")
    if not isinstance(model, str) or not model:
        raise DeltaError(f"{where}: field 'model' must be the model's name")
    base = meta.get("base")
    if not isinstance(base, dict):
        raise DeltaError(f"{where}: field 'base' must be an object with 'sequence' and 'fingerprint'")
    base_sequence = _int(base, "sequence", where)
    sequence = _int(meta, "sequence", where, 1)
    if sequence != base_sequence + 1:
        raise DeltaError(f"{where}: sequence {sequence} must follow its base sequence {base_sequence} (expected "
                         f"{base_sequence + 1})")
    for key, value in (("base.fingerprint", base.get("fingerprint")), ("fingerprint", meta.get("fingerprint"))):
        if not isinstance(value, str) or not value.startswith("sha256:"):
            raise DeltaError(f"{where}: field {key!r} must be a 'sha256:...' fingerprint")
    entries = meta.get("tables")
    if not isinstance(entries, list):
        raise DeltaError(f"{where}: field 'tables' must be a list")
    delta = Delta(folder, model, base_sequence, base["fingerprint"], sequence, meta["fingerprint"], meta=meta)
    seen: set[int] = set()
    for k, entry in enumerate(entries):
        label = f"tables[{k}]"
        if not isinstance(entry, dict):
            raise DeltaError(f"{where}: {label} must be an object")
        table = _int(entry, "table", where)
        if table in seen:
            raise DeltaError(f"{where}: table {table} appears twice in 'tables'")
        seen.add(table)
        count = _int(entry, "rows", where)
        ids_file, ids = _crc_entry(folder, entry.get("ids"), f"{label}.ids")
        if ids.dtype != np.int64 or ids.ndim != 1 or ids.shape[0] != count:
            raise DeltaError(f"{ids_file}: expected int64 [{count}] ids, got {ids.dtype} {list(ids.shape)}")
        if count > 1 and not bool(np.all(ids[1:] > ids[:-1])):
            raise DeltaError(f"{ids_file}: ids must be ascending and distinct (a row changes once per delta)")
        values = packed = precision = None
        if entry.get("values") is not None:
            path, values = _crc_entry(folder, entry["values"], f"{label}.values")
            if values.dtype != np.float32 or values.ndim != 2 or values.shape[0] != count:
                raise DeltaError(f"{path}: expected float32 [{count}, dim] rows, got {values.dtype} "
                                 f"{list(values.shape)}")
            dim = entry.get("dim")
            if dim is not None and values.shape[1] != dim:
                raise DeltaError(f"{path}: rows of dim {values.shape[1]}, {DELTA_FILE} says dim {dim}")
        if entry.get("packed") is not None:
            path, packed = _crc_entry(folder, entry["packed"], f"{label}.packed")
            precision = entry["packed"].get("precision")
            if precision not in _PACKED:
                raise DeltaError(f"{where}: {label}.packed.precision must be one of {_PACKED}, got {precision!r}")
            if packed.dtype != np.uint8 or packed.ndim != 2 or packed.shape[0] != count:
                raise DeltaError(f"{path}: expected uint8 [{count}, bytes] {precision} rows, got {packed.dtype} "
                                 f"{list(packed.shape)}")
        if values is None and packed is None:
            raise DeltaError(f"{where}: {label} has neither 'values' nor 'packed' rows")
        delta.tables.append(TableDelta(table, ids, values, packed, precision,
                                       entry["packed"]["file"] if packed is not None else None))
    delta.tables.sort(key=lambda t: t.table)
    return delta


# ---- fingerprints and make ----------------------------------------------------------------------


def _table_names(tables_dir: Path) -> list[str]:
    from sixfold.backends.host.host_embedding import table_files
    try:
        return [p.name for p in table_files(tables_dir)]
    except (FileNotFoundError, ValueError) as exc:
        raise DeltaError(f"{tables_dir}: {exc}") from None


def version_fingerprint(version_dir: str | Path, plan: dict | None = None) -> str:
    """SHA-256 over the version's ``tables/table_NNN.npy`` checksums (plan.json's, else computed)."""
    version_dir = Path(version_dir)
    plan = plan if plan is not None else _plan(version_dir)
    recorded = (plan.get("tables") or {}).get("checksums") or {}
    digest = hashlib.sha256()
    for name in _table_names(version_dir / "tables"):
        checksum = recorded.get(name) or file_checksum(version_dir / "tables" / name)
        digest.update(f"{name}={checksum}\n".encode())
    return "sha256:" + digest.hexdigest()


def _plan(version_dir: Path) -> dict:
    path = version_dir / "plan.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DeltaError(f"{path}: missing; a model version folder is written by sixfold-partition --out") from None
    except ValueError as exc:
        raise DeltaError(f"{path}: not valid JSON ({exc})") from None


def _precisions(plan: dict, count: int) -> list[str]:
    p = (plan.get("tables") or {}).get("precision", "fp32")
    return [p] * count if isinstance(p, str) else list(p)


def _dense_files(version_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(version_dir.glob("dense*.onnx"))}


def _write_npy(path: Path, array: np.ndarray) -> dict:
    from sixfold.backends.host.derived_cache import write_npy

    write_npy(path, array.dtype, array.shape, [array])  # a full disk: an OSError naming the file and the bytes
    return {"file": path.name, "checksum": file_checksum(path)}


def _pack(precision: str, rows: np.ndarray) -> np.ndarray:
    import torch
    op = (torch.ops.quantized.embedding_bag_byte_prepack if precision == "int8"
          else torch.ops.quantized.embedding_bag_4bit_prepack)
    return op(torch.from_numpy(np.ascontiguousarray(rows, np.float32))).numpy()


def _chunk_pairs(a: Any, b: Any, chunk_rows: int):
    """(first row, a's rows, b's rows) as uint8 [n, row bytes], read in chunks with preads; each chunk's
    pages are dropped from the page cache after it is compared (tables larger than memory stay out of it)."""
    fa, fb = os.open(a.path, os.O_RDONLY), os.open(b.path, os.O_RDONLY)
    try:
        for lo in range(0, a.rows, chunk_rows):
            n = min(chunk_rows, a.rows - lo)
            chunks = []
            for fd, table in ((fa, a), (fb, b)):
                start, size = table.offset + lo * table.row_bytes, n * table.row_bytes
                data = os.pread(fd, size, start)
                if len(data) != size:
                    raise DeltaError(f"{table.path}: short read at row {lo}")
                try:
                    os.posix_fadvise(fd, start, size, os.POSIX_FADV_DONTNEED)
                except (OSError, AttributeError):
                    pass
                chunks.append(np.frombuffer(data, np.uint8).reshape(n, table.row_bytes))
            yield lo, chunks[0], chunks[1]
    finally:
        os.close(fa)
        os.close(fb)


def _fresh_stage(out: Path) -> Path:
    """An empty folder beside ``out`` to write a delta into before it is published whole.

    Hidden (a watched folder skips it) and named by this process, so the temporaries of
    processes that no longer run are removed here first (a crash's leftovers).
    """
    from sixfold.backends.host.derived_cache import remove_stale_temporaries

    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out.parent)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, meta: dict, out: Path) -> None:
    """Write the delta's description last, then put the folder in place of ``out`` in one rename."""
    (tmp / DELTA_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def make_delta(old: str | Path, new: str | Path, out: str | Path, *, base_sequence: int = 0,
               model: str | None = None, chunk_rows: int = _CHUNK_ROWS, progress: bool = False,
               advance: Callable[[int], None] | None = None) -> Delta:
    """Write the rows that differ between version folders ``old`` and ``new`` as a delta at ``out``.

    Both must be the same model with the same tables (count, rows, dim, precision) and the same
    dense partition (a delta carries table rows only). Rows are compared bit for bit, chunk by
    chunk with preads. ``base_sequence``: the sequence ``old`` is served at (0: the version as
    written; k: after k deltas). ``model``: the served model's name (default: the plan's model, e.g. rm2;
    a server also takes a delta named after the model it serves under). The folder is written beside
    ``out`` and renamed into place.
    """
    old, new, out = Path(old), Path(new), Path(out)
    old_plan, new_plan = _plan(old), _plan(new)
    if old_plan.get("model") != new_plan.get("model"):
        raise DeltaError(f"{new / 'plan.json'}: model {new_plan.get('model')!r} differs from {old / 'plan.json'}'s "
                         f"{old_plan.get('model')!r}")
    names = _table_names(old / "tables")
    if _table_names(new / "tables") != names:
        raise DeltaError(f"{new / 'tables'}: {len(_table_names(new / 'tables'))} tables; {old / 'tables'} has "
                         f"{len(names)}")
    if _dense_files(old) != _dense_files(new):
        raise DeltaError(f"{new}: its dense partition differs from {old}'s; a delta carries table rows only "
                         "(serve a new version for a new dense part)")
    precisions = _precisions(old_plan, len(names))
    if _precisions(new_plan, len(names)) != precisions:
        raise DeltaError(f"{new / 'plan.json'}: table precisions differ from {old / 'plan.json'}'s")
    from sixfold.backends.host.table_store import open_table_file

    pairs = []
    for name in names:
        try:
            a, b = open_table_file(old / "tables" / name), open_table_file(new / "tables" / name)
        except (ValueError, FileNotFoundError) as exc:
            raise DeltaError(str(exc)) from None
        if (a.rows, a.width, a.dtype) != (b.rows, b.width, b.dtype):
            raise DeltaError(f"{b.path}: {b.dtype} [{b.rows}, {b.width}]; {a.path} is {a.dtype} [{a.rows}, {a.width}]")
        pairs.append((a, b))
    total = sum(a.rows * a.row_bytes for a, _ in pairs)
    stop = lambda: None  # noqa: E731
    if advance is None:
        if progress:
            from sixfold.partitioner.tables.build import _progress
            advance, stop = _progress(total, f"comparing {len(names)} tables", True)
        else:
            advance = lambda n: None  # noqa: E731
    tmp = _fresh_stage(out)
    entries = []
    try:
        for t, (a, b) in enumerate(pairs):
            ids_parts, row_parts = [], []
            for lo, ca, cb in _chunk_pairs(a, b, chunk_rows):
                changed = np.flatnonzero((ca != cb).any(axis=1))
                if changed.shape[0]:
                    ids_parts.append(changed.astype(np.int64) + lo)
                    row_parts.append(cb[changed].view(b.dtype))
                advance(ca.nbytes)
            if not ids_parts:
                continue
            ids = np.concatenate(ids_parts)
            rows = np.concatenate(row_parts)
            entry: dict[str, Any] = {"table": t, "rows": int(ids.shape[0]),
                                     "ids": _write_npy(tmp / f"table_{t:03d}.ids.npy", ids)}
            if a.dtype == np.dtype(np.uint8) and precisions[t] in _PACKED:  # packed-only tables: their rows as they are
                entry["packed"] = {"precision": precisions[t], **_write_npy(tmp / f"table_{t:03d}.{precisions[t]}.npy",
                                                                              rows)}
            else:
                rows = np.ascontiguousarray(rows, np.float32)
                entry["dim"] = int(rows.shape[1])
                entry["values"] = {"dtype": "float32", **_write_npy(tmp / f"table_{t:03d}.rows.npy", rows)}
                if precisions[t] in _PACKED:
                    entry["packed"] = {"precision": precisions[t],
                                       **_write_npy(tmp / f"table_{t:03d}.{precisions[t]}.npy",
                                                    _pack(precisions[t], rows))}
            entries.append(entry)
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model or old_plan.get("model"),
                "base": {"sequence": base_sequence, "fingerprint": version_fingerprint(old, old_plan)},
                "sequence": base_sequence + 1, "fingerprint": version_fingerprint(new, new_plan),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "source": {"old": str(old), "new": str(new)}, "tables": entries}
        _publish(tmp, meta, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        stop()
    return read_delta(out)



def write_delta(out: str | Path, model: str, base_sequence: int, base_fingerprint: str,
                tables: Mapping[int, tuple[np.ndarray, np.ndarray]], *,
                precisions: Mapping[int, str] | None = None) -> Delta:
    """Write a delta from rows a trainer knows it changed (no full versions to compare): the trainer-side flow.

    ``tables``: table -> (row ids, fp32 rows). ``base_fingerprint``: what the model serves now (the
    previous delta's ``fingerprint``, ``version_fingerprint(version_dir)`` for the first one, or the
    served model's ``sixfold.delta_fingerprint`` parameter). ``precisions``: table -> int8/int4 to add
    packed rows for tables served quantized. The new fingerprint chains the base and the delta's files.
    """
    out = Path(out)
    tmp = _fresh_stage(out)
    digest = hashlib.sha256(base_fingerprint.encode())
    entries = []
    try:
        for t, (ids, rows) in sorted(tables.items()):
            ids = np.asarray(ids, np.int64)
            order = np.argsort(ids, kind="stable")
            ids, rows = ids[order], np.ascontiguousarray(np.asarray(rows, np.float32)[order])
            entry: dict[str, Any] = {"table": int(t), "rows": int(ids.shape[0]), "dim": int(rows.shape[1]),
                                     "ids": _write_npy(tmp / f"table_{t:03d}.ids.npy", ids),
                                     "values": {"dtype": "float32", **_write_npy(tmp / f"table_{t:03d}.rows.npy", rows)}}
            p = (precisions or {}).get(t)
            if p in _PACKED:
                entry["packed"] = {"precision": p, **_write_npy(tmp / f"table_{t:03d}.{p}.npy", _pack(p, rows))}
            for key in ("ids", "values", "packed"):
                if key in entry:
                    digest.update(f"{t}:{key}={entry[key]['checksum']}\n".encode())
            entries.append(entry)
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "model": model,
                "base": {"sequence": base_sequence, "fingerprint": base_fingerprint},
                "sequence": base_sequence + 1, "fingerprint": "sha256:" + digest.hexdigest(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tables": entries}
        _publish(tmp, meta, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return read_delta(out)
