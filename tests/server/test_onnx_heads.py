"""Issue 31.4 for ONNX: a click + conversion model exported with torch.onnx.export (dynamo and legacy exporters),
partitioned by sixfold-partition and served by a real sixfold-serve. Both outputs are served under the model's
names, listed in metadata and config, chosen by the client over gRPC and REST, and answer like ONNX Runtime on
the original file at 1..700 items with 8 concurrent clients (default server settings)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from sixfold.partitioner.cli import main as partition_main
from tests.conftest import ServeProcess, free_port, triton_inputs

TABLES, ROWS, DIM, DENSE_IN = 3, 60, 8, 4
HEADS = ["click", "conversion"]
EXPORTERS = {"heads_dynamo": True, "heads_legacy": False}


class ClickAndConversion(nn.Module):
    """Two heads over one shared bottom; jagged bags found by the cumulative-sum form (no repeat_interleave)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.bags = nn.ModuleList(nn.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(TABLES))
        self.bottom = nn.Sequential(nn.Linear(DENSE_IN, DIM), nn.ReLU())
        self.click = nn.Linear(DIM * (TABLES + 1), 1)
        self.conversion = nn.Linear(DIM * (TABLES + 1), 2)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        per_bag, count = sparse_lengths.reshape(-1).long(), sparse_indices.shape[0]
        starts = torch.cumsum(per_bag, 0) - per_bag
        # NOTE: scatter_add, not index_add: the legacy exporter writes index_add as a ScatterND that drops
        # repeated indices (two empty bags start at one position), a wrong model at any batch with empty bags.
        marks = torch.zeros(count + 1, dtype=torch.long).scatter_add(0, starts, torch.ones_like(starts))
        table_of_id = (torch.cumsum(marks[:count], 0) - 1) % TABLES
        pooled = []
        for t, bag in enumerate(self.bags):
            lengths = sparse_lengths[:, t].long()
            pooled.append(bag(sparse_indices[table_of_id == t], torch.cumsum(lengths, 0) - lengths))
        x = torch.cat([self.bottom(dense_features), *pooled], dim=1)
        return torch.sigmoid(self.click(x)), torch.sigmoid(self.conversion(x))


def heads_request(items: int, seed: int) -> dict[str, np.ndarray]:
    """0 to 2 ids per (item, table): empty bags included."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 3, size=(items, TABLES)).astype(np.int32)
    return {"dense_features": rng.standard_normal((items, DENSE_IN)).astype(np.float32),
            "sparse_lengths": lengths,
            "sparse_indices": rng.integers(0, ROWS, size=int(lengths.sum())).astype(np.int64)}


def export(model: nn.Module, path: str, dynamo: bool) -> None:
    example = heads_request(4, seed=0)
    args = tuple(torch.from_numpy(example[k]) for k in example)
    if dynamo:
        batch, ids = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("ids", min=1, max=1 << 20)
        shapes = {"dense_features": {0: batch}, "sparse_lengths": {0: batch}, "sparse_indices": {0: ids}}
        torch.onnx.export(model, args, path, dynamo=True, input_names=list(example), output_names=HEADS,
                          dynamic_shapes=shapes)
    else:
        axes = {"dense_features": {0: "batch"}, "sparse_lengths": {0: "batch"}, "sparse_indices": {0: "ids"},
                **{h: {0: "batch"} for h in HEADS}}
        torch.onnx.export(model, args, path, dynamo=False, input_names=list(example), output_names=HEADS,
                          dynamic_axes=axes)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Both exports partitioned into one repository and served by one sixfold-serve (default settings)."""
    import onnxruntime as ort
    folder = tmp_path_factory.mktemp("onnx_heads")
    model = ClickAndConversion().eval()
    originals = {}
    for name, dynamo in EXPORTERS.items():
        path = str(folder / f"{name}.onnx")
        export(model, path, dynamo)
        assert partition_main([path, "--cards", "2", "--out", str(folder / "repo" / name / "1")]) == 0, name
        originals[name] = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    http = free_port()
    process = ServeProcess("--model-repository", str(folder / "repo"), "--grpc-port", "0", "--http-port", str(http),
                           "--metrics-port", str(free_port()), cwd=folder, timeout=120)
    try:
        assert process.url, "".join(process.lines)
        yield folder, originals, process, f"127.0.0.1:{http}"
    finally:
        process.stop()


