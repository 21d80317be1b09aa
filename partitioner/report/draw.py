"""Draw the plan: the model graph in topological layers, nodes coloured by partition, and its devices.

People read a picture of "what went where" faster than a node list. Weights
and constants are left out; edges that cross the cut (host -> card transfers)
are drawn thick. A pipelined dense part is coloured stage by stage. Beside the
graph (``draw_partitioned``), one box per device says what it holds: the host
stage, dense replicas or pipeline stages (with their replica), table shards
(table, rows, columns), and its estimated memory and time per batch
(``device_lines`` gives the same text as data).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx

from sixfold.partitioner.plan import PartitionPlan
from sixfold.partitioner.cut.sparse_dense import HOST

if TYPE_CHECKING:
    from sixfold.partitioner.partitioned import PartitionedModel

__all__ = ["draw_cut", "draw_onnx_cut", "draw_partitioned", "device_lines", "stage_labels"]

_COLOURS = {HOST: "#f28e2b", "dense": "#4e79a7"}
_STAGE_COLOURS = ("#59a14f", "#b07aa1", "#76b7b2", "#9c755f", "#edc948", "#e15759", "#bab0ac", "#ff9da7")


def _colour(label: str) -> str:
    if label in _COLOURS:
        return _COLOURS[label]
    if label.startswith("dense."):
        return _STAGE_COLOURS[int(label.rsplit(".", 1)[1]) % len(_STAGE_COLOURS)]
    return "#999999"


def _layers(nodes: Sequence[Hashable], inputs: dict[Hashable, list[Hashable]]) -> dict[Hashable, int]:
    depth: dict[Hashable, int] = {}
    for node in nodes:  # callers pass nodes in topological order
        depth[node] = 1 + max((depth[i] for i in inputs[node] if i in depth), default=-1)
    return depth


COLLAPSE_OVER = 2
"""Same op, same partition, same layer: more than this many are drawn as one ``op xN`` box (26 lookups of a
26-table DLRM drew 14,828 px wide; one box per kind keeps the drawing readable)."""


def _collapse(nodes: Sequence[Hashable], inputs: dict[Hashable, list[Hashable]], names: dict[Hashable, str],
              labels: dict, depth: dict[Hashable, int]) -> tuple[list[Hashable], dict, dict]:
    """Repeated nodes of one layer (same op and label) folded into the first and one ``op xN`` box for the rest."""
    groups: dict[tuple, list[Hashable]] = {}
    for node in nodes:
        groups.setdefault((depth[node], names[node], labels[node]), []).append(node)
    into: dict[Hashable, Hashable] = {}
    names = dict(names)
    for group in groups.values():
        if len(group) > COLLAPSE_OVER:
            rest = group[1:]
            names[rest[0]] = f"{names[rest[0]]} x{len(rest)}"
            into.update({n: rest[0] for n in rest[1:]})
    kept = [n for n in nodes if n not in into]
    merged: dict[Hashable, list[Hashable]] = {n: [] for n in kept}
    for node in nodes:
        target = into.get(node, node)
        for src in inputs[node]:
            src = into.get(src, src)
            if src not in merged[target]:
                merged[target].append(src)
    return kept, merged, names


def draw_cut(gm: fx.GraphModule, labels: dict[fx.Node, str], path: str | Path, *, title: str = "",
             plan: PartitionPlan | None = None) -> Path:
    """Write a PNG of ``gm`` with each node coloured by its label (HOST, dense or a stage "dense.k").

    With ``plan``, a devices panel beside the graph says what each device holds.
    """
    nodes = [n for n in gm.graph.nodes if n in labels and n.op not in ("get_attr", "output", "call_module")
             and not (n.op == "call_function" and "sym_size" in str(n.target))
             and not (not n.users and n.op == "call_function")]
    names = {}
    for node in nodes:
        name = node.name if node.op == "placeholder" else str(getattr(node.target, "__name__", node.target))
        names[node] = name.replace("aten.", "").split(".")[0]
    inputs = {n: list(n.all_input_nodes) for n in nodes}
    return _render(nodes, inputs, names, labels, path, title, plan=plan)


def stage_labels(partitioned: PartitionedModel) -> dict:
    """The model's node labels with each dense node's pipeline stage ("dense.k") where the plan has stages."""
    plan = partitioned.plan
    stages = plan.dense_stages()
    if len(stages) < 2:
        return dict(partitioned.labels)
    stage_of = {name: stage for stage in stages for name in plan.partition(stage).nodes}
    key = (lambda n: n) if partitioned.split is None else (lambda n: n.name)
    return {n: (stage_of.get(key(n), label) if label != HOST else label) for n, label in partitioned.labels.items()}


def draw_partitioned(partitioned: PartitionedModel, path: str | Path, *, title: str = "") -> Path:
    """Draw a partitioned model's cut, whichever frontend made it (torch graph or ONNX model), and its devices."""
    from sixfold.partitioner.partitioned import HOST_PARTITION
    labels = stage_labels(partitioned)
    if partitioned.split is not None:
        return draw_cut(partitioned.graph, labels, path, title=title, plan=partitioned.plan)
    boundary = [t.name for t in partitioned.plan.partition(HOST_PARTITION).outputs]
    return draw_onnx_cut(partitioned.graph, labels, path, title=title, boundary=boundary, plan=partitioned.plan)


