"""Models larger than memory: write tables straight to disk in chunks, never whole in memory.

Two ways to get a table store (a version folder's ``tables/table_NNN.npy`` plus their
checksums in ``plan.json``) without holding a table set in DRAM:

* ``build_streamed("rm2", out)``: a built-in model at its published size. The dense part
  is partitioned from a small build of the same model (its layers do not depend on table
  sizes); the tables are then generated chunk by chunk straight into their files with
  DLRM's init, U(-sqrt(1/rows), sqrt(1/rows)) per table, from a per-table seeded stream
  (so not the same numbers as ``models.build`` at full size, which would need every
  table in memory). ``precision`` int8/int4/fp16 also writes the row-wise quantized
  copies (``tables/<precision>/table_NNN.npy``) chunk by chunk, as the host stage would.
* ``import_tables(source, version_dir)``: a user's trained weights, a ``torch.save``d
  state dict of EmbeddingBag tables (read with ``torch.load(mmap=True)``: no copy in
  memory) or a folder of per-table ``.npy`` files, copied into the store in chunks.

Both show a progress bar (rich) and leave every file's checksum in plan.json. Command
line: ``sixfold-partition tables build rm2 --out repo/rm2/1`` and
``sixfold-partition tables import state.pt --out repo/mine/1``.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["build_streamed", "import_tables", "write_table", "main"]

_CHUNK_ROWS = 1 << 18


def _progress(total_bytes: int, label: str, enabled: bool) -> tuple[Callable[[int], None], Callable[[], None]]:
    if not enabled:
        return (lambda n: None), (lambda: None)
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                        TransferSpeedColumn(), TimeRemainingColumn(), transient=False)
    progress.start()
    task = progress.add_task(label, total=total_bytes)
    return (lambda n: progress.advance(task, n)), progress.stop


def write_table(path: Path, rows: int, dim: int, chunks: Iterator[np.ndarray], *, precision: str = "fp32",
                packed_only: bool = False, advance: Callable[[int], None] = lambda n: None) -> None:
    """Write fp32 ``chunks`` (rows in order, ``rows`` in all) to ``path`` and, for another precision,
    its row-wise quantized copy to ``path.parent / precision / path.name``. Atomic per file.

    ``packed_only`` (int8/int4): write only the packed rows, as ``path`` itself (uint8 rows; the
    host stage serves them as they are): a table set whose fp32 form would not fit on the disk.
    """
    from sixfold.backends.host.host_embedding import bytes_per_row

    if packed_only and precision not in ("int8", "int4"):
        raise ValueError(f"packed_only needs int8 or int4 rows, not {precision}")
    outputs: list[_NpyWriter] = []
    if not packed_only:
        outputs.append(_NpyWriter(path, np.float32, (rows, dim), lambda c: c))
    if precision != "fp32":
        width = dim if precision == "fp16" else bytes_per_row(precision, dim)
        qpath = path if packed_only else path.parent / precision / path.name
        outputs.append(_NpyWriter(qpath, np.float16 if precision == "fp16" else np.uint8, (rows, width),
                                  lambda c: _quantize(c, precision)))
    try:
        start = 0
        for chunk in chunks:
            for w in outputs:
                w.write(chunk)
            start += chunk.shape[0]
            advance(chunk.shape[0] * dim * 4)
        if start != rows:
            raise ValueError(f"{path}: {start} rows written, {rows} expected")
        for w in outputs:
            w.commit()  # the host stage reads a quantized copy as it is when plan.json's checksums list it
    finally:
        for w in outputs:
            w.abort()


class _NpyWriter:
    """A .npy file written front to back with plain writes (never mapped: written pages are dropped
    from the page cache every 64 MiB, so writing a 5 GB table costs no 5 GB of RSS or cache)."""

    def __init__(self, path: Path, dtype: Any, shape: tuple[int, int], convert: Callable[[np.ndarray], np.ndarray]):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.convert = path, convert
        self.tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        self.file = open(self.tmp, "wb")
        np.lib.format.write_array_header_1_0(self.file, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                                         "fortran_order": False, "shape": shape})
        self.dtype = np.dtype(dtype)
        self.pending = 0
        self.written = self.file.tell()
        self.total = self.written + shape[0] * shape[1] * self.dtype.itemsize
        try:  # NOTE: the whole file first: a full disk fails here, naming the bytes, not half-way
            os.posix_fallocate(self.file.fileno(), 0, self.total)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self.abort()
                raise self._error(exc) from None

    def _error(self, exc: OSError) -> OSError:
        return OSError(exc.errno, f"writing {str(self.path)!r}: {exc.strerror or exc} ({self.total} bytes needed, "
                                  f"{self.written} written)")

    def write(self, chunk: np.ndarray) -> None:
        data = np.ascontiguousarray(self.convert(chunk), dtype=self.dtype)
        try:
            self.file.write(memoryview(data).cast("B"))
            self.written += data.nbytes
            self.pending += data.nbytes
            if self.pending >= 64 << 20:
                self._drop()
        except OSError as exc:
            raise self._error(exc) from None

    def _drop(self) -> None:
        self.file.flush()
        fd = self.file.fileno()
        os.fdatasync(fd)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):
            pass
        self.pending = 0

    def commit(self) -> None:
        try:
            self._drop()
            self.file.close()
        except OSError as exc:
            raise self._error(exc) from None
        os.replace(self.tmp, self.path)  # atomic: a reader sees no half-written table

    def abort(self) -> None:
        if not self.file.closed:
            self.file.close()
            self.tmp.unlink(missing_ok=True)


def _quantize(chunk: np.ndarray, precision: str) -> np.ndarray:
    import torch

    if precision == "fp16":
        return chunk.astype(np.float16)
    op = (torch.ops.quantized.embedding_bag_byte_prepack if precision == "int8"
          else torch.ops.quantized.embedding_bag_4bit_prepack)
    return op(torch.from_numpy(np.ascontiguousarray(chunk, np.float32))).numpy()


def _uniform_chunks(rows: int, dim: int, seed: int, table: int) -> Iterator[np.ndarray]:
    rng = np.random.default_rng([seed, table])
    bound = math.sqrt(1.0 / rows)
    for lo in range(0, rows, _CHUNK_ROWS):
        n = min(_CHUNK_ROWS, rows - lo)
        chunk = rng.random((n, dim), dtype=np.float32)
        chunk *= 2 * bound
        chunk -= bound
        yield chunk


def build_streamed(name: str, out: str | Path, *, seed: int = 0, cards: int = 6, card_spec: str = "m2-card",
                   host_spec: str = "host-cpu", precision: str = "fp32", max_rows: int | None = None,
                   packed_only: bool = False, progress: bool = True) -> Path:
    """Partition built-in ``name`` with tables at full size (or ``max_rows``) written in chunks; returns plan.json.

    ``packed_only``: int8/int4 tables written packed only, no fp32 copy (dlrm-mlperf int8: 25 GB, not 96).
    """
    from sixfold import models

    from sixfold.partitioner.artifacts import write_artifacts
    from sixfold.partitioner.tables.checksums import table_checksums
    from sixfold.partitioner.compile import partition_builtin
    from sixfold.partitioner.partitioned import HOST_PARTITION

    from sixfold.partitioner.tables.staging import staged

    out = Path(out)
    config = models.get_config(name, max_rows=max_rows)
    small = min(1000, *config.table_rows)
    _, partitioned = partition_builtin(name, max_rows=small, seed=seed, cards=cards, card_spec=card_spec,
                                       host_spec=host_spec, table_precision=precision)
    with staged(out) as folder:  # the version appears whole when every table is written, or not at all
        write_artifacts(partitioned, folder)
        tables = folder / "tables"
        for p in tables.glob("**/table_*.npy"):
            p.unlink()
        rows, dim = list(config.table_rows), config.embedding_dim
        advance, stop = _progress(sum(rows) * dim * 4, f"{name}: {len(rows)} tables", progress)
        try:
            for t, r in enumerate(rows):
                write_table(tables / f"table_{t:03d}.npy", r, dim, _uniform_chunks(r, dim, seed, t),
                            precision=precision, packed_only=packed_only, advance=advance)
        finally:
            stop()
        _finish_plan(folder, rows, dim, precision, table_checksums(tables), HOST_PARTITION)
    return out / "plan.json"


def _finish_plan(out: Path, rows: list[int], dim: int, precision: str, checksums: dict[str, str],
                 host_partition: str) -> Path:
    from sixfold.backends.host.host_embedding import bytes_per_row

    from sixfold.partitioner.plan import PartitionPlan

    path = out / "plan.json"
    plan = PartitionPlan.load(path)
    plan.tables.update(rows=rows, dim=dim, checksums=checksums)
    info = plan.partition(host_partition)
    info.param_bytes = sum(rows) * bytes_per_row(precision, dim)
    plan.save(path)
    return path


def _natural(key: str) -> list[Any]:
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", key)]


def import_tables(source: str | Path, version_dir: str | Path, *, keys: Sequence[str] | None = None,
                  precision: str = "fp32", progress: bool = True) -> list[tuple[str, tuple[int, int]]]:
    """Copy a user's tables into ``version_dir/tables`` (chunked) and record checksums in its plan.json.

    ``source``: a ``torch.save``d state dict (every 2-D floating tensor whose key ends in
    ``weight`` is a table, in natural key order, unless ``keys`` names them in order) or a
    folder of ``.npy`` files (natural name order). Returns (key, shape) per table written.

    Whole or not at all, like ``tables build``: the version is rewritten in a temporary sibling
    (its other files hard-linked, plan.json copied) renamed into place, so a failure (a damaged
    source file, named; a full disk) leaves the folder as it was; a crashed import's temporary is
    removed by the next write into the same parent.
    """
    from sixfold.partitioner.tables.checksums import table_checksums

    source, version_dir = Path(source), Path(version_dir)
    arrays: list[tuple[str, Any]] = []
    if source.is_dir():
        files = sorted(source.glob("*.npy"), key=lambda p: _natural(p.name))
        arrays = [(p.name, _load_npy(p)) for p in files if keys is None or p.name in keys]
    else:
        import torch
        try:
            state = torch.load(source, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a damaged file: name it
            raise ValueError(f"{source}: not a readable torch.save state dict: {type(exc).__name__}: {exc}") from None
        if hasattr(state, "state_dict"):
            state = state.state_dict()
        chosen = list(keys) if keys else sorted(
            (k for k, v in state.items() if isinstance(v, torch.Tensor) and v.ndim == 2
             and v.is_floating_point() and k.endswith("weight")), key=_natural)
        missing = [k for k in chosen if k not in state]
        if missing:
            raise KeyError(f"{source}: no tensors {missing}; it has {sorted(state)[:10]}...")
        arrays = [(k, state[k]) for k in chosen]
    if not arrays:
        raise ValueError(f"{source}: no embedding tables found (2-D float '*weight' tensors or .npy files)")
    flat = [k for k, a in arrays if len(a.shape) != 2]
    if flat:
        raise ValueError(f"{source}: {flat[0]} is not a 2-D table (shape {tuple(dict(arrays)[flat[0]].shape)})")
    dims = {a.shape[1] for _, a in arrays}
    if len(dims) != 1:
        raise ValueError(f"{source}: tables differ in dim {sorted(dims)}; the host stage needs one dim")
    dim = dims.pop()
    advance, stop = _progress(sum(a.shape[0] for _, a in arrays) * dim * 4, f"importing {len(arrays)} tables",
                              progress)

    def chunks(name: str, a: Any) -> Iterator[np.ndarray]:
        for lo in range(0, a.shape[0], _CHUNK_ROWS):
            try:
                part = a[lo:lo + _CHUNK_ROWS]
                part = part.float().numpy() if hasattr(part, "numpy") and not isinstance(part, np.ndarray) else part
                part = np.ascontiguousarray(part, dtype=np.float32)
            except (OSError, ValueError, RuntimeError) as exc:  # e.g. a file cut short under its memory map
                raise ValueError(f"{source}: table {name!r}, rows {lo}..: could not be read: {exc}") from None
            yield part

    from sixfold.partitioner.tables.staging import carry_over, staged

    # NOTE: the version appears whole or not at all: its other files are linked into a temporary folder,
    # the tables written there, and one rename publishes it; a failure removes the temporary
    with staged(version_dir) as folder:
        carry_over(version_dir, folder, skip=_replaced_by_import, copy=lambda rel: rel == Path("plan.json"))
        tables = folder / "tables"
        tables.mkdir(exist_ok=True)
        try:
            for t, (name, a) in enumerate(arrays):
                write_table(tables / f"table_{t:03d}.npy", int(a.shape[0]), dim, chunks(name, a), precision=precision,
                            advance=advance)
        finally:
            stop()
        rows = [int(a.shape[0]) for _, a in arrays]
        if (folder / "plan.json").exists():
            from sixfold.partitioner.partitioned import HOST_PARTITION
            _finish_plan(folder, rows, dim, precision, table_checksums(tables), HOST_PARTITION)
    return [(k, (int(a.shape[0]), dim)) for k, a in arrays]


def _load_npy(path: Path) -> np.ndarray:
    """``path`` mapped (no copy), or a ValueError naming it (a damaged or cut-short file)."""
    try:
        return np.load(path, mmap_mode="r")
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{path}: not a readable .npy table: {exc}") from None


def _replaced_by_import(relative: Path) -> bool:
    """The files of a version an import writes anew: every table (and its quantized copies) under tables/."""
    return relative.parts[:1] == ("tables",) and relative.name.startswith("table_") and relative.suffix == ".npy"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sixfold-partition tables", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="partition a built-in model with its tables written in chunks")
    b.add_argument("model")
    b.add_argument("--out", required=True, help="version folder, e.g. repo/rm2/1")
    b.add_argument("--max-rows", type=int, default=None, help="cap every table at R rows (default: full size)")
    b.add_argument("--table-precision", default="fp32", choices=["fp32", "fp16", "int8", "int4"])
    b.add_argument("--packed-only", action="store_true",
                   help="int8/int4: write only the packed rows (no fp32 copy on disk)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--cards", type=int, default=6)
    b.add_argument("--card-spec", default="m2-card")
    b.add_argument("--host-spec", default="host-cpu")
    i = sub.add_parser("import", help="copy a user's tables (state dict or .npy folder) into a version folder")
    i.add_argument("source")
    i.add_argument("--out", required=True, help="version folder (its plan.json gets the checksums)")
    i.add_argument("--keys", default=None, help="comma-separated state-dict keys, in table order")
    i.add_argument("--table-precision", default="fp32", choices=["fp32", "fp16", "int8", "int4"])
    args = p.parse_args(argv)
    if args.command == "build":
        path = build_streamed(args.model, args.out, seed=args.seed, cards=args.cards, card_spec=args.card_spec,
                              host_spec=args.host_spec, precision=args.table_precision, max_rows=args.max_rows,
                              packed_only=args.packed_only)
        print(f"wrote {path}")
    else:
        done = import_tables(args.source, args.out, keys=args.keys.split(",") if args.keys else None,
                             precision=args.table_precision)
        for t, (key, shape) in enumerate(done):
            print(f"table_{t:03d}.npy  <- {key}  {shape[0]} x {shape[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
