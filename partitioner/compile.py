"""From a model to a PartitionPlan plus loadable artifacts (the partitioner's one entry point).

    model --export--> graph --policy--> labels --cut--> host + dense modules
          --cost--> per-item FLOPs/bytes --strategy--> placements --> plan

The plan is plain data; the artifacts are what backends load (the host stage
as a torch FX module, the dense stage as ONNX bytes).
"""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from sixfold import models
from sixfold.backends.api import PartitionArtifact
from sixfold.backends.spec import DeviceSpec
from sixfold.backends.spec_catalog import load_spec
from sixfold.models.signature import DENSE, INDICES, LENGTHS, SCORES

from sixfold.partitioner.pricing.cost import PartitionCost, flops_per_item, lookup_bytes_per_id, module_param_bytes, op_profile
from sixfold.partitioner.frontends.torch_frontend import export_model, output_names
from sixfold.partitioner.cut.graph_cut import SplitGraph, cut_graph
from sixfold.partitioner.cut.layout import BatchSymbols, Layout, batch_symbols, observed_layout, tensor_layout
from sixfold.partitioner.cut.pooling import move_pooling_to_host
from sixfold.partitioner.partitioned import DENSE_PARTITION, HOST_PARTITION, PartitionedModel
from sixfold.partitioner.plan import DeviceInfo, PartitionInfo, PartitionPlan, TensorInfo
from sixfold.partitioner.pricing.estimate import estimate_plan
from sixfold.partitioner.cut.sparse_dense import assign_sparse_dense
from sixfold.partitioner.cut.pipeline import node_costs, run_stages, split_stages
from sixfold.partitioner.piece_check import check_pieces, onnx_piece
from sixfold.partitioner.placement.strategy import STRATEGIES, PlanError, auto_refusal, choose, pipeline, replicate

__all__ = ["PartitionedModel", "partition_model", "partition_builtin", "partition_file", "quantize_tables", "HOST_PARTITION", "DENSE_PARTITION"]

log = logging.getLogger(__name__)

_DTYPES = {torch.float32: "FP32", torch.float16: "FP16", torch.int32: "INT32", torch.int64: "INT64"}

ExampleFn = Callable[[int], dict[str, torch.Tensor]]


def _tensor_info(name: str, t: torch.Tensor, batch_dim_dynamic: bool = True, layout: Layout | None = None,
                 *, consumed: bool = True, passed_on: bool = False) -> TensorInfo:
    shape = list(t.shape)
    if batch_dim_dynamic and shape:
        shape[0] = -1
    layout = layout or Layout(None)
    return TensorInfo(name=name, datatype=_DTYPES.get(t.dtype, str(t.dtype)), shape=shape,
                      rows_per_item=layout.rows_per_item, ragged_by=layout.ragged_by, consumed=consumed,
                      passed_on=passed_on)


def _layouts(graph: torch.fx.Graph, names: list[str], symbols: BatchSymbols, small: dict[str, torch.Tensor],
             large: dict[str, torch.Tensor], small_items: int = 4, large_items: int = 64) -> dict[str, Layout]:
    """Each named placeholder's layout: its traced shape (``cut.layout``) checked against two real runs."""
    values = {n.name: n.meta.get("val") for n in graph.nodes if n.op == "placeholder"}
    return {name: tensor_layout(values.get(name), symbols,
                                observed_layout(small.get(name), small_items, large.get(name), large_items))
            for name in names}


def _unsplittable(layouts: dict[str, Layout], where: str) -> str:
    """Why a batch of this partition can never be split or merged from parts ("" when it can)."""
    bad = [f"{n!r} is {layout.describe()}" for n, layout in layouts.items() if not layout.per_item]
    return f"{where} {'; '.join(bad)}: only a whole batch is right for it" if bad else ""


