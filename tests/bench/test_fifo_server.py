"""bench/fifo_server.py, the ideal's policy run for real: same answers as the offline model, clear refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from sixfold import models
from sixfold.server.workers.process import ReadyProcess

ROOT = Path(__file__).resolve().parents[2]
MODEL, ROWS = "tiny", 100


@pytest.fixture(scope="module")
def fifo_url():
    proc = ReadyProcess([sys.executable, str(ROOT / "bench" / "fifo_server.py"), "--model", MODEL, "--max-rows",
                         str(ROWS), "--port", "0", "--threads", "1"], cwd=ROOT, timeout_s=180)
    try:
        assert proc.url, proc.output
        yield proc.url
    finally:
        assert proc.stop() == 0, proc.output


def _inputs(query: dict[str, np.ndarray], names=("dense_features", "sparse_lengths", "sparse_indices")) -> list:
    out = []
    for name in names:
        array = query[name]
        tensor = grpcclient.InferInput(name, list(array.shape), {np.float32: "FP32", np.int32: "INT32",
                                                                 np.int64: "INT64"}[array.dtype.type])
        tensor.set_data_from_numpy(array)
        out.append(tensor)
    return out


def test_answers_as_the_offline_model_with_int64_and_int32_ids(fifo_url: str) -> None:
    cfg = models.get_config(MODEL, max_rows=ROWS)
    model = models.build(MODEL, max_rows=ROWS, seed=0)
    client = grpcclient.InferenceServerClient(fifo_url)
    try:
        assert client.is_server_ready() and client.is_model_ready(MODEL)
        assert [i.name for i in client.get_model_metadata(MODEL).inputs] == ["dense_features", "sparse_lengths",
                                                                              "sparse_indices"]
        for items in (1, 37):
            query = models.RequestGenerator.for_config(cfg, seed=items).make(items)
            with torch.inference_mode():
                expected = model(*[torch.from_numpy(query[n]) for n in ("dense_features", "sparse_lengths",
                                                                          "sparse_indices")]).numpy()
            for ids in (np.int64, np.int32):
                sent = {**query, "sparse_indices": query["sparse_indices"].astype(ids)}
                scores = client.infer(MODEL, _inputs(sent)).as_numpy("scores")
                assert scores.shape == (items, 1)
                np.testing.assert_allclose(scores, expected, rtol=1e-6, atol=1e-7)
    finally:
        client.close()


def test_refuses_an_unknown_model_and_a_missing_input_by_name(fifo_url: str) -> None:
    query = models.RequestGenerator.for_config(models.get_config(MODEL, max_rows=ROWS), seed=3).make(2)
    client = grpcclient.InferenceServerClient(fifo_url)
    try:
        with pytest.raises(InferenceServerException, match="unknown model 'rm2'") as unknown:
            client.infer("rm2", _inputs(query))
        assert unknown.value.status() == "StatusCode.NOT_FOUND"
        with pytest.raises(InferenceServerException, match="missing inputs \\['sparse_indices'\\]") as missing:
            client.infer(MODEL, _inputs(query, ("dense_features", "sparse_lengths")))
        assert missing.value.status() == "StatusCode.INVALID_ARGUMENT"
        # and it still serves
        assert client.infer(MODEL, _inputs(query)).as_numpy("scores").shape == (2, 1)
    finally:
        client.close()


def test_int8_quantizes_the_linear_layers_and_stays_close() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("fifo_server", ROOT / "bench" / "fifo_server.py")
    fifo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fifo)
    cfg = models.get_config("dlrm-mlperf", max_rows=ROWS)
    fp32, int8 = (fifo.build_model("dlrm-mlperf", ROWS, 0, p) for p in ("fp32", "int8"))
    assert any(type(m) is torch.nn.Linear for m in fp32.modules())
    assert not any(type(m) is torch.nn.Linear for m in int8.modules())  # every one quantized
    query = models.RequestGenerator.for_config(cfg, seed=4).make(200)
    with torch.inference_mode():
        a, b = (m(*[torch.from_numpy(query[n]) for n in ("dense_features", "sparse_lengths", "sparse_indices")])
                for m in (fp32, int8))
    diff = (a - b).abs()
    assert 0 < float(diff.max()) < 0.05 and float(diff.mean()) < 5e-3
