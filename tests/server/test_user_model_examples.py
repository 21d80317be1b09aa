"""docs/bring-your-own-model.md step 8, run: weighted bags, a table shared by two features and hashed ids in one
model, exported as .pt2 and ONNX (its EmbeddingBag Loops vectorised on the host), partitioned by
sixfold-partition, served by a real sixfold-serve and answered over gRPC like the model's own forward
(1..700 items, empty bags included, and 8 clients at once)."""

from __future__ import annotations

import json
import re
import shlex
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tritonclient.utils import InferenceServerException

from sixfold.partitioner.cli import main as partition_main
from tests.conftest import ServeProcess, free_port, triton_inputs

DOC = Path(__file__).resolve().parents[2] / "docs" / "bring-your-own-model.md"
STEPS = ("model", "partition", "query")


def blocks(marker: str) -> dict[str, str]:
    pattern = rf"<!-- {marker}: ([\w-]+) -->\n```\w+\n(.*?)```"
    return dict(re.findall(pattern, DOC.read_text(), re.S))


def serve_page(marker: str, folder: Path, model_steps: tuple[str, ...]) -> tuple[dict, ServeProcess]:
    """Run the page's model blocks and its sixfold-partition lines in ``folder``; serve the repository they wrote."""
    code, scope = blocks(marker), {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        for step in model_steps:
            exec(compile(code[step], f"{DOC.name}:{marker}:{step}", "exec"), scope)  # noqa: S102 - the page's code
        for line in code["partition"].strip().splitlines():
            argv = shlex.split(line)
            assert argv[0] == ".venv/bin/sixfold-partition"
            assert partition_main(argv[1:]) == 0, line
    process = ServeProcess("--model-repository", str(folder / "repo"), "--grpc-port", "0",
                           "--metrics-port", str(free_port()), cwd=folder, timeout=120)
    return scope, process


def grpc_infer(url: str):
    import tritonclient.grpc as tc
    client = tc.InferenceServerClient(url)

    def infer(name: str, req: dict) -> np.ndarray:
        for _ in range(40):  # bounded: a 2-core host sheds load (RESOURCE_EXHAUSTED) under 8 clients; try again
            try:
                return client.infer(name, triton_inputs(tc, req), client_timeout=30).as_numpy("scores")
            except InferenceServerException as err:
                if err.status() != "StatusCode.RESOURCE_EXHAUSTED":
                    raise
                time.sleep(0.05)
        raise AssertionError(f"{name}: still RESOURCE_EXHAUSTED after 40 tries")
    return infer


def test_the_page_marks_each_step() -> None:
    assert tuple(blocks("more")) == STEPS


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_model_examples")
    scope, process = serve_page("more", folder, ("model",))
    try:
        assert process.url, "".join(process.lines)
        yield folder, scope, process
    finally:
        process.stop()


def test_the_onnx_bags_are_host_lookups(served) -> None:
    folder, _, _ = served
    plan = json.loads((folder / "repo" / "mixed_onnx" / "1" / "plan.json").read_text())
    dense = next(p for p in plan["partitions"] if p["name"] == "dense")
    assert dense["unsplittable"] == ""  # every card input is per item: the pooling is on the host
    assert all(t["rows_per_item"] == 1 for t in dense["inputs"]), dense["inputs"]
    import onnx
    ops = {n.op_type for n in onnx.load(str(folder / "repo" / "mixed_onnx" / "1" / "dense.onnx")).graph.node}
    assert not ops & {"Loop", "If", "SequenceInsert", "ConcatFromSequence"}, ops


def test_the_page_query_runs_against_the_server(served) -> None:
    _, scope, process = served
    exec(compile(blocks("more")["query"], f"{DOC.name}:more:query", "exec"),  # noqa: S102 - asserts inside
         {**scope, "infer": grpc_infer(process.url)})


def test_eight_concurrent_clients_get_the_models_answers(served) -> None:
    _, scope, process = served
    sizes = (1, 2, 3, 7, 64, 700, 5, 130)

    def client(k: int) -> float:
        infer, worst = grpc_infer(process.url), 0.0
        for j in range(3):
            req = scope["mixed_request"](sizes[(k + j) % len(sizes)], seed=100 * k + j)
            with torch.inference_mode():
                mine = scope["mixed"](*(torch.from_numpy(req[key]) for key in req)).numpy()
            for name in ("mixed", "mixed_onnx"):
                got = infer(name, req)
                assert got.shape == mine.shape, (name, got.shape)
                worst = max(worst, float(np.max(np.abs(got - mine))))
        return worst

    with ThreadPoolExecutor(8) as pool:
        worst = max(pool.map(client, range(8), timeout=90))
    assert worst < 1e-5, worst
    log = "".join(process.lines)
    assert "out of rotation" not in log and "cannot split" not in log, log[-2000:]
