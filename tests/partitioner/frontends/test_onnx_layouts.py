"""ONNX plans carry their card inputs' layouts too (issue 31 item 2): observed at two batch sizes, and ragged
where the rows change with the ids per item. An ONNX export of nn.Embedding + index_add (the pooling on the
card side, one row per id) is never split across cards, and a 700-item batch of it answers like the model."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from torch import nn

from sixfold.backends.builtin.simcard import SimCardBackend
from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_file
from sixfold.server.execution.runtime import PlanRuntime
from sixfold.server.loading.loader import load_host_stage
from sixfold.server.scheduling.batcher import BatchInfo

T, D, E, R, P = 3, 4, 8, 40, 2


class EmbeddingIndexAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.bot, self.top = nn.Embedding(R, E), nn.Linear(D, E), nn.Linear(2 * E, 1)

    def forward(self, dense_features, sparse_lengths, sparse_indices):
        x = self.bot(dense_features)
        item_of_id = torch.arange(sparse_lengths.shape[0]).repeat_interleave(sparse_lengths.sum(1))
        pooled = torch.zeros_like(x).index_add(0, item_of_id, self.emb(sparse_indices))
        return torch.sigmoid(self.top(torch.cat([x, pooled], 1)))


def _request(items: int, seed: int, jagged: bool = False) -> dict[str, np.ndarray]:
    """P ids per (item, table), or (``jagged``) 0 to 3: what clients of a jagged model send."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 4, size=(items, T)) if jagged else np.full((items, T), P)
    return {"dense_features": rng.standard_normal((items, D)).astype(np.float32),
            "sparse_lengths": lengths.astype(np.int32),
            "sparse_indices": rng.integers(0, R, size=int(lengths.sum())).astype(np.int64)}


@pytest.fixture(scope="module")
def onnx_model(tmp_path_factory):
    model = EmbeddingIndexAdd().eval()
    path = tmp_path_factory.mktemp("onnx_layouts") / "embedding_index_add.onnx"
    example = tuple(torch.from_numpy(v) for v in _request(4, 0).values())
    batch, ids = torch.export.Dim("batch", min=1, max=4096), torch.export.Dim("ids", min=1, max=1 << 20)
    for noisy in ("torch.onnx", "onnxscript", "onnx_ir"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    torch.onnx.export(model, example, str(path), dynamo=True, verbose=False,
                      input_names=["dense_features", "sparse_lengths", "sparse_indices"], output_names=["scores"],
                      dynamic_shapes={"dense_features": {0: batch}, "sparse_lengths": {0: batch},
                                      "sparse_indices": {0: ids}})
    return model, partition_file(str(path), cards=2, pooling=P)


def test_a_per_id_card_input_is_ragged_and_the_plan_says_batches_stay_whole(onnx_model) -> None:
    _, partitioned = onnx_model
    dense = partitioned.plan.partition("dense")
    layouts = {t.name: (t.rows_per_item, t.ragged_by) for t in [*dense.inputs, *dense.outputs]}
    ragged = [n for n, layout in layouts.items() if layout == (None, "sparse_lengths")]
    assert ragged and layouts["dense_features"] == (1, None) and layouts["scores"] == (1, None), layouts
    assert f"'{ragged[0]}' is ragged (one row per id, counted by sparse_lengths)" in dense.unsplittable
    assert partitioned.artifacts["dense"].layouts[ragged[0]].ragged_by == "sparse_lengths"


async def test_a_large_batch_of_it_runs_whole_on_one_card_and_answers_like_the_model(onnx_model) -> None:
    model, partitioned = onnx_model
    backend, spec = SimCardBackend(), load_spec("m2-card")
    lanes = [backend.load(partitioned.artifacts["dense"], dataclasses.replace(spec, name=f"m2/card{i}"))
             for i in range(2)]
    runtime = PlanRuntime(load_host_stage(partitioned, load_spec("host-cpu")), lanes, host_dense_max_rows=0,
                          min_split_rows=64, card_scheduling="greedy")
    try:
        assert runtime.parts(700) == 1
        for items in (700, 7, 1):  # was: cannot split card input ... into items of a 700-item batch
            batch = _request(items, seed=items, jagged=True)
            out = await runtime.run(batch, BatchInfo())
            with torch.inference_mode():
                want = model(*(torch.from_numpy(v) for v in batch.values())).numpy()
            np.testing.assert_allclose(out["scores"], want, rtol=1e-5, atol=1e-6)
        assert runtime.card_state == ["healthy", "healthy"] and not runtime.fault_counts
    finally:
        runtime.close()


def test_served_over_grpc_jagged_requests_from_eight_clients_all_answer(onnx_model, tmp_path) -> None:
    """Issue 31's 163-of-200 failures: default server settings, sizes 1..700, 8 clients at once."""
    from concurrent.futures import ThreadPoolExecutor

    import tritonclient.grpc as tc

    from sixfold.partitioner.artifacts import write_artifacts
    from tests.conftest import ServeProcess, free_port, triton_inputs
    model, partitioned = onnx_model
    write_artifacts(partitioned, tmp_path / "repo" / "jagged" / "1")
    process = ServeProcess("--model-repository", str(tmp_path / "repo"), "--grpc-port", "0",
                           "--metrics-port", str(free_port()), timeout=120)
    try:
        assert process.url, "".join(process.lines)

        def client(k: int) -> float:
            grpc, worst = tc.InferenceServerClient(process.url), 0.0
            for j, items in enumerate((1, 2, 3, 7, 64, 700)):
                batch = _request(items, seed=10 * k + j, jagged=True)
                got = grpc.infer("jagged", triton_inputs(tc, batch), client_timeout=30).as_numpy("scores")
                with torch.inference_mode():
                    want = model(*(torch.from_numpy(v) for v in batch.values())).numpy()
                worst = max(worst, float(np.max(np.abs(got - want))))
            return worst

        with ThreadPoolExecutor(8) as pool:
            assert max(pool.map(client, range(8), timeout=60)) < 1e-5
        log = "".join(process.lines)
        assert "out of rotation" not in log and "cannot split" not in log, log[-2000:]
    finally:
        process.stop()