def _shard_text(s) -> str:
    if s.kind == "row":
        return f"table {s.table} rows {s.row_start}:{s.row_end}"
    if s.kind == "column":
        return f"table {s.table} cols {s.col_start}:{s.col_end}"
    return f"table {s.table} (whole, {s.row_end} rows)"


def device_lines(plan: PartitionPlan) -> dict[str, list[str]]:
    """What each device holds, as the devices panel writes it: device id -> lines (title first)."""
    from sixfold.partitioner.report.explain import human_bytes
    estimates = {d.device: d for d in plan.estimates.per_device}
    stages = plan.dense_stages()
    kinds = {p.name: p.kind for p in plan.partitions}
    out: dict[str, list[str]] = {}
    precision = plan.tables.get("precision", "fp32")
    for device in plan.devices:
        lines = [f"{device.id} ({device.spec.name})"]
        for placement in (p for p in plan.placements if p.device == device.id):
            name = placement.partition
            if kinds.get(name) == "sparse":
                lines.append(f"{name}: host stage (lookups{'' if precision == 'fp32' else ', ' + precision})")
            elif len(stages) > 1:
                lines.append(f"{name}: pipeline stage {stages.index(name) + 1} of {len(stages)}, "
                             f"replica {placement.replica}")
            else:
                lines.append(f"{name}: replica {placement.replica}")
        shards = [s for s in plan.shards if s.device == device.id]
        if shards:
            lines.append(f"{len(shards)} table shard(s):")
            lines += [f"  {_shard_text(s)}" for s in shards[:8]]
            if len(shards) > 8:
                lines.append(f"  ... {len(shards) - 8} more")
        est = estimates.get(device.id)
        if est is None:
            lines.append("idle")
        else:
            lines.append(f"mem {human_bytes(est.memory_bytes)} / {human_bytes(est.memory_capacity)}, "
                         f"{est.batch_seconds * 1e3:.3f} ms/batch")
        out[device.id] = lines
    return out


def draw_onnx_cut(model: Any, labels: dict[str, str], path: str | Path, *, title: str = "",
                  boundary: Collection[str] | None = None, plan: PartitionPlan | None = None) -> Path:
    """Write a PNG of an ONNX ``model`` with each node coloured by ``labels`` (node name -> HOST or dense).

    Model inputs are drawn on the host side when a host node reads them, as
    placeholders are; Constant nodes are left out, like weights, and so are
    nodes without a label. ``boundary``: the tensors that cross the cut; only
    edges carrying one are drawn thick (default: every edge between labels).
    """
    initializers = {t.name for t in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.name in labels and n.op_type != "Constant"]
    producer = {t: n.name for n in nodes for t in n.output if t}
    labels, names = dict(labels), {n.name: n.op_type for n in nodes}
    keys: list[str] = []
    for vi in model.graph.input:
        readers = [n.name for n in nodes if vi.name in n.input]
        if vi.name not in initializers and readers:
            keys.append(producer.setdefault(vi.name, f"input:{vi.name}"))
            names[keys[-1]] = vi.name
            labels[keys[-1]] = HOST if any(labels[r] == HOST for r in readers) else labels[readers[0]]
    keys += [n.name for n in nodes]
    inputs = {k: [] for k in keys} | {n.name: [producer[t] for t in n.input if t in producer] for n in nodes}
    crosses = None
    if boundary is not None:
        carried = {(producer[t], n.name) for n in nodes for t in n.input if t in producer and t in set(boundary)}
        crosses = lambda src, dst: (src, dst) in carried  # noqa: E731
    return _render(keys, inputs, names, labels, path, title, crosses, plan=plan)


