"""Embedding tables split between the host and simulated cards (``--sparse-on-cards``).

``ShardedEmbeddingStage`` is the host stage of a plan whose tables are
sharded (``sixfold.partitioner.placement.sharding``): same inputs (``sparse_lengths`` [N, T]
int32, sample-major ``sparse_indices`` int64) and the same output as
``HostEmbeddingStage`` ([N * T, dim] float32, bag order: sample 0 table 0,
sample 0 table 1, ...), so the dense part cannot tell the difference.

Per batch it routes every id to where its row lives:

* tables left on the host go to a ``HostEmbeddingStage`` (any precision);
* each card gets one jagged request for its blocks (``shard_lengths`` [N, S]
  for its S blocks, ``shard_ids`` local to each block) and returns
  ``shard_pooled`` [N, sum of block widths];
* the host writes each block's columns into the output, adding row-wise
  partial sums and placing column slices side by side.

The cards are ``simcard`` cards: each card's lookups are computed here with
numpy, and the card is occupied for the time its ``DeviceSpec`` gives (ids
and lengths in over the link, rows x (row bytes + id) gathered at memory
bandwidth, pooled block out), with simcard's FIFO timeline, lag accounting
and fault injection. A block is read only where looked up, so a card's
artifact declares no per-batch weight bytes; the blocks' memory is checked
here, against what the card has left beside its dense work.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sixfold.backends.api import Arrays, Backend, BackendError, CardRef, DoesNotFit, Executable, PartitionArtifact
from sixfold.backends.host.host_embedding import HostEmbeddingStage, bytes_per_row
from sixfold.backends.memory import format_bytes
from sixfold.backends.builtin.simcard import SimCardBackend, SimCardExecutable, SimCardStats
from sixfold.backends.spec import DeviceSpec

__all__ = ["ShardedEmbeddingStage", "Block", "load_sharded_stage", "shard_card_ref", "CARD_PRECISIONS", "HOST"]

HOST = "host"
CARD_PRECISIONS = ("fp32", "fp16")
"""Precisions card blocks are held in (row-wise quantized blocks are future work)."""
_SHARD_IDS, _SHARD_LENGTHS, _SHARD_POOLED = "shard_ids", "shard_lengths", "shard_pooled"
_ID_BYTES = 8


@dataclass(frozen=True)
class Block:
    """Rows ``row_start:row_end`` x columns ``col_start:col_end`` of table ``table`` on ``device``."""

    table: int
    device: str
    row_start: int
    row_end: int
    col_start: int
    col_end: int

    @property
    def width(self) -> int:
        return self.col_end - self.col_start

    @classmethod
    def of(cls, shard: Any) -> "Block":
        """From anything with the fields (a plan's ``TableShard``, a dict)."""
        get = shard.get if isinstance(shard, Mapping) else lambda k: getattr(shard, k)
        return cls(int(get("table")), str(get("device")), int(get("row_start")), int(get("row_end")),
                   int(get("col_start")), int(get("col_end")))


# ---- one card's lookups (the functional backend behind simcard) ----------------------------------


class _CardLookup(Executable):
    """A card's blocks in one weight per block width; pools a jagged request over them.

    The pooling kernel is torch's ``embedding_bag``, the host stage's own: on
    rm1-like batches it is ~5x faster here than numpy's ``add.reduceat``, so
    the host lags the card it simulates less.
    """

    def __init__(self, artifact: PartitionArtifact, device: DeviceSpec) -> None:
        import torch

        super().__init__(artifact, device)
        blocks: list[np.ndarray] = artifact.payload
        dtype = np.float16 if artifact.dtype == "fp16" else np.float32
        self.widths = [b.shape[1] for b in blocks]
        self.out_offsets = np.concatenate([[0], np.cumsum(self.widths)]).astype(np.int64)
        # Blocks of one width share a weight: one gather for all of them (TBE style).
        self.groups: list[tuple[Any, list[int], np.ndarray]] = []
        self.group_of = np.zeros(len(self.widths), np.int64)
        for g, width in enumerate(sorted(set(self.widths))):
            members = [s for s, w in enumerate(self.widths) if w == width]
            weight = np.concatenate([np.asarray(blocks[s], dtype=dtype) for s in members])
            starts = np.zeros(len(self.widths), np.int64)
            starts[members] = np.concatenate([[0], np.cumsum([blocks[s].shape[0] for s in members])[:-1]])
            self.group_of[members] = g
            self.groups.append((torch.from_numpy(weight), members, starts))
        self.nbytes = sum(int(w.numel() * w.element_size()) for w, _, _ in self.groups)

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        import torch
        from torch.nn import functional as F

        ids = np.asarray(inputs[_SHARD_IDS], np.int64)
        lengths = np.asarray(inputs[_SHARD_LENGTHS]).astype(np.int64)
        n, s_count = lengths.shape
        block = np.repeat(np.tile(np.arange(s_count, dtype=np.int64), n), lengths.reshape(-1))
        out = np.empty((n, int(self.out_offsets[-1])), np.float32)
        for weight, members, starts in self.groups:
            if len(self.groups) == 1:
                g_ids, g_block, g_len = ids, block, lengths
            else:
                keep = self.group_of[block] == self.group_of[members[0]]
                g_ids, g_block, g_len = ids[keep], block[keep], lengths[:, members]
            flat = g_len.reshape(-1)
            offsets = np.cumsum(flat) - flat
            with torch.inference_mode():
                pooled = F.embedding_bag(torch.from_numpy(g_ids + starts[g_block]), weight,
                                         torch.from_numpy(offsets), mode="sum").float().numpy()
            pooled = pooled.reshape(n, len(members), weight.shape[1])
            for j, s in enumerate(members):
                out[:, self.out_offsets[s]:self.out_offsets[s + 1]] = pooled[:, j]
        return {_SHARD_POOLED: out}

    def memory_bytes(self) -> int:
        return self.nbytes


class _CardLookupBackend(Backend):
    """The functional backend simcard runs card blocks on (format "table-blocks")."""

    name = "table-blocks"
    formats = ("table-blocks",)

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> _CardLookup:
        return _CardLookup(artifact, device)


# ---- the stage -----------------------------------------------------------------------------------


@dataclass
class _Routed:
    """One batch split by destination."""

    n: int
    host: tuple[np.ndarray, np.ndarray] | None
    cards: dict[str, dict[str, np.ndarray]]


class ShardedEmbeddingStage(Executable):
    """Pooled embedding bags over tables on the host and blocks on simulated cards. See the module docstring.

    ``tables``: every table as a 2-D fp32 array (same dim). ``blocks``: where
    each part lives (``Block`` or a plan's ``TableShard``s; a table with no
    block, or with device "host", stays on the host). ``card_free_bytes``:
    memory each card has for blocks (default: all of it); DoesNotFit beyond.
    ``clock``/``sleep`` drive the cards' modelled time (tests pass fakes).
    """

    def __init__(self, tables: Sequence[np.ndarray], blocks: Sequence[Any], host_spec: DeviceSpec,
                 card_specs: Mapping[str, DeviceSpec], *, precision: str = "fp32",
                 card_precision: str | None = None, input_names: tuple[str, str] = ("sparse_lengths", "sparse_indices"),
                 output_name: str = "host_embedding_bag", card_free_bytes: Mapping[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, name: str = "sparse") -> None:
        arrays = [np.asarray(t) for t in tables]
        if not arrays:
            raise ValueError("no tables")
        dims = {a.shape[1] if a.ndim == 2 else -1 for a in arrays}
        if len(dims) != 1 or -1 in dims:
            raise ValueError(f"tables must be 2-D with one dim; got shapes {sorted({a.shape for a in arrays})}")
        self.dim = dims.pop()
        self.table_rows = tuple(int(a.shape[0]) for a in arrays)
        card_precision = card_precision or precision
        placed = [Block.of(b) for b in blocks]
        self.blocks = [b for b in placed if b.device != HOST]
        if self.blocks and card_precision not in CARD_PRECISIONS:
            raise ValueError(f"card blocks are held in {' or '.join(CARD_PRECISIONS)}; asked for {card_precision}")
        _check_tiling(self.blocks, self.table_rows, self.dim)
        on_cards = sorted({b.table for b in self.blocks})
        self.host_tables = [t for t in range(len(arrays)) if t not in set(on_cards)]
        missing = sorted({b.device for b in self.blocks} - set(card_specs))
        if missing:
            raise ValueError(f"blocks are placed on {missing}, which have no device spec "
                             f"(have {sorted(card_specs)})")

        host_bytes = sum(self.table_rows[t] * bytes_per_row(precision, self.dim) for t in self.host_tables)
        artifact = PartitionArtifact(name=name, format="sharded-tables", payload=None, input_names=input_names,
                                     output_names=(output_name,), param_bytes=host_bytes,
                                     metadata={"precision": precision, "card_precision": card_precision})
        super().__init__(artifact, host_spec)
        self.host_stage = (HostEmbeddingStage([arrays[t] for t in self.host_tables], precision)
                           if self.host_tables else None)

        # Card side: each card's blocks in (table, row, col) order, loaded on a simulated card.
        self._sim = SimCardBackend(functional=_CardLookupBackend(), clock=clock, sleep=sleep)
        self.cards: dict[str, SimCardExecutable] = {}
        self.card_blocks: dict[str, list[Block]] = {}
        for device in sorted({b.device for b in self.blocks}, key=_device_order):
            mine = sorted((b for b in self.blocks if b.device == device),
                          key=lambda b: (b.table, b.row_start, b.col_start))
            self.card_blocks[device] = mine
            spec = card_specs[device]
            nbytes = sum((b.row_end - b.row_start) * bytes_per_row(card_precision, b.width) for b in mine)
            free = spec.memory_bytes if card_free_bytes is None else int(card_free_bytes.get(device, 0))
            if nbytes > free:
                self.close()
                raise DoesNotFit(f"table blocks for {device} need {format_bytes(nbytes)}; device {spec.name} has "
                                 f"{format_bytes(max(free, 0))} free for them ({format_bytes(spec.memory_bytes)} total)")
            widths = {b.width for b in mine}
            card_artifact = PartitionArtifact(
                name=f"{name}@{device}", format="table-blocks",
                payload=[arrays[b.table][b.row_start:b.row_end, b.col_start:b.col_end] for b in mine],
                input_names=(_SHARD_IDS, _SHARD_LENGTHS), output_names=(_SHARD_POOLED,),
                # Rows are the ids sent (simcard counts the first input): one add per value, row + id read.
                param_bytes=0, flops_per_item=float(max(widths)),
                bytes_per_item=float(bytes_per_row(card_precision, max(widths)) + _ID_BYTES),
                dtype=card_precision, metadata={"blocks": len(mine), "bytes": nbytes},
                card=shard_card_ref(device, spec))
            self.cards[device] = self._sim.load(card_artifact, spec)
        self._card_bytes = {d: int(c.inner.memory_bytes()) for d, c in self.cards.items()}
        self._prepare_routing()

    # ---- routing tables --------------------------------------------------------------------------

    def _prepare_routing(self) -> None:
        """Cut every table's rows into segments (a segment's rows go to the same blocks)."""
        t_count = len(self.table_rows)
        self._table_start = np.concatenate([[0], np.cumsum(self.table_rows)[:-1]]).astype(np.int64)
        self._rows_arr = np.asarray(self.table_rows, np.int64)
        self._min_rows = min(self.table_rows)
        seg_starts: list[int] = []
        seg_blocks: list[list[tuple[str, int]]] = []  # per segment: (card, block index on that card)
        for t in range(t_count):
            cuts = sorted({0, *(b.row_start for b in self.blocks if b.table == t)})
            for lo in cuts:
                seg_starts.append(int(self._table_start[t]) + lo)
                seg_blocks.append([(d, i) for d, mine in self.card_blocks.items()
                                   for i, b in enumerate(mine) if b.table == t and b.row_start <= lo < b.row_end])
        self._seg_starts = np.asarray(seg_starts, np.int64)
        self._cut = len(seg_starts) > t_count  # some table has row ranges: segments need a search
        self._table_seg = np.arange(t_count, dtype=np.int64)  # used when no table is cut: segment = table
        n_seg, width = len(seg_starts), max((len(b) for b in seg_blocks), default=0)
        self._card_ids = list(self.card_blocks)
        index = {d: k for k, d in enumerate(self._card_ids)}
        # Per segment, its destinations: card index, block index on that card, the block's first row.
        self._seg_ndest = np.asarray([len(b) for b in seg_blocks], np.int64)
        self._seg_host = self._seg_ndest == 0
        self._seg_dest = np.zeros((n_seg, max(width, 1)), np.int16)
        self._seg_local = np.zeros((n_seg, max(width, 1)), np.int64)
        self._seg_row0 = np.zeros((n_seg, max(width, 1)), np.int64)
        for seg, blocks in enumerate(seg_blocks):
            for j, (d, i) in enumerate(blocks):
                self._seg_dest[seg, j], self._seg_local[seg, j] = index[d], i
                self._seg_row0[seg, j] = self.card_blocks[d][i].row_start

    # ---- introspection ---------------------------------------------------------------------------

    @property
    def num_tables(self) -> int:
        return len(self.table_rows)

    def memory_bytes(self) -> int:
        """Host bytes: the tables left on the host."""
        return self.host_stage.nbytes if self.host_stage is not None else 0

    def card_memory_bytes(self) -> dict[str, int]:
        """Card id -> bytes of table blocks it holds."""
        return dict(self._card_bytes)

    def card_stats(self) -> dict[str, SimCardStats]:
        return {d: c.stats() for d, c in self.cards.items()}

    def __repr__(self) -> str:
        return (f"ShardedEmbeddingStage({self.num_tables} tables, dim {self.dim}: {len(self.host_tables)} on the host, "
                f"{len(self.blocks)} blocks on {len(self.cards)} cards)")

    # ---- compute ---------------------------------------------------------------------------------

    def _route(self, inputs: Mapping[str, np.ndarray]) -> _Routed:
        """Validate the batch and split it into the host's request and one request per card."""
        try:
            lengths, ids = (np.asarray(inputs[n]) for n in self.input_names)
        except KeyError as exc:
            raise BackendError(f"partition {self.artifact.name}: missing input {exc.args[0]!r}; "
                               f"got {', '.join(sorted(inputs)) or 'none'}") from None
        t_count = self.num_tables
        if lengths.ndim != 2 or lengths.shape[1] != t_count:
            raise BackendError(f"sparse_lengths must be [N, {t_count}], got {list(lengths.shape)}")
        if ids.ndim != 1:
            raise BackendError(f"sparse_indices must be 1-D, got shape {list(ids.shape)}")
        n = lengths.shape[0]
        flat = lengths.reshape(-1).astype(np.int64)
        if n and flat.min() < 0:
            raise BackendError("sparse_lengths has negative entries")
        if int(flat.sum()) != ids.shape[0]:
            raise BackendError(f"sparse_lengths sum to {int(flat.sum())} but sparse_indices has {ids.shape[0]} ids")
        ids = ids.astype(np.int64, copy=False)
        table = np.repeat(np.tile(np.arange(t_count, dtype=np.int64), n), flat)
        if ids.shape[0]:
            self._check_ids(ids, table, flat)
        if not self.cards:
            return _Routed(n, (lengths, ids), {})
        sample = np.repeat(np.arange(n, dtype=np.int64), flat.reshape(n, t_count).sum(axis=1))
        if self._cut:
            seg = np.searchsorted(self._seg_starts, self._table_start[table] + ids, side="right") - 1
        else:
            seg = self._table_seg[table]
        host = None
        if self.host_stage is not None:
            keep = self._seg_host[seg]
            host = (np.ascontiguousarray(lengths[:, self.host_tables]), ids[keep])
        # One entry per (id, destination): a column-sliced table's ids go to each of its cards.
        # Flattened (segment, j) slots: slot = segment * width + j; one destination per slot.
        width = self._seg_dest.shape[1]
        if width == 1:
            entry = np.flatnonzero(~self._seg_host[seg]) if self.host_stage is not None else None
            slot = seg[entry] if entry is not None else seg
        else:
            ndest = self._seg_ndest[seg]
            entry = np.repeat(np.arange(ids.shape[0], dtype=np.int64), ndest)
            j = np.arange(entry.shape[0], dtype=np.int64) - np.repeat(np.cumsum(ndest) - ndest, ndest)
            slot = seg[entry] * width + j
        dest = self._seg_dest.reshape(-1)[slot]
        order = np.argsort(dest, kind="stable")  # radix sort on int16: keeps each card's ids in bag order
        slot = slot[order]
        entry = order if entry is None else entry[order]
        bounds = np.searchsorted(dest[order], np.arange(len(self._card_ids) + 1))
        local_of, row0_of = self._seg_local.reshape(-1), self._seg_row0.reshape(-1)
        cards: dict[str, dict[str, np.ndarray]] = {}
        for k, d in enumerate(self._card_ids):
            sl = slice(bounds[k], bounds[k + 1])
            c_entry, c_slot = entry[sl], slot[sl]
            s_count = len(self.card_blocks[d])
            key = sample[c_entry] * s_count + local_of[c_slot]
            c_ids = ids[c_entry] - row0_of[c_slot] if self._cut else ids[c_entry]
            if key.shape[0] > 1 and np.any(key[1:] < key[:-1]):
                # Two row ranges of one table on this card: their ids interleave within a bag.
                resort = np.argsort(key, kind="stable")
                key, c_ids = key[resort], c_ids[resort]
            c_lengths = np.bincount(key, minlength=n * s_count).astype(np.int32).reshape(n, s_count)
            cards[d] = {_SHARD_IDS: c_ids, _SHARD_LENGTHS: c_lengths}
        return _Routed(n, host, cards)

    def _check_ids(self, ids: np.ndarray, table: np.ndarray, flat: np.ndarray) -> None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo >= 0 and hi < self._min_rows:
            return
        bad = (ids < 0) | (ids >= self._rows_arr[table])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            bag = int(np.searchsorted(np.cumsum(flat), k, side="right"))
            sample, t = divmod(bag, self.num_tables)
            raise BackendError(f"sparse_indices[{k}] = {int(ids[k])} is out of range for table {t} "
                               f"({self.table_rows[t]} rows; sample {sample})")

    def _run_host(self, routed: _Routed) -> np.ndarray | None:
        if routed.host is None or self.host_stage is None:
            return None
        try:
            return self.host_stage.run_numpy(*routed.host)
        except (ValueError, IndexError) as exc:
            raise BackendError(f"partition {self.artifact.name}: {exc}") from exc

    def _combine(self, routed: _Routed, host_out: np.ndarray | None, card_out: Mapping[str, Arrays]) -> Arrays:
        n, t_count = routed.n, self.num_tables
        if not self.cards and host_out is not None:
            return {self.output_names[0]: host_out}
        out = np.zeros((n, t_count, self.dim), np.float32)
        if host_out is not None:
            out[:, self.host_tables, :] = host_out.reshape(n, len(self.host_tables), self.dim)
        for d, blocks in self.card_blocks.items():
            pooled = card_out[d][_SHARD_POOLED]
            at = 0
            for b in blocks:
                out[:, b.table, b.col_start:b.col_end] += pooled[:, at:at + b.width]
                at += b.width
        return {self.output_names[0]: out.reshape(n * t_count, self.dim)}

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """The outputs alone, blocking and untimed (the cards' functional results)."""
        routed = self._route(inputs)
        host_out = self._run_host(routed)
        card_out = {d: c.run(routed.cards[d]) for d, c in self.cards.items()}
        return self._combine(routed, host_out, card_out)

    async def infer(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """Route on this stage's thread, then the host part and every card's part at once; combine."""
        loop = asyncio.get_running_loop()
        routed = await loop.run_in_executor(self._worker(), self._route, inputs)
        cards = list(self.cards)
        parts = await asyncio.gather(loop.run_in_executor(self._worker(), self._run_host, routed),
                                     *(self.cards[d].infer(routed.cards[d]) for d in cards))
        card_out = dict(zip(cards, parts[1:]))
        return await loop.run_in_executor(self._worker(), self._combine, routed, parts[0], card_out)

    def close(self) -> None:
        for card in getattr(self, "cards", {}).values():
            card.close()
        super().close()


def _device_order(device: str) -> tuple[int, str]:
    digits = "".join(ch for ch in device if ch.isdigit())
    return (int(digits) if digits else -1, device)


def _check_tiling(blocks: Sequence[Block], rows: tuple[int, ...], dim: int) -> None:
    """Each table on cards must be covered exactly once: row ranges over all columns, or column slices over all rows."""
    by_table: dict[int, list[Block]] = {}
    for b in blocks:
        if not 0 <= b.table < len(rows):
            raise ValueError(f"a block names table {b.table}; there are {len(rows)} tables")
        by_table.setdefault(b.table, []).append(b)
    for t, mine in by_table.items():
        whole_rows = all(b.row_start == 0 and b.row_end == rows[t] for b in mine)
        whole_cols = all(b.col_start == 0 and b.col_end == dim for b in mine)
        if whole_cols:
            spans, limit, what = sorted((b.row_start, b.row_end) for b in mine), rows[t], "rows"
        elif whole_rows:
            spans, limit, what = sorted((b.col_start, b.col_end) for b in mine), dim, "columns"
        else:
            raise ValueError(f"table {t}: blocks must be row ranges over all {dim} columns or column slices "
                             f"over all {rows[t]} rows; got {[(b.row_start, b.row_end, b.col_start, b.col_end) for b in mine]}")
        at = 0
        for lo, hi in spans:
            if lo != at or hi <= lo:
                raise ValueError(f"table {t}: blocks must cover {what} 0:{limit} once each, in order; "
                                 f"got {spans}")
            at = hi
        if at != limit:
            raise ValueError(f"table {t}: blocks cover {what} 0:{at} of 0:{limit}")
        if whole_rows and not whole_cols:
            cards = [b.device for b in mine]
            if len(set(cards)) != len(cards):
                raise ValueError(f"table {t}: two column slices on one card ({cards}); merge them into one")


def shard_card_ref(device_id: str, spec: DeviceSpec) -> CardRef | None:
    """The physical card a shard's load is for (Backend API 1.3): plan device ``cardK`` on spec ``SPEC/cardK``.

    None for a device id that is not ``cardK`` (a tool's own naming): such a load is for no one card.
    """
    index = device_id.removeprefix("card")
    base = spec.name.split("/", 1)[0]
    return CardRef(int(index), base) if device_id.startswith("card") and index.isdigit() and base else None


def load_sharded_stage(plan: Any, tables_arrays: Sequence[np.ndarray], host_spec: DeviceSpec,
                       card_specs: Mapping[str, DeviceSpec], *, card_free_bytes: Mapping[str, int] | None = None,
                       clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> ShardedEmbeddingStage:
    """The host stage of ``plan`` (a ``PartitionPlan`` with ``shards``), ready to serve.

    ``card_specs``: plan card id -> the spec to simulate it with (the loader's
    per-card copy). ``card_free_bytes`` defaults to each card's memory less
    the weights of the partitions placed on it.
    """
    sparse = next((p for p in plan.partitions if p.kind == "sparse"), None)
    if sparse is None:
        raise ValueError(f"plan {plan.model} has no sparse partition; it has {[p.name for p in plan.partitions]}")
    if len(sparse.inputs) != 2 or len(sparse.outputs) != 1:
        raise ValueError(f"partition {sparse.name}: expected inputs (sparse_lengths, sparse_indices) and one output; "
                         f"got {[i.name for i in sparse.inputs]} -> {[o.name for o in sparse.outputs]}")
    rows = list(plan.tables.get("rows") or [])
    shapes = [tuple(np.shape(a)) for a in tables_arrays]
    if rows and [s[0] for s in shapes] != rows:
        raise ValueError(f"tables have rows {[s[0] for s in shapes]}; the plan says {rows}")
    if card_free_bytes is None:
        card_free_bytes = {}
        for device_id, spec in card_specs.items():
            held = sum(plan.partition(p.partition).param_bytes for p in plan.placements if p.device == device_id)
            card_free_bytes[device_id] = spec.memory_bytes - held
    precision = plan.tables.get("precision", "fp32")
    return ShardedEmbeddingStage(
        tables_arrays, list(plan.shards), host_spec, card_specs, precision=precision,
        input_names=(sparse.inputs[0].name, sparse.inputs[1].name), output_name=sparse.outputs[0].name,
        card_free_bytes=card_free_bytes, clock=clock, sleep=sleep, name=sparse.name)
