"""Draw the cut: the model graph in topological layers, nodes coloured by partition.

People read a picture of "what went where" faster than a node list. Weights
and constants are left out; edges that cross the cut (host -> card transfers)
are drawn thick.
"""

from __future__ import annotations

from pathlib import Path

from torch import fx

from .sparse_dense import HOST

__all__ = ["draw_cut"]

_COLOURS = {HOST: "#f28e2b", "dense": "#4e79a7"}


def _layers(nodes: list[fx.Node]) -> dict[fx.Node, int]:
    depth: dict[fx.Node, int] = {}
    for node in nodes:  # FX graphs are in topological order
        depth[node] = 1 + max((depth[i] for i in node.all_input_nodes if i in depth), default=-1)
    return depth


def draw_cut(gm: fx.GraphModule, labels: dict[fx.Node, str], path: str | Path, *, title: str = "") -> Path:
    """Write a PNG of ``gm`` with each node coloured by its label (HOST or dense)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nodes = [n for n in gm.graph.nodes if n in labels and n.op not in ("get_attr", "output", "call_module")
             and not (n.op == "call_function" and "sym_size" in str(n.target))
             and not (not n.users and n.op == "call_function")]
    depth = _layers(nodes)
    by_layer: dict[int, list[fx.Node]] = {}
    for node in nodes:
        by_layer.setdefault(depth[node], []).append(node)
    pos = {n: (x - (len(row) - 1) / 2, -d) for d, row in by_layer.items() for x, n in enumerate(row)}
    width = max(len(row) for row in by_layer.values())
    fig, ax = plt.subplots(figsize=(max(7, width * 2.2), max(6, len(by_layer) * 0.55)))
    for node in nodes:
        for src in node.all_input_nodes:
            if src in pos:
                crosses = labels[src] != labels[node]
                (x0, y0), (x1, y1) = pos[src], pos[node]
                ax.plot([x0, x1], [y0, y1], color="#d62728" if crosses else "#bbbbbb",
                        lw=2.5 if crosses else 0.8, zorder=1)
    for node in nodes:
        x, y = pos[node]
        name = node.name if node.op == "placeholder" else str(getattr(node.target, "__name__", node.target))
        name = name.replace("aten.", "").split(".")[0]
        ax.text(x, y, name, ha="center", va="center", fontsize=7, zorder=2,
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