def _check_item_major(outputs: dict[str, torch.Tensor], items: int) -> None:
    """Every output is served item-major (``[items, ...]``) so a batch's answers split back per request."""
    for name, value in outputs.items():
        shape = list(value.shape)
        if not shape or shape[0] != items:
            raise PlanError(f"output {name!r} came out {shape} for a {items}-item request: every output must be "
                            f"item-major, [{items}, ...] (one row per item)")


def _run_host(split: SplitGraph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    with torch.inference_mode():
        out = split.host(*[inputs[n] for n in split.host_inputs])
    return dict(zip(split.boundary, out))


def _dense_args(split: SplitGraph, inputs: dict[str, torch.Tensor],
                boundary: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    env = {**inputs, **boundary}
    return tuple(env[n] for n in split.dense_inputs)


def _export_onnx(module: torch.nn.Module, args: tuple[torch.Tensor, ...], input_names: list[str],
                 output_names: list[str]) -> bytes:
    dynamic = tuple({0: torch.export.Dim(f"rows_{i}", min=1)} for i in range(len(args)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # NOTE: the exporter's optimizer logs every pass at INFO; a server's start-up log is for the plan.
        for noisy in ("torch.onnx", "onnxscript", "onnx_ir"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        program = torch.onnx.export(module.eval(), args, dynamo=True, input_names=input_names,
                                    output_names=output_names, dynamic_shapes=dynamic,
                                    optimize=True, verbose=False)
    buffer = io.BytesIO()
    program.save(buffer)
    return buffer.getvalue()


def partition_model(name: str, model: torch.nn.Module | torch.export.ExportedProgram, example: ExampleFn, *,
                    cards: list[DeviceSpec], host: DeviceSpec, tables: dict | None = None,
                    strategy: str = "auto", batch_rows: int = 256, compile: bool = True,
                    stages: int | None = None) -> PartitionedModel:
    """Cut ``model`` into a host (sparse) and a dense partition and place them.

    ``compile=False`` plans only: the plan is complete (cut, costs, placement,
    estimates) but no ONNX is exported, so the dense artifacts' payloads are
    None. Export is most of the time of a partition (bench/plan_scale.py).

    ``example(rows)`` returns a real canonical request of ``rows`` items; it is
    used for export, for measuring FLOPs per item and for the ONNX export.
    ``strategy``: "replicate" the dense partition on every card, "pipeline" it
    in stages across cards, or "auto" (replicate when it fits a card).
    ``stages``: the pipeline's stage count (needs ``strategy="pipeline"``; None: the
    count with the highest throughput bound).
    """
    if strategy not in STRATEGIES:  # fail before the export, not after
        raise ValueError(f"unknown strategy {strategy!r}; available: {', '.join(STRATEGIES)}")
    if stages is not None and strategy != "pipeline":
        raise ValueError(f"a stage count ({stages}) needs strategy 'pipeline', not {strategy!r}")
    small, large = example(4), example(64)
    # An archive is already an export with the user's own dynamic shapes: cut it as it is.
    program = model if isinstance(model, torch.export.ExportedProgram) else export_model(
        model, tuple(small[n] for n in (DENSE, LENGTHS, INDICES)))
    heads = output_names(program)  # every output of the model is served, named as the model names it
    reference = model if isinstance(model, torch.nn.Module) else _unguarded(program)
    gm = program.module()
    labels = assign_sparse_dense(gm.graph)
    pooling_stays = move_pooling_to_host(gm, labels)  # the host stage ends with per-item tensors where it can
    gm.recompile()
    split = cut_graph(gm, labels, heads)

    small_b, large_b = _run_host(split, small), _run_host(split, large)
    small_args, large_args = _dense_args(split, small, small_b), _dense_args(split, large, large_b)
    with torch.inference_mode():
        small_out = dict(zip(heads, split.dense(*small_args)))
        large_out = dict(zip(heads, split.dense(*large_args)))
    _check_item_major(large_out, 64)
    out_per_item = sum(t.numel() * t.element_size() for t in large_out.values()) / 64

    ids_per_item = large[INDICES].numel() / large[DENSE].shape[0]
    # Op profiles: a calibrated spec (sixfold-partition calibrate) prices each partition op by op.
    host_args = [tuple(b[n] for n in split.host_inputs) for b in (small, large)]
    host_cost = PartitionCost(
        param_bytes=module_param_bytes(split.host), flops_per_item=0.0,
        bytes_per_item=ids_per_item * lookup_bytes_per_id(split.host), weight_bytes_per_batch=0,
        ops=op_profile(split.host, host_args[0], 4, host_args[1], 64))
    dense_param = module_param_bytes(split.dense)
    dense_in_per_item = sum(a.numel() * a.element_size() for a in large_args) / 64
    dense_cost = PartitionCost(
        param_bytes=dense_param,
        flops_per_item=flops_per_item(split.dense, small_args, 4, large_args, 64),
        bytes_per_item=2.0 * dense_in_per_item, weight_bytes_per_batch=dense_param,
        ops=op_profile(split.dense, small_args, 4, large_args, 64))

    host_info = DeviceInfo(id="host", spec=host)
    card_infos = [DeviceInfo(id=f"card{i}", spec=spec) for i, spec in enumerate(cards)]
    requested, strategy = strategy, choose(strategy, dense_cost, card_infos)
    if strategy == "pipeline":
        try:
            staged = _pipeline_stages(split, small_args, large_args, host_info, card_infos, batch_rows, compile,
                                      stages, batch_symbols(gm.graph), heads)
        except PlanError as exc:
            raise (auto_refusal(dense_cost, card_infos, exc) if requested == "auto" else exc) from None
        placements = staged.placements
        costs = {HOST_PARTITION: host_cost, **staged.costs}
        io_bytes = {HOST_PARTITION: (0.0, 0.0), **staged.io_bytes}
    else:
        staged = None
        placements = replicate(HOST_PARTITION, DENSE_PARTITION, dense_cost, host_info, card_infos)
        costs = {HOST_PARTITION: host_cost, DENSE_PARTITION: dense_cost}
        io_bytes = {HOST_PARTITION: (0.0, 0.0), DENSE_PARTITION: (dense_in_per_item, out_per_item)}
    onnx_bytes = (_export_onnx(split.dense, large_args, split.dense_inputs, heads)
                  if staged is None and compile else None)
    estimates = estimate_plan([host_info, *card_infos], placements, costs, io_bytes, batch_rows)
    _check_pieces(reference, split, heads, example, onnx_bytes, staged, name)

    symbols = batch_symbols(gm.graph)
    small_env, large_env = dict(zip(split.dense_inputs, small_args)), dict(zip(split.dense_inputs, large_args))
    layouts = {**_layouts(gm.graph, [DENSE, LENGTHS, INDICES], symbols, small, large),
               **_layouts(split.dense.graph, split.dense_inputs, symbols, small_env, large_env),
               **{n: observed_layout(small_out[n], 4, large_out[n], 64) for n in heads}}
    inputs = [_tensor_info(n, large[n], layout=layouts[n]) for n in (DENSE, LENGTHS, INDICES)]
    dense_reads = {n.name for n in split.dense.graph.nodes if n.op == "placeholder" and n.users}
    outputs = [_tensor_info(n, large_out[n], layout=layouts[n]) for n in heads]
    dense_layouts = {n: layouts[n] for n in [*split.dense_inputs, *heads]}
    unsplittable = _unsplittable(dense_layouts, "card input")
    if unsplittable and pooling_stays:
        unsplittable += f" ({pooling_stays})"
    if unsplittable:
        log.warning("%s: batches are never split across cards: %s", name, unsplittable)
    host_part = PartitionInfo(
        name=HOST_PARTITION, kind="sparse", format="torch-fx",
        inputs=[i for i in inputs if i.name in split.host_inputs],
        outputs=[_tensor_info(n, large_b[n], layout=layouts[n]) for n in split.boundary],
        nodes=split.host_nodes, param_bytes=host_cost.param_bytes, flops_per_item=0.0,
        bytes_per_item=host_cost.bytes_per_item)
    dense_part = PartitionInfo(
        name=DENSE_PARTITION, kind="dense", format="onnx",
        inputs=[_tensor_info(n, large_env[n], layout=layouts[n], consumed=n in dense_reads)
                for n in split.dense_inputs],
        outputs=outputs, nodes=split.dense_nodes,
        param_bytes=dense_param, flops_per_item=dense_cost.flops_per_item,
        bytes_per_item=dense_cost.bytes_per_item, unsplittable=unsplittable)
    plan = PartitionPlan(
        model=name, strategy=strategy, inputs=inputs, outputs=outputs,
        partitions=[host_part, dense_part], devices=[host_info, *card_infos], placements=placements,
        estimates=estimates, tables=dict(tables or {}))

    artifacts = {
        HOST_PARTITION: PartitionArtifact(
            name=HOST_PARTITION, format="torch-fx", payload=split.host,
            input_names=tuple(split.host_inputs), output_names=tuple(split.boundary),
            param_bytes=host_cost.param_bytes, flops_per_item=0.0,
            bytes_per_item=host_cost.bytes_per_item, layouts=host_part.layouts()),
        DENSE_PARTITION: PartitionArtifact(
            name=DENSE_PARTITION, format="onnx", payload=onnx_bytes,
            input_names=tuple(split.dense_inputs), output_names=tuple(heads),
            param_bytes=dense_param, flops_per_item=dense_cost.flops_per_item,
            bytes_per_item=dense_cost.bytes_per_item, layouts=dense_part.layouts()),
    }
    dense_fx = PartitionArtifact(
        name=DENSE_PARTITION, format="torch-fx", payload=split.dense.eval(),
        input_names=tuple(split.dense_inputs), output_names=tuple(heads), param_bytes=dense_param,
        flops_per_item=dense_cost.flops_per_item, bytes_per_item=dense_cost.bytes_per_item,
        layouts=dense_part.layouts())
    variants = {DENSE_PARTITION: [dense_fx]}
    if staged is not None:  # the stages stand in for the one dense partition
        plan.partitions = [host_part, *staged.infos]
        del artifacts[DENSE_PARTITION]
        artifacts.update(staged.artifacts)
        variants = staged.variants
    return PartitionedModel(plan=plan, artifacts=artifacts, split=split, graph=gm, labels=labels,
                            variants=variants, costs=costs, io_bytes=io_bytes)


def _unguarded(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """The archive's model as the cut runs it: without the guard call that pins the export's example range
    (torch.export refuses batch 1 when it traced at 4; the pieces, and so the server, take it)."""
    module = program.module()
    for node in [n for n in module.graph.nodes if n.op == "call_module" and str(n.target).startswith("_guards_fn")]:
        module.graph.erase_node(node)
    module.recompile()
    return module


def _check_pieces(reference: torch.nn.Module, split: SplitGraph, heads: list[str], example: ExampleFn,
                  onnx_bytes: bytes | None, staged: "_Staged | None", name: str) -> None:
    """Refuse the plan unless its pieces answer like the model at 1, 2, 3, 7 and 64 items (``piece_check``)."""
    def dense(env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(heads, split.dense(*[env[n] for n in split.dense_inputs])))
    cards: dict[str, Callable] = {"dense": dense}
    if onnx_bytes is not None:
        cards["dense.onnx"] = onnx_piece(onnx_bytes, split.dense_inputs, heads)
    if staged is not None:
        cards["pipeline stages"] = lambda env: run_stages(staged.stages, {n: env[n] for n in split.dense_inputs})[1]
    checked = check_pieces(reference, split, heads, example, cards, rtol=1e-3, atol=1e-4)
    log.info("%s: pieces checked against the model on a %s", name, ", a ".join(checked))


@dataclass
class _Staged:
    placements: list
    costs: dict[str, PartitionCost]
    io_bytes: dict[str, tuple[float, float]]
    infos: list[PartitionInfo]
    artifacts: dict[str, PartitionArtifact]
    variants: dict[str, list[PartitionArtifact]]
    stages: list = field(default_factory=list)
    """The cut stages (``pipeline.Stage``), to run them in order."""


def _pipeline_stages(split: SplitGraph, small_args: tuple[torch.Tensor, ...], large_args: tuple[torch.Tensor, ...],
                     host_info: DeviceInfo, card_infos: list[DeviceInfo], batch_rows: int,
                     compile: bool = True, stages: int | None = None,
                     symbols: BatchSymbols = BatchSymbols(None, None), heads: list[str] | None = None) -> _Staged:
    """Pick cut points (strategy.pipeline), cut the dense graph there (pipeline.split_stages), export each stage."""
    graph_costs = node_costs(split.dense, small_args, 4, large_args, 64)
    choice = pipeline(HOST_PARTITION, DENSE_PARTITION, graph_costs, host_info, card_infos, batch_rows=batch_rows,
                      stages=stages)
    heads = heads or [SCORES]
    stages = split_stages(split.dense, choice.cuts, heads)
    stage_inputs, final = run_stages(stages, dict(zip(split.dense_inputs, large_args)))
    small_inputs, _ = run_stages(stages, dict(zip(split.dense_inputs, small_args)))
    bounds = [0, *choice.cuts, len(graph_costs.nodes)]
    staged = _Staged(list(choice.placements), {}, {}, [], {}, {}, stages)
    for stage, name, inputs, small, (a, b) in zip(stages, choice.stage_names, stage_inputs, small_inputs,
                                                  zip(bounds[:-1], bounds[1:])):
        in_per, out_per = graph_costs.live_bytes_per_item(a), graph_costs.produced_bytes_per_item(a, b)
        weights = graph_costs.stage_param_bytes(a, b)
        cost = PartitionCost(param_bytes=weights, flops_per_item=graph_costs.stage_flops_per_item(a, b),
                             bytes_per_item=in_per + out_per, weight_bytes_per_batch=weights)
        staged.costs[name], staged.io_bytes[name] = cost, (in_per, out_per)
        with torch.inference_mode():
            outputs = dict(zip(stage.outputs, stage.module(*inputs.values())))
            small_outputs = dict(zip(stage.outputs, stage.module(*small.values())))
        layouts = _layouts(stage.module.graph, stage.inputs, symbols, small, inputs)
        returned = next(n for n in stage.module.graph.nodes if n.op == "output").args[0]
        for out, value in zip(stage.outputs, returned):
            traced = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
            layouts[out] = tensor_layout(traced, symbols, observed_layout(small_outputs[out], 4, outputs[out], 64))
        read = {n.name for n in stage.module.graph.nodes if n.op == "placeholder" and n.users}
        staged.infos.append(PartitionInfo(
            name=name, kind="dense", format="onnx",
            inputs=[_tensor_info(n, t, layout=layouts[n], consumed=n in read, passed_on=n in stage.passthrough)
                    for n, t in inputs.items()],
            outputs=[_tensor_info(n, t, layout=layouts[n]) for n, t in outputs.items()], nodes=stage.nodes,
            param_bytes=weights, flops_per_item=cost.flops_per_item, bytes_per_item=cost.bytes_per_item,
            unsplittable=_unsplittable(layouts, f"stage {name}:")))
        onnx = _export_onnx(stage.module, tuple(inputs.values()), stage.inputs, stage.outputs) if compile else None
        made = [PartitionArtifact(
            name=name, format=fmt, payload=payload, input_names=tuple(stage.inputs),
            output_names=tuple(stage.outputs), param_bytes=weights, flops_per_item=cost.flops_per_item,
            bytes_per_item=cost.bytes_per_item, metadata={"stage": stage.index, "passthrough": stage.passthrough},
            layouts=staged.infos[-1].layouts())
            for fmt, payload in (("onnx", onnx), ("torch-fx", stage.module.eval()))]
        staged.artifacts[name], staged.variants[name] = made[0], made[1:]
    if set(final) != set(heads):
        raise AssertionError(f"pipeline stages return {sorted(final)}, not {heads}")
    return staged


def builtin_example(config: models.ModelConfig, seed: int = 0) -> ExampleFn:
    """Example requests for a zoo model, from its own traffic generator."""
    def make(rows: int) -> dict[str, torch.Tensor]:
        request = models.RequestGenerator.for_config(config, seed=seed + rows).make(rows)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in request.items()}
    return make


def quantize_tables(partitioned: PartitionedModel, model: torch.nn.Module, precision: str) -> None:
    """Serve the host stage as ``precision`` tables (fp32, or row-wise fp16/int8/int4) instead of its graph.

    Only for a table-batched embedding host stage (the zoo's): the host partition
    must read just the lengths and ids and produce one pooled tensor. The tables
    backend (``sixfold.backends.host.host_embedding``) runs small batches at a third of the
    graph's cost, and fp32 tables give the graph's sums bit for bit.
    """
    from sixfold.backends.host.host_embedding import PRECISIONS, bytes_per_row
    if precision not in PRECISIONS:
        raise ValueError(f"unknown table precision {precision!r}; known: {', '.join(PRECISIONS)}")
    split = partitioned.split
    embeddings = getattr(model, "embeddings", None)
    if split.host_inputs != [LENGTHS, INDICES] or len(split.boundary) != 1 or embeddings is None:
        raise ValueError("table precision needs a table-batched embedding host stage "
                         f"(host inputs {split.host_inputs}, outputs {split.boundary})")
    weight = embeddings.weight.detach().numpy()
    offsets = [0, *np.cumsum(embeddings.table_rows).tolist()]
    tables = [weight[a:b] for a, b in zip(offsets[:-1], offsets[1:])]  # views, no copy
    param_bytes = sum(bytes_per_row(precision, weight.shape[1]) * t.shape[0] for t in tables)
    old = partitioned.artifacts[HOST_PARTITION]
    partitioned.artifacts[HOST_PARTITION] = PartitionArtifact(
        name=HOST_PARTITION, format="tables", payload=tables, input_names=(LENGTHS, INDICES),
        output_names=tuple(split.boundary), param_bytes=param_bytes, flops_per_item=0.0,
        bytes_per_item=old.bytes_per_item, metadata={"precision": precision}, layouts=old.layouts)
    info = partitioned.plan.partition(HOST_PARTITION)
    info.format, info.param_bytes = "tables", param_bytes
    partitioned.plan.tables["precision"] = precision


def partition_builtin(name: str, *, max_rows: int | None = None, seed: int = 0, cards: int = 6,
                      card_spec: str | DeviceSpec = "m2-card", host_spec: str | DeviceSpec = "host-cpu",
                      batch_rows: int = 256, table_precision: str = "fp32",
                      strategy: str = "auto", compile: bool = True,
                      stages: int | None = None) -> tuple[models.DLRM, PartitionedModel]:
    """Build a zoo model and partition it onto ``cards`` identical cards plus the host.

    ``compile=False``: plan only, no ONNX export (see ``partition_model``).
    The host stage is served as tables (``sixfold.backends.host.host_embedding``, as a repository written
    by ``sixfold-partition`` serves it), in ``table_precision``: fp32 gives the same sums as
    the model's graph, bit for bit; fp16/int8/int4 are row-wise quantized.
    """
    card = card_spec if isinstance(card_spec, DeviceSpec) else load_spec(card_spec)
    host = host_spec if isinstance(host_spec, DeviceSpec) else load_spec(host_spec)
    model = models.build(name, max_rows=max_rows, seed=seed)
    config = model.config
    tables = {"rows": list(config.table_rows), "dim": config.embedding_dim,
              "pooling": list(config.pooling), "zipf": config.zipf}
    partitioned = partition_model(name, model, builtin_example(config, seed), cards=[card] * cards,
                                  host=host, tables=tables, batch_rows=batch_rows, strategy=strategy,
                                  compile=compile, stages=stages)
    quantize_tables(partitioned, model, table_precision)
    return model, partitioned


def partition_file(path: str, *, name: str | None = None, cards: int = 6, card_spec: str | DeviceSpec = "m2-card",
                   host_spec: str | DeviceSpec = "host-cpu", pooling: int | None = None,
                   batch_rows: int = 256, strategy: str = "auto", compile: bool = True,
                   table_precision: str = "fp32", stages: int | None = None) -> PartitionedModel:
    """Partition a ``torch.export`` archive (.pt2) or an ONNX file (.onnx) of a model taking the canonical request.

    ``pooling``: ids per (item, table) to trace or run the model with; None means
    1 for a .pt2 archive and "the first the model runs with" for ONNX.
    ``table_precision``: every lookup's rows in fp32, fp16, int8 or int4
    (``lookup_precision`` for a .pt2, ``onnx_precision`` for ONNX).
    ``stages``: pipeline stage count (with ``strategy="pipeline"``; None: the best).
    """
    from pathlib import Path

    from sixfold.partitioner.frontends.torch_frontend import load_export_archive
    suffix = Path(path).suffix
    if suffix not in (".pt2", ".onnx"):
        raise ValueError(f"{path}: expected a torch.export archive (.pt2) or an ONNX model (.onnx), not {suffix!r}")
    card = card_spec if isinstance(card_spec, DeviceSpec) else load_spec(card_spec)
    host = host_spec if isinstance(host_spec, DeviceSpec) else load_spec(host_spec)
    if suffix == ".onnx":
        from sixfold.partitioner.frontends.onnx_frontend import partition_onnx
        partitioned = partition_onnx(path, cards=[card] * cards, host=host, name=name, pooling=pooling,
                                     strategy=strategy, batch_rows=batch_rows)
        partitioned.plan.tables["fixed_pooling"] = True  # observed at one pooling: synthetic traffic keeps it
        if table_precision != "fp32":
            from sixfold.partitioner.precision.onnx_lookups import quantize_onnx_lookups
            quantize_onnx_lookups(partitioned, table_precision)
        return partitioned
    module, example, tables = load_export_archive(path, pooling=pooling or 1)
    partitioned = partition_model(name or Path(path).stem, module, example, cards=[card] * cards, host=host,
                                  tables=tables, batch_rows=batch_rows, strategy=strategy, compile=compile,
                                  stages=stages)
    _probe_rows(partitioned, pooling or 1)
    partitioned.plan.tables["fixed_pooling"] = True  # traced at one pooling: synthetic traffic keeps it
    if table_precision != "fp32":
        from sixfold.partitioner.precision.lookups import quantize_lookups
        quantize_lookups(partitioned, table_precision)
    return partitioned


def _probe_rows(partitioned: PartitionedModel, pooling: int) -> None:
    """Per-table row counts for the server's range checks, read off the host graph (table_probe)."""
    from sixfold.partitioner.tables.probe import probe_table_rows
    plan, split = partitioned.plan, partitioned.split
    shapes = {t.name: t.shape for t in plan.inputs}
    rows = probe_table_rows(split.host, list(split.host_inputs), tables=shapes[LENGTHS][1],
                            dense_dim=shapes[DENSE][1], pooling=pooling)
    if rows is None:
        log.warning("%s: could not tell which lookup serves which table; the server range-checks ids per lookup "
                    "instead, after the model's own index arithmetic (sixfold.partitioner.tables.id_check)", plan.model)
    else:
        plan.tables["rows"] = rows
