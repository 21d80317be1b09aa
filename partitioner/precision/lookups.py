"""Table precision for any host graph: every embedding lookup rewritten to read fp16, int8 or int4 rows.

The zoo's host stage is one table-batched bag, served as row-wise tables by the
host-embedding backend (``compile.quantize_tables``). A user's model has its own
host graph: per-table ``EmbeddingBag``s, ``embedding`` + its own pooling, ids
shifted or hashed first. Here each lookup the partitioner recognises
(``aten.embedding_bag``/``_embedding_bag``/``embedding``) is rewritten in a copy
of the host graph to the same kernels the host-embedding backend uses:

==========  ===========================================================  =====================
precision   kernel                                                       bytes per row (dim)
==========  ===========================================================  =====================
fp16        ``aten.embedding_bag`` / ``embedding`` on a half weight,      2 * dim
            pooled in fp16, returned as fp32
int8        ``quantized.embedding_bag_byte_rowwise_offsets``              dim + 8
int4        ``quantized.embedding_bag_4bit_rowwise_offsets``              dim / 2 + 4
==========  ===========================================================  =====================

The rest of the graph (index arithmetic, pooling of plain ``embedding``
lookups, whatever the model does after) is unchanged, and so are the host
stage's inputs and outputs (fp32). The quantized kernels only sum, so a
``mean`` bag divides by its bag sizes afterwards; ``max`` bags and lookups
with a ``padding_idx`` are refused by name. The fp32 host graph stays in
``PartitionedModel.split`` for the accuracy report's reference.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from torch import fx

from sixfold.partitioner.cut.sparse_dense import EMBEDDING_OPS, is_embedding_lookup

__all__ = ["LOOKUP_PRECISIONS", "quantize_lookups", "quantize_host_graph"]

LOOKUP_PRECISIONS = ("fp32", "fp16", "int8", "int4")

_BAGS = {"embedding_bag", "_embedding_bag", "_embedding_bag_forward_only"}
_MODES = {0: "sum", 1: "mean", 2: "max"}


def _int4_bag_meta(weight, indices, offsets=None, scale_grad_by_freq=False, mode=0, pruned_weights=False,
                   per_sample_weights=None, compressed_indices_mapping=None, include_last_offset=False):
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    return weight.new_empty((bags, (weight.shape[1] - 4) * 2), dtype=torch.float32)


def _register_int4_meta() -> None:
    # NOTE: torch ships no shape function for the 4-bit bag, so torch.export could not trace it (host.pt2).
    # A Meta kernel, not a fake impl: the op's C++ registration names another Python module for its fake.
    global _META_LIB
    try:
        _META_LIB = torch.library.Library("quantized", "IMPL")
        _META_LIB.impl("embedding_bag_4bit_rowwise_offsets", _int4_bag_meta, "Meta")
    except RuntimeError:  # registered already (a torch that ships one)
        pass


_META_LIB = None
_register_int4_meta()


def _pack(weight: torch.Tensor, precision: str) -> torch.Tensor:
    weight = weight.detach().float().contiguous()
    if precision == "fp16":
        return weight.half()
    if precision == "int8":
        return torch.ops.quantized.embedding_bag_byte_prepack(weight)
    return torch.ops.quantized.embedding_bag_4bit_prepack(weight)


def _quantized_sum(packed: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, weights, last: bool,
                   precision: str) -> torch.Tensor:
    kernel = (torch.ops.quantized.embedding_bag_byte_rowwise_offsets if precision == "int8"
              else torch.ops.quantized.embedding_bag_4bit_rowwise_offsets)
    return kernel(packed, indices, offsets, False, 0, False, weights, None, last)


def lookup_bag(packed: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, mode: int,
               per_sample_weights: torch.Tensor | None, include_last_offset: bool, precision: str):
    """``aten.embedding_bag`` over ``packed`` rows; returns the bag op's 4-tuple (only [0] is meaningful)."""
    if precision == "fp16":
        weights = per_sample_weights.half() if per_sample_weights is not None else None
        pooled = torch.ops.aten._embedding_bag_forward_only(packed, indices, offsets, False, mode, False, weights,
                                                             include_last_offset, -1)[0].float()
    else:
        pooled = _quantized_sum(packed, indices, offsets, per_sample_weights, include_last_offset, precision)
        if mode == 1:  # the quantized kernels only sum: a mean divides by the bag's size (empty bags stay 0)
            if include_last_offset:
                sizes = offsets[1:] - offsets[:-1]
            else:
                # NOTE: sizes from a roll, not a slice + cat: a slice's length (B - 1 + 1) is not B to
                # torch.export, which would then guard the batch to != 1 when host.pt2 is exported.
                last = torch.arange(offsets.shape[0], device=offsets.device) == offsets.shape[0] - 1
                ends = torch.where(last, torch.full_like(offsets, indices.numel()), torch.roll(offsets, -1))
                sizes = ends - offsets
            pooled = pooled / sizes.clamp(min=1).unsqueeze(1).to(pooled.dtype)
    empty = indices.new_empty(0)
    return pooled, empty, empty, empty


