"""docs/bring-your-own-model.md step 6, run: a one-hot DLRM that reads the batch on both sides of the cut,
and nn.Embedding followed by index_add pooling, exported with torch.export, partitioned by sixfold-partition,
served by a real sixfold-serve, and answered over gRPC like the models' own forward (batch sizes 1..700,
8 clients at once)."""

from __future__ import annotations

import json
import re
import shlex
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from sixfold.partitioner.cli import main as partition_main
from tests.conftest import ServeProcess, free_port, triton_inputs

DOC = Path(__file__).resolve().parents[2] / "docs" / "bring-your-own-model.md"
STEPS = ("onehot", "pooled", "partition", "query")


def _blocks() -> dict[str, str]:
    return {name: code for name, code in re.findall(r"<!-- example: ([\w-]+) -->\n```\w+\n(.*?)```", DOC.read_text(), re.S)}


def test_the_page_marks_each_example_step() -> None:
    assert tuple(_blocks()) == STEPS


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The page's two models, exported and partitioned in a temporary folder, served by sixfold-serve."""
    folder = tmp_path_factory.mktemp("cross_cut")
    blocks, scope = _blocks(), {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        for step in ("onehot", "pooled"):
            exec(compile(blocks[step], f"{DOC.name}:{step}", "exec"), scope)  # noqa: S102 - the page's own code
        for line in blocks["partition"].strip().splitlines():
            argv = shlex.split(line)
            assert argv[0] == ".venv/bin/sixfold-partition"
            assert partition_main(argv[1:]) == 0
    process = ServeProcess("--model-repository", str(folder / "repo"), "--grpc-port", "0",
                           "--metrics-port", str(free_port()), cwd=folder, timeout=120)
    try:
        assert process.url, "".join(process.lines)
        yield folder, scope, process
    finally:
        process.stop()


def _infer(url: str):
    import tritonclient.grpc as tc
    client = tc.InferenceServerClient(url)

    def infer(name: str, req: dict) -> np.ndarray:
        return client.infer(name, triton_inputs(tc, req), client_timeout=30).as_numpy("scores")
    return infer


def test_plans_say_each_crossing_tensors_rows_per_item(served) -> None:
    folder, _, _ = served
    for name, boundary in (("onehot", "host_embedding_bag"), ("pooled", "host_index_add")):
        plan = json.loads((folder / "repo" / name / "1" / "plan.json").read_text())
        dense = next(p for p in plan["partitions"] if p["name"] == "dense")
        assert dense["unsplittable"] == ""
        layouts = {t["name"]: (t["rows_per_item"], t["ragged_by"]) for t in dense["inputs"] + dense["outputs"]}
        assert layouts[boundary] == (1, None) and layouts["scores"] == (1, None), layouts
        model_inputs = {t["name"]: (t["rows_per_item"], t["ragged_by"]) for t in plan["inputs"]}
        assert model_inputs["dense_features"] == (1, None)
    onehot = json.loads((folder / "repo" / "onehot" / "1" / "plan.json").read_text())
    assert {t["name"]: t["rows_per_item"] for t in onehot["inputs"]}["sparse_indices"] == 4  # batch * TABLES
    pooled = json.loads((folder / "repo" / "pooled" / "1" / "plan.json").read_text())
    assert {t["name"]: t["ragged_by"] for t in pooled["inputs"]}["sparse_indices"] == "sparse_lengths"
    host = next(p for p in pooled["partitions"] if p["name"] == "sparse")
    assert [t["name"] for t in host["outputs"]] == ["host_index_add"]  # the pooling moved to the host


def test_the_page_query_runs_against_the_server(served) -> None:
    _, scope, process = served
    exec(compile(_blocks()["query"], f"{DOC.name}:query", "exec"),  # noqa: S102 - asserts inside
         {**scope, "infer": _infer(process.url)})


def test_eight_concurrent_clients_get_their_own_models_answers(served) -> None:
    _, scope, process = served
    sizes = (1, 2, 3, 7, 64, 700, 5, 130)

    def client(k: int) -> float:
        infer, worst = _infer(process.url), 0.0
        for j in range(4):
            items = sizes[(k + j) % len(sizes)]
            for name, model, make in (("onehot", scope["onehot"], scope["onehot_request"]),
                                      ("pooled", scope["pooled_model"], scope["jagged_request"])):
                req = make(items, seed=100 * k + j)
                with torch.inference_mode():
                    mine = model(*(torch.from_numpy(req[key]) for key in req)).numpy()
                got = infer(name, req)
                assert got.shape == mine.shape, (name, items, got.shape)
                worst = max(worst, float(np.max(np.abs(got - mine))))
        return worst

    with ThreadPoolExecutor(8) as pool:
        worst = max(pool.map(client, range(8), timeout=60))
    assert worst < 1e-5, worst
    log = "".join(process.lines)
    assert "out of rotation" not in log and "cannot split" not in log, log[-2000:]


def test_the_vendor_page_documents_every_layout_field() -> None:
    import dataclasses

    from sixfold.backends.api import TensorLayout
    page = (DOC.parent / "vendor.md").read_text()
    for field in dataclasses.fields(TensorLayout):
        assert f"| `{field.name}` |" in page, field.name
    assert "artifact.layouts" in page and "`unsplittable`" in page
