"""The whole run, decided before the clock starts: when each request goes and which query it carries.

Query sizes are drawn per request from the exact distribution; the payloads
come from a pool holding a few distinct pre-generated queries of each size
that occurs. So the sizes sent follow the distribution exactly, while request
generation (and encoding) never runs during the measured run.

Popular ids can drift (``drift``: the hot set rotates by that fraction of each
table per second). Shifting ids at send time would mean re-encoding every
request, so instead the run is cut into time slices (at most ``MAX_DRIFT_SLICES``,
each at least 1 s) and the pool is built once per slice with every id shifted
by the slice's offset, (id + floor(drift * rows * t)) mod rows; a request
carries a query of its own slice. Sending stays one pre-encoded payload.

The pool is a pure function of a ``PoolRecipe`` (the generator's parameters and
random state, the sizes generated, the drift slicing), so a recording stores
the recipe instead of the tensors and ``pool_tensors`` rebuilds them bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from sixfold.models.requests import QuerySizes, RequestGenerator
from sixfold.models.signature import INDICES, LENGTHS

from sixfold.loadgen.arrivals import ArrivalProcess

__all__ = ["Schedule", "QueryPool", "PoolRecipe", "build_schedule", "pool_tensors", "pool_digest", "shift_ids",
           "drift_slices", "MAX_DRIFT_SLICES"]

MAX_DRIFT_SLICES = 32
"""The pool is built this many times at most when ids drift (memory: pool x slices queries)."""


@dataclass(frozen=True)
class PoolRecipe:
    """Everything the pool's tensors are made from: ``pool_tensors(recipe)`` rebuilds them exactly.

    The generator (``models.RequestGenerator``) is rebuilt from its parameters
    and the state its random generator had before the first query; then
    ``sizes`` queries are made in order and, with drift, repeated once per slice
    with the slice's id shift.
    """

    table_rows: tuple[int, ...]
    dense_dim: int
    pooling: tuple[int, ...]
    zipf: float | tuple[float, ...]
    rng_state: dict[str, Any]
    """``numpy.random.Generator.bit_generator.state`` before the first query (JSON-ready)."""
    sizes: tuple[int, ...]
    """Items of each base query, in generation order."""
    drift: float = 0.0
    slices: int = 1
    slice_s: float = 1.0
    fixed_pooling: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for key in ("table_rows", "pooling", "sizes"):
            data[key] = list(data[key])
        if isinstance(self.zipf, tuple):
            data["zipf"] = list(self.zipf)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PoolRecipe":
        zipf = data["zipf"]
        return cls(table_rows=tuple(int(r) for r in data["table_rows"]), dense_dim=int(data["dense_dim"]),
                   pooling=tuple(int(p) for p in data["pooling"]),
                   zipf=tuple(float(z) for z in zipf) if isinstance(zipf, (list, tuple)) else float(zipf),
                   rng_state=dict(data["rng_state"]), sizes=tuple(int(n) for n in data["sizes"]),
                   drift=float(data.get("drift", 0.0)), slices=int(data.get("slices", 1)),
                   slice_s=float(data.get("slice_s", 1.0)), fixed_pooling=bool(data.get("fixed_pooling", False)))

    def generator(self) -> RequestGenerator:
        """A RequestGenerator in the recorded state."""
        generator = RequestGenerator(self.table_rows, self.dense_dim, self.pooling, zipf=self.zipf,
                                     fixed_pooling=self.fixed_pooling)
        kind = self.rng_state.get("bit_generator")
        if kind != type(generator.rng.bit_generator).__name__:
            bit_generator = getattr(np.random, str(kind), None)
            if bit_generator is None:
                raise ValueError(f"unknown numpy bit generator {kind!r}")
            generator.rng = np.random.Generator(bit_generator())
        generator.rng.bit_generator.state = self.rng_state
        return generator


@dataclass(frozen=True)
class QueryPool:
    """Encoded queries; ``items[k]`` is the item count of ``payloads[k]``.

    ``tensors[k]`` is the query before encoding, kept only when asked (to record a run).
    ``recipe`` rebuilds the tensors (None when they were not generated here, e.g. a replayed
    recording that stored its tensors).
    """

    payloads: tuple[Any, ...]
    items: np.ndarray
    tensors: tuple[dict[str, np.ndarray], ...] | None = None
    recipe: PoolRecipe | None = None

    def __len__(self) -> int:
        return len(self.payloads)


@dataclass(frozen=True)
class Schedule:
    """Request ``i`` is due at ``offsets[i]`` seconds and carries pool entry ``query[i]``."""

    offsets: np.ndarray
    query: np.ndarray
    pool: QueryPool

    def __len__(self) -> int:
        return int(self.offsets.size)

    @property
    def items(self) -> np.ndarray:
        """Items per request."""
        return self.pool.items[self.query]


def shift_ids(request: Mapping[str, np.ndarray], table_rows: np.ndarray, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """A copy of ``request`` with table t's ids moved by ``offsets[t]`` (mod its rows): the hot set rotates."""
    lengths = request[LENGTHS]
    tables = lengths.shape[1]
    table = np.repeat(np.tile(np.arange(tables), lengths.shape[0]), lengths.reshape(-1))
    rows = table_rows[table]
    return {**request, INDICES: (request[INDICES] + offsets[table]) % rows}