def lookup_rows(packed: torch.Tensor, indices: torch.Tensor, precision: str) -> torch.Tensor:
    """``aten.embedding`` over ``packed`` rows: [*indices.shape, dim] fp32."""
    if precision == "fp16":
        return torch.ops.aten.embedding(packed, indices).float()
    flat = indices.reshape(-1)
    offsets = torch.arange(flat.numel(), dtype=flat.dtype, device=flat.device)
    rows = _quantized_sum(packed, flat, offsets, None, False, precision)
    return rows.reshape(*indices.shape, rows.shape[-1])


# A rewritten graph's lookups are still lookups (the cut, the id check and the drawing find them).
EMBEDDING_OPS.update({lookup_bag, lookup_rows})


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _owner(root: torch.nn.Module, target: str) -> tuple[torch.nn.Module, str]:
    *parents, leaf = target.split(".")
    for part in parents:
        root = getattr(root, part)
    return root, leaf


def quantize_host_graph(host: fx.GraphModule, precision: str) -> fx.GraphModule:
    """A copy of ``host`` whose every lookup reads ``precision`` rows (module docstring); ``host`` is unchanged.

    ValueError names a lookup that cannot be converted (max pooling, padding_idx,
    already quantized, a weight that is not a 2-D float attribute).
    """
    if precision not in LOOKUP_PRECISIONS:
        raise ValueError(f"unknown table precision {precision!r}; known: {', '.join(LOOKUP_PRECISIONS)}")
    module = copy.deepcopy(host)
    if precision == "fp32":
        return module
    graph = module.graph
    lookups = [n for n in graph.nodes if is_embedding_lookup(n)]
    if not lookups:
        raise ValueError("the host graph has no embedding lookup to quantize")
    packed_names: dict[str, str] = {}
    for i, node in enumerate(lookups):
        kind = node.target._opname if hasattr(node.target, "_opname") else str(node.target)
        weight = node.args[0]
        where = f"lookup {node.name} ({kind})"
        if getattr(node.target, "namespace", None) != "aten" or kind not in _BAGS | {"embedding"}:
            raise ValueError(f"{where}: only aten embedding lookups can be converted to {precision}")
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            raise ValueError(f"{where}: its table is not a module attribute, so it cannot be converted")
        owner, leaf = _owner(module, str(weight.target))
        table = getattr(owner, leaf)
        if not isinstance(table, torch.Tensor) or table.dim() != 2 or not table.is_floating_point():
            raise ValueError(f"{where}: its table is not a 2-D float tensor")
        if str(weight.target) not in packed_names:
            name = f"_sixfold_{precision}_{i}"
            module.register_buffer(name, _pack(table, precision))
            packed_names[str(weight.target)] = name
        with graph.inserting_before(node):
            packed = graph.get_attr(packed_names[str(weight.target)])
            if kind == "embedding":
                padding = _arg(node, 2, "padding_idx", -1)
                if padding is not None and padding >= 0:
                    raise ValueError(f"{where}: padding_idx={padding} cannot be converted to {precision}")
                new = graph.call_function(lookup_rows, (packed, node.args[1], precision))
            else:
                mode = _arg(node, 4, "mode", 0)
                padding = _arg(node, 8, "padding_idx", None)
                if mode not in (0, 1):
                    raise ValueError(f"{where}: {_MODES.get(mode, mode)} pooling cannot be converted to {precision} "
                                     "(sum and mean can)")
                if padding is not None and padding >= 0:
                    raise ValueError(f"{where}: padding_idx={padding} cannot be converted to {precision}")
                new = graph.call_function(lookup_bag, (
                    packed, node.args[1], _arg(node, 2, "offsets", None), mode,
                    _arg(node, 6, "per_sample_weights", None), bool(_arg(node, 7, "include_last_offset", False)),
                    precision))
        new.meta = dict(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    used = {str(n.target) for n in graph.nodes if n.op == "get_attr"}
    for target in list(packed_names):  # the fp32 tables nothing reads any more
        if target not in used:
            owner, leaf = _owner(module, target)
            if leaf in owner._parameters:
                del owner._parameters[leaf]
            elif leaf in owner._buffers:
                del owner._buffers[leaf]
            else:
                delattr(owner, leaf)
    module.recompile()
    return module


def quantize_lookups(partitioned, precision: str) -> None:
    """Serve ``partitioned``'s torch host graph with ``precision`` lookups (``--table-precision`` on a model file).

    In place: the host artifact becomes the rewritten graph (metadata
    ``precision``), the plan records ``tables["precision"]`` and the host's
    weight bytes. ``partitioned.split.host`` stays fp32 (the accuracy reference).
    """
    from sixfold.partitioner.partitioned import HOST_PARTITION
    from sixfold.partitioner.pricing.cost import module_param_bytes

    if precision == "fp32":
        return
    if partitioned.split is None:
        raise ValueError("table precision for this model needs its torch host graph")
    old = partitioned.artifacts[HOST_PARTITION]
    if old.format != "torch-fx" or old.metadata.get("precision", "fp32") != "fp32":
        raise ValueError(f"the host partition is {old.format} {old.metadata.get('precision', 'fp32')}; "
                         "convert from the fp32 torch graph only")
    module = quantize_host_graph(partitioned.split.host, precision).eval()
    param_bytes = module_param_bytes(module)
    partitioned.artifacts[HOST_PARTITION] = dataclasses.replace(
        old, payload=module, param_bytes=param_bytes, metadata={**old.metadata, "precision": precision})
    partitioned.plan.resize_partition(HOST_PARTITION, param_bytes)
    partitioned.plan.tables["precision"] = precision
