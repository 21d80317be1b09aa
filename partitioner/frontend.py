"""Frontends: turn a model into a ``torch.export`` program with dynamic batch and id count."""

from __future__ import annotations

import torch

import models
from models.signature import DENSE, INDICES, LENGTHS

__all__ = ["export_model", "export_builtin", "load_export_archive", "CANONICAL_INPUTS"]

CANONICAL_INPUTS = (DENSE, LENGTHS, INDICES)


def export_model(model: torch.nn.Module, example: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    """Export a model taking the canonical request, with the batch and id dims dynamic.

    ``Dim.AUTO`` lets export discover how the dims relate (for one-hot models the
    id count is batch x tables) instead of failing on a guessed constraint.
    """
    auto = torch.export.Dim.AUTO
    dynamic = {DENSE: {0: auto}, LENGTHS: {0: auto}, INDICES: {0: auto}}
    with torch.inference_mode(False), torch.no_grad():
        return torch.export.export(model, example, dynamic_shapes=dynamic, strict=False)


def export_builtin(name: str, *, max_rows: int | None = None, seed: int = 0
                   ) -> tuple[models.DLRM, torch.export.ExportedProgram]:
    """Build a zoo model and export it (example batch of 8 items)."""
    model = models.build(name, max_rows=max_rows, seed=seed)
    example = models.example_inputs(model.config, items=8, seed=seed)
    return model, export_model(model, example)


def _input_shapes(program: torch.export.ExportedProgram) -> dict[str, tuple[int, ...]]:
    user = {s.arg.name for s in program.graph_signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT}
    shapes = {}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in user and "val" in node.meta:
            shapes[node.name] = tuple(int(d) if isinstance(d, int) else -1 for d in node.meta["val"].shape)
    return shapes


def load_export_archive(path: str, *, pooling: int = 1):
    """A ``torch.export.save`` archive of a model taking the canonical request.

    Returns (program, example, tables). The example request is read off the
    program's own input shapes: D dense features, T tables, ``pooling`` ids per
    (item, table) and id 0 everywhere (valid in any table), enough to trace,
    count FLOPs and export the dense part.
    """
    program = torch.export.load(path)
    shapes = _input_shapes(program)
    missing = [n for n in CANONICAL_INPUTS if n not in shapes]
    if missing:
        raise ValueError(f"{path}: the model's inputs are {sorted(shapes)}; a recommendation model must take "
                         f"{list(CANONICAL_INPUTS)} (missing {missing})")
    dense_dim, tables = shapes[DENSE][1], shapes[LENGTHS][1]
    if dense_dim < 0 or tables < 0:
        raise ValueError(f"{path}: only the batch and id-count dimensions may be dynamic; got "
                         f"{DENSE} {list(shapes[DENSE])}, {LENGTHS} {list(shapes[LENGTHS])}")
    generator = torch.Generator().manual_seed(0)

    def example(rows: int) -> dict[str, torch.Tensor]:
        return {DENSE: torch.randn(rows, dense_dim, generator=generator),
                LENGTHS: torch.full((rows, tables), pooling, dtype=torch.int32),
                INDICES: torch.zeros(rows * tables * pooling, dtype=torch.int64)}

    return program, example, {"pooling": [pooling] * tables}
