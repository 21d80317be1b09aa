"""How a batch's card inputs split into sub-batches of items, from the card partition's layouts.

A batch of N items goes to several cards as runs of items; each card input is cut where
its layout (``PartitionArtifact.layouts``, written by the partitioner) says an item's rows
end: k rows per item, item i's at ``[i*k, (i+1)*k)``. An input that is ragged (one row per
id), or whose layout is unknown (a plan written before layouts were recorded), cannot be
cut on item boundaries by the server: such a model's batches go to one card whole. A
length that disagrees with the layout is the batch's error, raised before any card runs it,
so it can never count against a card's health.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from sixfold.backends.api import Arrays, PartitionArtifact

from sixfold.server.errors import InternalError

__all__ = ["CardSplit"]


class CardSplit:
    """The split rule of one dense partition: its inputs' rows per item, or why it has none."""

    def __init__(self, artifact: PartitionArtifact) -> None:
        self.name = artifact.name
        self.rows_per_item: dict[str, int] = {}
        problems = []
        for name in artifact.input_names:
            layout = artifact.layouts.get(name)
            if layout is None:
                problems.append(f"'{name}' has no recorded layout (a plan from before layouts: partition it again)")
            elif layout.rows_per_item is None:
                problems.append(f"'{name}' is ragged (one row per id, counted by {layout.ragged_by})"
                                if layout.ragged_by else f"'{name}' has no fixed rows per item")
            else:
                self.rows_per_item[name] = layout.rows_per_item
        self.why_not = ("batches go to one card whole: card input " + "; ".join(problems)) if problems else ""
        """Why this partition's batches are never split across cards ("" when they may be)."""

    @property
    def splittable(self) -> bool:
        return not self.why_not

    def check(self, inputs: Mapping[str, np.ndarray], rows: int) -> None:
        """InternalError (the batch's, not a card's) when an input's length disagrees with its layout."""
        for name, k in self.rows_per_item.items():
            length = inputs[name].shape[0] if inputs[name].ndim else 0
            if length != k * rows:
                raise InternalError(f"card input '{name}' has {length} rows for a {rows}-item batch; its layout "
                                    f"says {k} row(s) per item ({k * rows})")

    def pieces(self, inputs: Mapping[str, np.ndarray], rows: int, bounds: Sequence[tuple[int, int]]) -> list[Arrays]:
        """The card inputs of each run of items ``[a, b)`` in ``bounds`` (views, no copies)."""
        if len(bounds) > 1 and not self.splittable:
            raise InternalError(f"partition {self.name!r}: {self.why_not}")  # the caller asks for one part
        if len(bounds) == 1:
            return [{n: inputs[n] for n in inputs}]
        self.check(inputs, rows)
        return [{n: inputs[n][a * k:b * k] for n, k in self.rows_per_item.items()} for a, b in bounds]

    def head(self, inputs: Mapping[str, np.ndarray], rows: int, items: int) -> Arrays:
        """The first ``items`` items' inputs (the whole batch when it cannot be cut): for pricing and probes."""
        if not self.splittable or items >= rows:
            return dict(inputs)
        return {n: inputs[n][:items * k] for n, k in self.rows_per_item.items()}
