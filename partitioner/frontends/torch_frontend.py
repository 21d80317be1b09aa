"""Frontends: turn a model into a ``torch.export`` program with dynamic batch and id count."""

from __future__ import annotations

import logging

import torch

from sixfold import models
from sixfold.models.signature import DENSE, INDICES, LENGTHS, SCORES

__all__ = ["export_model", "export_builtin", "load_export_archive", "retrace_dynamic", "StaticExportError",
           "CANONICAL_INPUTS", "output_names"]

CANONICAL_INPUTS = (DENSE, LENGTHS, INDICES)

log = logging.getLogger(__name__)


def export_model(model: torch.nn.Module, example: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    """Export a model taking the canonical request, with the batch and id dims dynamic.

    ``Dim.AUTO`` lets export discover how the dims relate (for one-hot models the
    id count is batch x tables) instead of failing on a guessed constraint.
    """
    auto = torch.export.Dim.AUTO
    dynamic = {DENSE: {0: auto}, LENGTHS: {0: auto}, INDICES: {0: auto}}
    with torch.inference_mode(False), torch.no_grad():
        return torch.export.export(model, example, dynamic_shapes=dynamic, strict=False)


def output_names(program: torch.export.ExportedProgram) -> list[str]:
    """The served names of a program's outputs, as the model names them.

    A dict output gives its keys (``{"click": ..., "conversion": ...}``), a lone tensor is
    ``scores``, and a tuple of several is named as torch.export names them (its graph's
    output names). Every output of the model is served, so each needs a distinct name.
    """
    spec = program.call_spec.out_spec
    user = list(program.graph_signature.user_outputs)
    if spec is not None and spec.type is dict:
        keys = [str(k) for k in spec.context]
        nested = [k for k, child in zip(keys, spec.children()) if not child.is_leaf()]
        if nested:
            raise ValueError(f"the model's output {nested[0]!r} is a nested container; return one tensor per "
                             "output name (a flat dict of tensors)")
        return keys
    if len(user) == 1:
        return [SCORES]
    names: list[str] = []
    for name in user:  # the same value returned twice still needs two names
        base, k = name, 1
        while name in names:
            name, k = f"{base}_{k}", k + 1
        names.append(name)
    return names


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
    if shapes[DENSE][0] >= 0 or shapes[INDICES][0] >= 0:
        # A static export is fixed to its example's batch: re-trace it with dynamic dims when its graph allows.
        program = retrace_dynamic(program, path)
        shapes = _input_shapes(program)
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


class StaticExportError(ValueError):
    """A ``torch.export`` archive fixed to one batch size that cannot be re-traced; the message says what to change."""


def _static_fix(shapes: dict[str, tuple[int, ...]]) -> str:
    """The ``torch.export.export`` call that makes the batch and id count dynamic, for these example shapes."""
    batch, ids = shapes[DENSE][0], shapes[INDICES][0]
    per_item = ids // batch if batch > 0 and ids > 0 and ids % batch == 0 else None
    fixed = (f"batch * {per_item}}},   # {per_item} ids per item (fixed pooling)" if per_item
             else "torch.export.Dim('ids', min=0)},")
    return ("export with a dynamic batch and id count:\n"
            "    batch = torch.export.Dim('batch', min=1, max=4096)\n"
            "    program = torch.export.export(model, (dense_features, sparse_lengths, sparse_indices),\n"
            "                                  dynamic_shapes={\n"
            f"        '{DENSE}': {{0: batch}}, '{LENGTHS}': {{0: batch}},\n"
            f"        '{INDICES}': {{0: {fixed}\n"
            "        # jagged ids (pooling varies per item): {0: torch.export.Dim('ids', min=0)}\n"
            "    })\n"
            "    torch.export.save(program, 'model.pt2')\n"
            "(see docs/bring-your-own-model.md)")


def retrace_dynamic(program: torch.export.ExportedProgram, where: str = "model") -> torch.export.ExportedProgram:
    """Re-export a static-shape program with a dynamic batch and id count, or refuse saying what to change.

    ``torch.export`` without ``dynamic_shapes`` bakes the example's sizes into the
    graph (a ``reshape(ids, [4, 3, 3])`` for a 4-item example), so the program
    only runs on 4-item requests. The program's own module is re-exported with
    the batch dynamic (the id count free, else tied to the batch at the example's ids per item);
    torch.export refuses when a baked size pins the batch, and then so do we,
    with the ``dynamic_shapes`` the user should export with (StaticExportError).
    """
    shapes = _input_shapes(program)
    module = program.module()
    # NOTE: the unlifted module re-checks the example's shapes in a guard call; drop it, the re-export guards anew.
    # So do its runtime asserts on data-dependent sizes (u0 == 21: a repeat_interleave of the example's ids).
    for node in [n for n in module.graph.nodes if (n.op == "call_module" and str(n.target).startswith("_guards_fn"))
                 or (n.op == "call_function" and n.target is torch.ops.aten._assert_scalar.default)]:
        module.graph.erase_node(node)
    # A ``torch.tensor([...])`` constant is exported as lift_fresh_copy + detach_; re-exporting the in-place
    # detach fails ("Can't detach views in-place"), a reason that has nothing to do with the batch. A no-op here.
    for node in [n for n in module.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.detach_.default]:
        node.replace_all_uses_with(node.args[0])
        module.graph.erase_node(node)
    module.graph.eliminate_dead_code()
    module.recompile()
    user = [s.arg.name for s in program.graph_signature.input_specs
            if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    example = tuple(torch.zeros(shapes[n], dtype=_placeholder_dtype(program, n)) for n in user)
    batch_size, ids = shapes[DENSE][0], shapes[INDICES][0]
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    # Jagged ids first (the id count its own dim), then ids tied to the batch (fixed pooling).
    attempts = [{n: {0: torch.export.Dim("ids", min=0, max=1 << 30) if n == INDICES else batch} for n in user}]
    if batch_size > 0 and ids > 0 and ids % batch_size == 0:
        attempts.append({n: {0: batch * (ids // batch_size) if n == INDICES else batch} for n in user})
    reasons = []
    for dynamic in attempts:
        try:
            with torch.no_grad():
                retraced = torch.export.export(module, example, dynamic_shapes=dynamic, strict=False)
        except Exception as exc:  # noqa: BLE001 - torch.export raises many kinds; the reason goes in the message
            reasons.append(" ".join(str(exc).split())[:300])
            continue
        log.warning("%s was exported with static shapes; re-traced with a dynamic batch and id count", where)
        return retraced
    pinned = ", ".join(f"{n} {list(shapes[n])}" for n in CANONICAL_INPUTS)
    baked = baked_sizes(program, batch_size)
    why = (f"the example's {batch_size} items are baked into {'; '.join(baked[:3])}"
           + (f" and {len(baked) - 3} more" if len(baked) > 3 else "") if baked
           else f"torch.export: {reasons[0] if reasons else '?'}")
    raise StaticExportError(
        f"{where} was exported with static shapes ({pinned}): its graph is fixed to a {batch_size}-item request "
        f"and cannot be re-traced for other batch sizes ({why}). "
        "Re-" + _static_fix(shapes))


_SHAPE_OPS = {"view", "reshape", "_unsafe_view", "expand", "arange", "zeros", "ones", "full", "empty", "new_zeros",
              "new_ones", "new_full", "new_empty", "repeat", "randn", "rand", "split_with_sizes", "narrow", "slice"}


def _user_line(node: torch.fx.Node) -> str:
    """The model's own source line that made ``node`` (the innermost frame outside torch), or ""."""
    frames = (node.meta.get("stack_trace") or "").strip().splitlines()
    found = ""
    for i, line in enumerate(frames):
        line = line.strip()
        if line.startswith("File ") and "/torch/" not in line and i + 1 < len(frames):
            parts = line.split('"')
            file = parts[1].rsplit("/", 1)[-1] if len(parts) > 2 else "?"
            number = line.split(", line ")[-1].split(",")[0] if ", line " in line else "?"
            found = f"{file} line {number}: `{frames[i + 1].strip()}`"
    return found


def baked_sizes(program: torch.export.ExportedProgram, batch: int) -> list[str]:
    """The ops of a static program that take a literal size that is a multiple of the example's batch.

    Each says the op, its literal sizes and the model's source line: the real reason a static
    export cannot be re-traced (torch.export's own error often names something unrelated).
    """
    if batch < 2:
        return []
    found = []
    for node in program.graph.nodes:
        op = str(getattr(node.target, "__name__", node.target)).split(".")[0]
        if node.op != "call_function" or op not in _SHAPE_OPS:
            continue
        sizes = [a for a in node.args if isinstance(a, int) and not isinstance(a, bool)]
        sizes += [v for a in node.args if isinstance(a, (list, tuple)) for v in a if isinstance(v, int)]
        if not any(v >= batch and v % batch == 0 for v in sizes):
            continue
        literal = [list(a) for a in node.args if isinstance(a, (list, tuple))] or sizes
        line = _user_line(node)
        found.append(f"{op}({', '.join(map(str, literal))})" + (f" at {line}" if line else ""))
    return found


def _placeholder_dtype(program: torch.export.ExportedProgram, name: str) -> torch.dtype:
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name == name:
            return node.meta["val"].dtype
    raise KeyError(name)