@pytest.mark.parametrize("name", list(EXPORTERS))
def test_the_plan_and_dense_onnx_list_both_heads_and_the_cards_get_only_card_ops(served, name) -> None:
    from sixfold.backends.conformance.ops import dense_ops
    folder, _, _, _ = served
    plan = json.loads((folder / "repo" / name / "1" / "plan.json").read_text())
    assert [(t["name"], t["shape"], t["rows_per_item"]) for t in plan["outputs"]] == [
        ("click", [-1, 1], 1), ("conversion", [-1, 2], 1)]
    dense = next(p for p in plan["partitions"] if p["name"] == "dense")
    assert [t["name"] for t in dense["outputs"]] == HEADS
    graph = onnx.load(str(folder / "repo" / name / "1" / "dense.onnx")).graph
    assert [o.name for o in graph.output] == HEADS
    card_ops = {use["op"] for use in dense_ops()["ops"]} | {"Constant"}
    assert {n.op_type for n in graph.node} <= card_ops, {n.op_type for n in graph.node} - card_ops


@pytest.mark.parametrize("name", list(EXPORTERS))
def test_metadata_and_config_list_both_outputs(served, name) -> None:
    import tritonclient.grpc as tc
    _, _, process, _ = served
    client = tc.InferenceServerClient(process.url)
    metadata = client.get_model_metadata(name, as_json=True)
    assert [(o["name"], o["datatype"], o["shape"]) for o in metadata["outputs"]] == [
        ("click", "FP32", ["-1", "1"]), ("conversion", "FP32", ["-1", "2"])]
    assert [o["name"] for o in client.get_model_config(name, as_json=True)["config"]["output"]] == HEADS


def test_rest_chooses_one_output_and_gets_every_output_when_none_is_named(served) -> None:
    import tritonclient.http as th
    _, originals, _, http = served
    client = th.InferenceServerClient(http)
    for name, original in originals.items():
        req = heads_request(7, seed=9)
        want = dict(zip(HEADS, original.run(HEADS, req)))
        chosen = client.infer(name, triton_inputs(th, req), outputs=[th.InferRequestedOutput("conversion")])
        assert chosen.as_numpy("click") is None
        np.testing.assert_allclose(chosen.as_numpy("conversion"), want["conversion"], rtol=1e-5, atol=1e-6)
        every = client.infer(name, triton_inputs(th, req))
        for head in HEADS:
            np.testing.assert_allclose(every.as_numpy(head), want[head], rtol=1e-5, atol=1e-6)


def test_an_unknown_output_is_refused_naming_the_models_outputs(served) -> None:
    import tritonclient.grpc as tc
    from tritonclient.utils import InferenceServerException
    _, _, process, _ = served
    client = tc.InferenceServerClient(process.url)
    with pytest.raises(InferenceServerException, match="unknown output.*click.*conversion"):
        client.infer("heads_dynamo", triton_inputs(tc, heads_request(2, seed=1)),
                     outputs=[tc.InferRequestedOutput("scores")], client_timeout=30)


def _infer_retrying(client, tc, name: str, req: dict, wanted: list[str], tries: int = 40):
    """One request, sent again (at most ``tries`` times) while the server sheds load with RESOURCE_EXHAUSTED:
    on 2 shared cores, 8 clients of 700-item requests overrun the default work bound, a refusal meant to be retried."""
    from tritonclient.utils import InferenceServerException
    for attempt in range(tries):
        try:
            return client.infer(name, triton_inputs(tc, req), outputs=[tc.InferRequestedOutput(n) for n in wanted],
                                client_timeout=30)
        except InferenceServerException as exc:
            if "RESOURCE_EXHAUSTED" not in str(exc.status()) or attempt == tries - 1:
                raise
            time.sleep(0.1 * (1 + attempt % 5))
    raise AssertionError("unreachable")


def test_eight_concurrent_grpc_clients_at_1_to_700_items_get_onnx_runtimes_answers(served) -> None:
    """Batches merge requests for different heads of both exports; each answer equals ONNX Runtime's on the file."""
    import tritonclient.grpc as tc
    _, originals, process, _ = served
    sizes = (1, 2, 3, 7, 64, 700, 5, 130)
    choices = (["click"], ["conversion"], HEADS)
    names = list(EXPORTERS)

    def client(k: int) -> float:
        grpc, worst = tc.InferenceServerClient(process.url), 0.0
        for j in range(3):
            items, wanted = sizes[(k + j) % len(sizes)], choices[(k + j) % len(choices)]
            name = names[(k + j) % len(names)]
            req = heads_request(items, seed=100 * k + j)
            want = dict(zip(HEADS, originals[name].run(HEADS, req)))
            result = _infer_retrying(grpc, tc, name, req, wanted)
            for head in HEADS:
                got = result.as_numpy(head)
                assert (got is not None) == (head in wanted), (name, head, wanted)
                if got is not None:
                    assert got.shape == want[head].shape, (name, head, items, got.shape)
                    worst = max(worst, float(np.max(np.abs(got - want[head]))))
        return worst

    with ThreadPoolExecutor(8) as pool:
        worst = max(pool.map(client, range(8), timeout=120))
    assert worst < 1e-5, worst