def _render(nodes: Sequence[Hashable], inputs: dict[Hashable, list[Hashable]], names: dict[Hashable, str],
            labels: dict, path: str | Path, title: str,
            crosses: Callable[[Hashable, Hashable], bool] | None = None, plan: PartitionPlan | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = _layers(nodes, inputs)
    nodes, inputs, names = _collapse(nodes, inputs, names, labels, depth)
    by_layer: dict[int, list[Hashable]] = {}
    for node in nodes:
        by_layer.setdefault(depth[node], []).append(node)
    pos = {n: (x - (len(row) - 1) / 2, -d) for d, row in by_layer.items() for x, n in enumerate(row)}
    width = max(len(row) for row in by_layer.values())
    size = (max(7, width * 2.2), max(6, len(by_layer) * 0.55))
    if plan is None:
        fig, ax = plt.subplots(figsize=size)
    else:
        fig, (ax, panel) = plt.subplots(1, 2, figsize=(size[0] + 5, max(size[1], 1.2 * len(plan.devices) + 1)),
                                        gridspec_kw={"width_ratios": [size[0], 5]})
        _devices_panel(panel, plan)
    for node in nodes:
        for src in inputs[node]:
            if src in pos:
                cut = crosses(src, node) if crosses else labels[src] != labels[node]
                (x0, y0), (x1, y1) = pos[src], pos[node]
                ax.plot([x0, x1], [y0, y1], color="#d62728" if cut else "#bbbbbb",
                        lw=2.5 if cut else 0.8, zorder=1)
    for node in nodes:
        x, y = pos[node]
        ax.text(x, y, names[node], ha="center", va="center", fontsize=7, zorder=2,
                bbox=dict(boxstyle="round,pad=0.3", fc=_colour(labels[node]), ec="none", alpha=0.9),
                color="white")
    shown = sorted(set(labels[n] for n in nodes), key=lambda k: (k != HOST, k))
    handles = [plt.Line2D([], [], marker="s", ls="", color=_colour(k), markersize=10,
                          label=f"{k} partition" if "." not in k else f"{k} (pipeline stage)") for k in shown]
    crossing = "crosses the cut (host -> card" + (", stage -> stage)" if any("." in k for k in shown) else ")")
    handles.append(plt.Line2D([], [], color="#d62728", lw=2.5, label=crossing))
    ax.legend(handles=handles, loc="lower left", fontsize=8)
    ax.set_title(title or "sparse/dense cut")
    ax.set_xlim(-width / 2 - 0.7, width / 2 + 0.7)
    ax.set_ylim(-max(by_layer) - 0.7, 0.7)
    ax.axis("off")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _devices_panel(ax: Any, plan: PartitionPlan) -> None:
    """One box per device, top to bottom: what it holds (``device_lines``), edged in its first partition's colour."""
    lines = device_lines(plan)
    kinds = {p.name: p.kind for p in plan.partitions}
    y = 1.0
    step = 1.0 / max(1, len(lines))
    for device, text in lines.items():
        held = [p.partition for p in plan.placements if p.device == device]
        label = HOST if held and kinds.get(held[0]) == "sparse" else (held[0] if held else "idle")
        if label == "dense" or (held and label.startswith("dense") and "." not in label):
            label = "dense"
        ax.text(0.02, y - 0.01, "\n".join(text), ha="left", va="top", fontsize=7, family="monospace",
                transform=ax.transAxes,
                bbox=dict(boxstyle="round,pad=0.4", fc="#f7f7f7", ec=_colour(label), lw=2))
        y -= step
    ax.set_title("devices: what each holds")
    ax.axis("off")
