"""Check a decoded request against a model's signature and tables before it is queued.

Bad input must never reach a batch (it would fail every request merged with
it), so everything a lookup could trip on is checked here: names, dtypes,
shapes, batch sizes, lengths against ids, each id against its table, and (unless
the model allows them) NaN or infinite dense features, which would be scored into a
NaN click probability returned with status OK.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sixfold.models.signature import DENSE, INDICES, LENGTHS

from sixfold.server.protocol.codec import DTYPES
from sixfold.server.errors import InvalidInput, clip_names

__all__ = ["InputSpec", "validate_request"]


class InputSpec:
    """One input of a model's signature: name, datatype and shape (-1 = any).

    ``also``: further datatypes the model takes for this input (e.g. INT32 ids, half the bytes of
    INT64 ones, for a host stage that reads either); the signature's ``datatype`` is what metadata says.
    """

    def __init__(self, name: str, datatype: str, shape: Sequence[int], also: Sequence[str] = ()) -> None:
        self.name, self.datatype, self.shape = name, datatype, tuple(shape)
        self.dtype = DTYPES[datatype]
        self.also = tuple(also)
        self._also_dtypes = tuple(DTYPES[d] for d in self.also)
        # NOTE: the usual signature is [-1, d, ...]: then a shape matches when its tail does,
        # one tuple comparison instead of a loop per request.
        self._tail = self.shape[1:] if self.shape[:1] == (-1,) and -1 not in self.shape[1:] else None

    def matches(self, shape: tuple[int, ...]) -> bool:
        if self._tail is not None:
            return len(shape) == len(self.shape) and shape[1:] == self._tail
        return len(shape) == len(self.shape) and all(w == -1 or w == d for w, d in zip(self.shape, shape))


def _shape_mismatch(spec: InputSpec, array: np.ndarray) -> InvalidInput:
    want = [("N" if d == -1 else d) for d in spec.shape]
    return InvalidInput(f"input '{spec.name}': shape {list(array.shape)} does not match {want}")


def _check_names(inputs: dict[str, np.ndarray], specs: Sequence[InputSpec]) -> None:
    known = {s.name for s in specs}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise InvalidInput(f"unknown input(s) {clip_names(unknown)}; the model takes {sorted(known)}")
    for spec in specs:
        if spec.name not in inputs:
            raise InvalidInput(f"missing input '{spec.name}' ({spec.datatype} {list(spec.shape)})")


def _check_finite(dense: np.ndarray) -> None:
    """Refuse NaN and infinities, naming the first bad position."""
    # NOTE: one float64 sum settles nearly every request: it is finite unless a value is NaN or
    # infinite (fp32 values cannot overflow it; if fp64 ones do, the full pass below clears them).
    # Python's sum over a short list is cheaper than a numpy reduction (see _SMALL_LENGTHS).
    total = sum(dense.ravel().tolist()) if dense.size <= _SMALL_DENSE else float(dense.sum(dtype=np.float64))
    if total - total == 0.0:
        return
    bad = np.argwhere(~np.isfinite(dense))
    if len(bad):
        where = bad[0].tolist()
        raise InvalidInput(f"input '{DENSE}': non-finite value {float(dense[tuple(where)])} at {where} "
                           f"({len(bad)} in all); the model refuses NaN and infinity (serve it with "
                           "--allow-nonfinite to score them)")


def validate_request(inputs: dict[str, np.ndarray], specs: Sequence[InputSpec],
                     table_rows: Sequence[int] | None, allow_nonfinite: bool = False) -> int:
    """Validate in place; returns the number of items (rows) in the request."""
    if len(inputs) != len(specs):
        _check_names(inputs, specs)
    for spec in specs:
        # NOTE: one lookup per input checks its name and fetches it (as many inputs as specs, each
        # spec's name present: then no name is unknown), with no pass over the names first; a
        # datatype or shape error checks the names before it is raised, so a name error still comes first.
        array = inputs.get(spec.name)
        if array is None:
            _check_names(inputs, specs)  # raises: a name is unknown or missing
        if array.dtype != spec.dtype and array.dtype not in spec._also_dtypes:
            _check_names(inputs, specs)
            expected = " or ".join((spec.datatype, *spec.also))
            raise InvalidInput(f"input '{spec.name}': datatype {_name(array)} but the model expects {expected}")
        if not spec.matches(array.shape):
            _check_names(inputs, specs)
            raise _shape_mismatch(spec, array)

    dense, lengths, ids = inputs[DENSE], inputs[LENGTHS], inputs[INDICES]
    rows = dense.shape[0]
    if lengths.shape[0] != rows:
        raise InvalidInput(f"batch sizes disagree: '{DENSE}' has {rows} rows, '{LENGTHS}' has {lengths.shape[0]}")
    if not allow_nonfinite and dense.size:
        _check_finite(dense)
    # NOTE: a numpy reduction costs ~1.5 us however small its array; below a few dozen values
    # Python's min/sum/max over a list are cheaper (measured crossover: ~100 lengths, ~40 ids).
    if lengths.size <= _SMALL_LENGTHS:
        flat = lengths.ravel().tolist()
        smallest, total = (min(flat), sum(flat)) if flat else (0, 0)
    else:
        smallest, total = (int(lengths.min()) if lengths.size else 0), int(lengths.sum(dtype=np.int64))
    if smallest < 0:
        bad = np.argwhere(lengths < 0)[0]
        raise InvalidInput(f"input '{LENGTHS}': negative length {int(lengths[tuple(bad)])} at {bad.tolist()}")
    if total != ids.shape[0]:
        raise InvalidInput(f"input '{LENGTHS}' sums to {total} ids but '{INDICES}' has {ids.shape[0]}")
    if table_rows is not None and ids.size:
        if lengths.shape[1] != len(table_rows):
            raise InvalidInput(f"input '{LENGTHS}' has {lengths.shape[1]} tables; the model has {len(table_rows)}")
        # NOTE: one pass first, no per-id table lookup: a maximum inside the smallest table with
        # no negative id (nearly every request) settles it.
        if ids.size <= _SMALL_IDS:
            values = ids.tolist()
            fits = min(values) >= 0 and max(values) < min(table_rows)
        else:  # viewed as unsigned, a negative id is huge: one reduction covers both ends
            unsigned = ids.view(np.dtype(f"u{ids.itemsize}")) if ids.dtype.kind == "i" else ids
            fits = unsigned.max() < min(table_rows)
        if fits:
            return rows
        limits = np.asarray(table_rows, dtype=np.int64)
        table = np.repeat(np.tile(np.arange(len(limits)), rows), lengths.reshape(-1))
        bad = (ids < 0) | (ids >= limits[table])
        if bad.any():
            k = int(np.argmax(bad))
            raise InvalidInput(f"input '{INDICES}': id {int(ids[k])} at position {k} is out of range for "
                               f"table {int(table[k])} (rows 0..{int(limits[table[k]]) - 1})")
    return rows


_SMALL_LENGTHS, _SMALL_IDS, _SMALL_DENSE = 96, 32, 64
"""Arrays of at most this many values are checked with Python's builtins on a list (see validate_request)."""


def _name(array: np.ndarray) -> str:
    for name, dtype in DTYPES.items():
        if dtype == array.dtype:
            return name
    return str(array.dtype)
