"""Frontends: turn a model into a ``torch.export`` program with dynamic batch and id count."""

from __future__ import annotations

import torch

import models
from models.signature import DENSE, INDICES, LENGTHS

__all__ = ["export_model", "export_builtin", "CANONICAL_INPUTS"]

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
