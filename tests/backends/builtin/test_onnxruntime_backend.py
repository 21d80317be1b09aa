"""ONNX Runtime backend: real sessions on a small MLP equal numpy at every batch size and from many threads."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import onnxruntime
import pytest

from sixfold.backends.api import BackendError, DoesNotFit
from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend
from sixfold.backends.spec_catalog import load_spec
from tests.backends.factories import batch, device, mlp

GiB = 2**30


@pytest.fixture(scope="module")
def model():
    return mlp(hidden=16, seed=1)


@pytest.fixture
def card(model):
    exe = OnnxRuntimeBackend().load(model.artifact(), device())
    yield exe
    exe.close()


def assert_scores(model, feed, out):
    assert list(out) == ["scores"]
    assert out["scores"].dtype == np.float32
    np.testing.assert_allclose(out["scores"], model.reference(feed), rtol=1e-5, atol=1e-6)


def test_outputs_equal_numpy_at_every_batch_size(model, card):
    for rows in range(1, 65):
        feed = batch(model, rows, seed=rows)
        out = card.run(feed)
        assert out["scores"].shape == (rows, 1)
        assert_scores(model, feed, out)


def test_loads_from_a_path_like_from_bytes(model, tmp_path):
    path = tmp_path / "dense.onnx"
    path.write_bytes(model.onnx_bytes)
    feed = batch(model, 7)
    for payload in (path, str(path)):
        exe = OnnxRuntimeBackend().load(model.artifact(payload=payload), device())
        assert_scores(model, feed, exe.run(feed))
        exe.close()


def test_feeds_only_the_partitions_inputs(model, card):
    feed = batch(model, 3)
    out = card.run({**feed, "sparse_indices": np.arange(10), "unrelated": np.zeros(2)})
    assert_scores(model, feed, out)


def test_concurrent_runs_from_several_threads(model, card):
    feeds = [batch(model, rows=1 + (i * 7) % 50, seed=i) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        outs = list(pool.map(card.run, feeds))
    for feed, out in zip(feeds, outs):
        assert_scores(model, feed, out)


async def test_infer_runs_off_the_event_loop(model, card):
    feeds = [batch(model, rows, seed=rows) for rows in (1, 9, 33)]
    outs = await asyncio.gather(*(card.infer(f) for f in feeds))
    for feed, out in zip(feeds, outs):
        assert_scores(model, feed, out)


def test_each_load_is_its_own_session(model):
    backend = OnnxRuntimeBackend()
    a, b = backend.load(model.artifact(), device("card0")), backend.load(model.artifact(), device("card1"))
    assert a.providers == ["CPUExecutionProvider"]
    a.close()
    with pytest.raises(BackendError, match="partition dense on card0 is closed"):
        a.run(batch(model, 1))
    assert_scores(model, batch(model, 2), b.run(batch(model, 2)))
    b.close()


def test_does_not_fit_quotes_both_numbers(model):
    with pytest.raises(DoesNotFit, match=r"^partition dense needs 21.3 GiB; device m2-card has 16.0 GiB free$"):
        OnnxRuntimeBackend().load(model.artifact(param_bytes=int(21.3 * GiB)), load_spec("m2-card"))


def test_unavailable_provider_names_the_available_ones():
    with pytest.raises(BackendError) as err:
        OnnxRuntimeBackend(providers=["TensorrtExecutionProvider", "CPUExecutionProvider"])
    message = str(err.value)
    assert "TensorrtExecutionProvider not available here" in message
    for name in onnxruntime.get_available_providers():
        assert name in message
    with pytest.raises(BackendError, match="providers is empty"):
        OnnxRuntimeBackend(providers=[])


def test_provider_with_options_is_accepted(model):
    backend = OnnxRuntimeBackend(providers=[("CPUExecutionProvider", {})])
    exe = backend.load(model.artifact(), device())
    assert_scores(model, batch(model, 4), exe.run(batch(model, 4)))
    exe.close()


@pytest.mark.parametrize("options, message", [
    ({"intra_op_threads": -1}, "intra_op_threads must be an int >= 0, got -1"),
    ({"inter_op_threads": True}, "inter_op_threads must be an int >= 0, got True"),
    ({"threads": 2}, "unknown option"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(BackendError, match=message):
        OnnxRuntimeBackend(**options)


def test_missing_input_names_the_partition_and_input(model, card):
    with pytest.raises(BackendError, match="partition dense: missing input 'boundary'; got dense_features"):
        card.run({"dense_features": np.zeros((1, 3), np.float32)})


def test_runtime_errors_are_wrapped_with_the_partition_name(model, card):
    feed = {**batch(model, 2), "boundary": np.zeros((2, 5), np.float64)}  # wrong dtype
    with pytest.raises(BackendError, match="onnxruntime failed on partition dense: ") as err:
        card.run(feed)
    assert err.value.__cause__ is not None


@pytest.mark.parametrize("payload, message", [
    (b"not an onnx model", "onnxruntime could not load partition dense: "),
    ("/nonexistent/dense.onnx", "partition dense: no ONNX file at /nonexistent/dense.onnx"),
    (12345, "ONNX payload must be bytes or a path, got int"),
])
def test_bad_payloads_are_backend_errors(model, payload, message):
    with pytest.raises(BackendError, match=message):
        OnnxRuntimeBackend().load(model.artifact(payload=payload), device())


def test_names_the_model_does_not_have_are_refused(model):
    artifact = model.artifact()
    artifact.output_names = ("score",)
    with pytest.raises(BackendError, match="output.s. score not in the ONNX model; its outputs: scores"):
        OnnxRuntimeBackend().load(artifact, device())


def test_other_formats_are_refused(model):
    artifact = model.artifact()
    artifact.format = "torch-fx"
    backend = OnnxRuntimeBackend()
    assert not backend.supports(artifact)
    with pytest.raises(BackendError, match="takes onnx partitions; partition dense is 'torch-fx'"):
        backend.load(artifact, device())