def pool_tensors(recipe: PoolRecipe) -> list[dict[str, np.ndarray]]:
    """The pool's query tensors, made from ``recipe`` (the same bits each time)."""
    generator = recipe.generator()
    base = [generator.make(int(size)) for size in recipe.sizes]
    if recipe.slices <= 1:
        return base
    rows = generator.table_rows
    tensors = []
    for k in range(recipe.slices):
        shift = np.floor(recipe.drift * rows * (k * recipe.slice_s)).astype(np.int64) % rows
        tensors.extend(shift_ids(q, rows, shift) for q in base)
    return tensors


def pool_digest(tensors: Sequence[Mapping[str, np.ndarray]]) -> str:
    """SHA-256 over every query's tensors (dtype, shape and bytes), in order: the pool's identity."""
    h = hashlib.sha256()
    for query in tensors:
        for name in sorted(query):
            array = np.ascontiguousarray(query[name])
            h.update(f"{name}:{array.dtype.str}:{array.shape};".encode())
            h.update(memoryview(array).cast("B"))
    return h.hexdigest()


def drift_slices(window_s: float, drift: float) -> tuple[int, float]:
    """(slice count, slice length in s) for ids drifting at ``drift`` table fractions per second."""
    if drift <= 0:
        return 1, max(window_s, 1e-9)
    count = int(min(MAX_DRIFT_SLICES, max(1, np.ceil(window_s - 1e-9))))
    return count, window_s / count


def build_schedule(arrival: ArrivalProcess, qps: float, window_s: float, sizes: QuerySizes,
                   generator: RequestGenerator, encode: Callable[[dict[str, np.ndarray]], Any], *,
                   pool: int, rng: np.random.Generator, limit: int | None = None, drift: float = 0.0,
                   keep_tensors: bool = False) -> Schedule:
    """Draw offsets and sizes, generate and encode the pool, assign a pooled query to each request.

    ``pool`` distinct queries are spread evenly over the distinct sizes drawn,
    with at least one query per size; with ``drift`` > 0 that pool is repeated,
    ids shifted, once per time slice (see the module docstring).
    """
    offsets = arrival.offsets(qps, window_s, rng, limit)
    drawn = np.asarray(sizes.sample(rng, offsets.size), dtype=np.int64)
    distinct, which = np.unique(drawn, return_inverse=True)
    per_size = max(1, pool // max(1, distinct.size))
    base_sizes = tuple(int(size) for size in distinct for _ in range(per_size))
    variant = rng.integers(0, per_size, size=offsets.size)
    query = which.reshape(-1).astype(np.int64) * per_size + variant
    slices, slice_s = drift_slices(window_s, drift)
    zipf = generator.zipf if isinstance(generator.zipf, (int, float)) else tuple(float(z) for z in generator.zipf)
    recipe = PoolRecipe(tuple(int(r) for r in generator.table_rows), int(generator.dense_dim),
                        tuple(int(p) for p in generator.pooling), zipf, generator.rng.bit_generator.state,
                        base_sizes, float(drift), slices, float(slice_s),
                        bool(generator.fixed_pooling))
    tensors = pool_tensors(recipe)
    items = list(base_sizes) * slices
    if slices > 1:
        which_slice = np.minimum((offsets // slice_s).astype(np.int64), slices - 1)
        query = which_slice * len(base_sizes) + query
    payloads = tuple(encode(q) for q in tensors)
    return Schedule(offsets, query, QueryPool(payloads, np.asarray(items, dtype=np.int64),
                                              tuple(tensors) if keep_tensors else None, recipe))
