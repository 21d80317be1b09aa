"""Draw the cut: the model graph in topological layers, nodes coloured by partition.

People read a picture of "what went where" faster than a node list. Weights
and constants are left out; edges that cross the cut (host -> card transfers)
are drawn thick.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import fx

from .sparse_dense import HOST

if TYPE_CHECKING:
    from .compile import PartitionedModel

__all__ = ["draw_cut", "draw_onnx_cut", "draw_partitioned"]

_COLOURS = {HOST: "#f28e2b", "dense": "#4e79a7"}


def _layers(nodes: Sequence[Hashable], inputs: dict[Hashable, list[Hashable]]) -> dict[Hashable, int]:
    depth: dict[Hashable, int] = {}
    for node in nodes:  # callers pass nodes in topological order
        depth[node] = 1 + max((depth[i] for i in inputs[node] if i in depth), default=-1)
    return depth


def draw_cut(gm: fx.GraphModule, labels: dict[fx.Node, str], path: str | Path, *, title: str = "") -> Path:
    """Write a PNG of ``gm`` with each node coloured by its label (HOST or dense)."""
    nodes = [n for n in gm.graph.nodes if n in labels and n.op not in ("get_attr", "output", "call_module")
             and not (n.op == "call_function" and "sym_size" in str(n.target))
             and not (not n.users and n.op == "call_function")]
    names = {}
    for node in nodes:
        name = node.name if node.op == "placeholder" else str(getattr(node.target, "__name__", node.target))
        names[node] = name.replace("aten.", "").split(".")[0]
    inputs = {n: list(n.all_input_nodes) for n in nodes}
    return _render(nodes, inputs, names, labels, path, title)


def draw_partitioned(partitioned: PartitionedModel, path: str | Path, *, title: str = "") -> Path:
    """Draw a partitioned model's cut, whichever frontend made it (torch graph or ONNX model)."""
    from .compile import HOST_PARTITION
    if partitioned.split is not None:
        return draw_cut(partitioned.graph, partitioned.labels, path, title=title)
    boundary = [t.name for t in partitioned.plan.partition(HOST_PARTITION).outputs]
    return draw_onnx_cut(partitioned.graph, partitioned.labels, path, title=title, boundary=boundary)


def draw_onnx_cut(model: Any, labels: dict[str, str], path: str | Path, *, title: str = "",
                  boundary: Collection[str] | None = None) -> Path:
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
    return _render(keys, inputs, names, labels, path, title, crosses)


def _render(nodes: Sequence[Hashable], inputs: dict[Hashable, list[Hashable]], names: dict[Hashable, str],
            labels: dict, path: str | Path, title: str,
            crosses: Callable[[Hashable, Hashable], bool] | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = _layers(nodes, inputs)
    by_layer: dict[int, list[Hashable]] = {}
    for node in nodes:
        by_layer.setdefault(depth[node], []).append(node)
    pos = {n: (x - (len(row) - 1) / 2, -d) for d, row in by_layer.items() for x, n in enumerate(row)}
    width = max(len(row) for row in by_layer.values())
    fig, ax = plt.subplots(figsize=(max(7, width * 2.2), max(6, len(by_layer) * 0.55)))
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
                bbox=dict(boxstyle="round,pad=0.3", fc=_COLOURS.get(labels[node], "#999999"), ec="none", alpha=0.9),
                color="white")
    handles = [plt.Line2D([], [], marker="s", ls="", color=c, markersize=10, label=f"{k} partition")
               for k, c in _COLOURS.items()]
    handles.append(plt.Line2D([], [], color="#d62728", lw=2.5, label="crosses the cut (host -> card)"))
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
