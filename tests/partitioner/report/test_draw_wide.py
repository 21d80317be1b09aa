"""--draw of a 26-table DLRM looked up table by table stays readable: repeated lookups are collapsed."""

from __future__ import annotations

from PIL import Image

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_model
from sixfold.partitioner.report import draw
from tests.partitioner.report.wide_dlrm import TABLES, PerTableDLRM, example


def test_a_26_table_drawing_stays_under_4000_px_and_names_the_collapsed_lookups(tmp_path, monkeypatch) -> None:
    partitioned = partition_model("wide", PerTableDLRM().eval(), example, cards=[load_spec("m2-card")] * 2,
                                  host=load_spec("host-cpu"), compile=False)
    png = draw.draw_partitioned(partitioned, tmp_path / "wide.png", title="26 tables")
    width, _ = Image.open(png).size
    assert width <= 4000, width
    nodes = [n for n in partitioned.graph.graph.nodes if n in partitioned.labels]
    names = {n: str(getattr(n.target, "__name__", n.target)).replace("aten.", "").split(".")[0] for n in nodes}
    depth = draw._layers(nodes, {n: list(n.all_input_nodes) for n in nodes})
    _, _, shown = draw._collapse(nodes, {n: list(n.all_input_nodes) for n in nodes}, names,
                                 partitioned.labels, depth)
    assert f"embedding_bag x{TABLES - 1}" in shown.values()
    monkeypatch.setattr(draw, "COLLAPSE_OVER", 10**6)  # drawn one box per lookup, as before: unreadable
    assert Image.open(draw.draw_partitioned(partitioned, tmp_path / "all.png")).size[0] > 3 * width
