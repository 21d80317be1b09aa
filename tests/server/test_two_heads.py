"""docs/bring-your-own-model.md step 7, run: a click + conversion model (two outputs) exported with
torch.export, partitioned by sixfold-partition and served by a real sixfold-serve. Every output is served
under the model's own name, listed in metadata and config, and chosen by the client over gRPC and REST."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from sixfold.partitioner.cli import main as partition_main
from tests.conftest import ServeProcess, free_port, triton_inputs

DOC = Path(__file__).resolve().parents[2] / "docs" / "bring-your-own-model.md"
HEADS = ["click", "conversion"]


def _blocks() -> dict[str, str]:
    return {name: code for name, code in re.findall(r"<!-- heads: ([\w-]+) -->\n```\w+\n(.*?)```", DOC.read_text(), re.S)}


def test_the_page_marks_each_step() -> None:
    assert tuple(_blocks()) == ("model", "partition", "query")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The page's two-head model, exported and partitioned in a temporary folder, served by sixfold-serve."""
    folder = tmp_path_factory.mktemp("two_heads")
    blocks, scope = _blocks(), {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        exec(compile(blocks["model"], f"{DOC.name}:heads-model", "exec"), scope)  # noqa: S102 - the page's code
        for line in blocks["partition"].strip().splitlines():
            argv = shlex.split(line)
            assert argv[0] == ".venv/bin/sixfold-partition"
            assert partition_main(argv[1:]) == 0
    http = free_port()
    process = ServeProcess("--model-repository", str(folder / "repo"), "--grpc-port", "0", "--http-port", str(http),
                           "--metrics-port", str(free_port()), cwd=folder, timeout=120)
    try:
        assert process.url, "".join(process.lines)
        yield folder, scope, process, f"127.0.0.1:{http}"
    finally:
        process.stop()


def test_the_plan_lists_every_output_under_the_models_names(served) -> None:
    folder, _, _, _ = served
    plan = json.loads((folder / "repo" / "heads" / "1" / "plan.json").read_text())
    assert [(t["name"], t["shape"], t["rows_per_item"]) for t in plan["outputs"]] == [
        ("click", [-1, 1], 1), ("conversion", [-1, 2], 1)]
    dense = next(p for p in plan["partitions"] if p["name"] == "dense")
    assert [t["name"] for t in dense["outputs"]] == HEADS
    import onnx
    assert [o.name for o in onnx.load(str(folder / "repo" / "heads" / "1" / "dense.onnx")).graph.output] == HEADS


def test_metadata_and_config_list_both_outputs(served) -> None:
    import tritonclient.grpc as tc
    _, _, process, _ = served
    client = tc.InferenceServerClient(process.url)
    metadata = client.get_model_metadata("heads", as_json=True)
    assert [(o["name"], o["datatype"], o["shape"]) for o in metadata["outputs"]] == [
        ("click", "FP32", ["-1", "1"]), ("conversion", "FP32", ["-1", "2"])]
    config = client.get_model_config("heads", as_json=True)["config"]
    assert [o["name"] for o in config["output"]] == HEADS


def test_the_page_query_asks_for_each_output_and_both(served) -> None:
    import tritonclient.grpc as tc
    _, scope, process, _ = served
    client = tc.InferenceServerClient(process.url)
    exec(compile(_blocks()["query"], f"{DOC.name}:heads-query", "exec"),  # noqa: S102 - asserts inside
         {**scope, "tc": tc, "client": client})


def test_no_output_named_gets_every_output_and_an_unknown_one_names_the_outputs(served) -> None:
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException
    _, scope, process, _ = served
    client = tc.InferenceServerClient(process.url)
    req = scope["heads_request"](3, seed=5)
    result = client.infer("heads", triton_inputs(tc, req), client_timeout=30)
    with torch.inference_mode():
        mine = scope["two_heads"](*(torch.from_numpy(req[k]) for k in req))
    for name in HEADS:
        np.testing.assert_allclose(result.as_numpy(name), mine[name].numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InferenceServerException, match="unknown output.*click.*conversion"):
        client.infer("heads", triton_inputs(tc, req), outputs=[tc.InferRequestedOutput("scores")],
                     client_timeout=30)


def test_rest_chooses_an_output_too(served) -> None:
    import tritonclient.http as th
    _, scope, _, http = served
    client = th.InferenceServerClient(http)
    req = scope["heads_request"](7, seed=9)
    result = client.infer("heads", triton_inputs(th, req), outputs=[th.InferRequestedOutput("conversion")])
    with torch.inference_mode():
        mine = scope["two_heads"](*(torch.from_numpy(req[k]) for k in req))
    assert result.as_numpy("click") is None
    np.testing.assert_allclose(result.as_numpy("conversion"), mine["conversion"].numpy(), rtol=1e-5, atol=1e-6)


def _infer_retrying(grpc, tc, req: dict, wanted: list[str], tries: int = 40):
    """One request, sent again (at most ``tries`` times) while the server says RESOURCE_EXHAUSTED: on 2 shared
    cores, 8 clients of 700-item requests overrun the default work bound, a refusal meant to be retried."""
    import time

    from tritonclient.utils import InferenceServerException
    for attempt in range(tries):
        try:
            return grpc.infer("heads", triton_inputs(tc, req), outputs=[tc.InferRequestedOutput(n) for n in wanted],
                              client_timeout=30)
        except InferenceServerException as exc:
            if "RESOURCE_EXHAUSTED" not in str(exc.status()) or attempt == tries - 1:
                raise
            time.sleep(0.1 * (1 + attempt % 5))
    raise AssertionError("unreachable")


def test_eight_concurrent_clients_at_1_to_700_items_get_their_own_heads(served) -> None:
    """Batches merge requests asking for different heads; each answer is its own request's rows."""
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.grpc as tc
    _, scope, process, _ = served
    sizes = (1, 2, 3, 7, 64, 700, 5, 130)
    choices = (["click"], ["conversion"], HEADS)

    def client(k: int) -> float:
        grpc, worst = tc.InferenceServerClient(process.url), 0.0
        for j in range(3):
            items, wanted = sizes[(k + j) % len(sizes)], choices[(k + j) % len(choices)]
            req = scope["heads_request"](items, seed=100 * k + j)
            with torch.inference_mode():
                mine = scope["two_heads"](*(torch.from_numpy(req[key]) for key in req))
            result = _infer_retrying(grpc, tc, req, wanted)
            for name in HEADS:
                got = result.as_numpy(name)
                assert (got is not None) == (name in wanted), (name, wanted)
                if got is not None:
                    assert got.shape == tuple(mine[name].shape), (name, items, got.shape)
                    worst = max(worst, float(np.max(np.abs(got - mine[name].numpy()))))
        return worst

    with ThreadPoolExecutor(8) as pool:
        worst = max(pool.map(client, range(8), timeout=60))
    assert worst < 1e-5, worst
