"""Torch backend: an fx-traced host-like module gives the module's own outputs, zero-copy, in numpy."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import torch
from torch import fx, nn

from sixfold.backends.api import BackendError, DoesNotFit, PartitionArtifact
from sixfold.backends.spec_catalog import load_spec
from sixfold.backends.builtin.torch_backend import TorchBackend
from tests.backends.factories import device

INPUTS = ("dense_features", "sparse_indices")
OUTPUTS = ("pooled", "projected")


class HostLike(nn.Module):
    """Embedding lookups pooled per sample plus a projection: two inputs, two outputs."""

    def __init__(self, rows: int = 50, dim: int = 4, dense: int = 3) -> None:
        super().__init__()
        self.table = nn.Embedding(rows, dim)
        self.proj = nn.Linear(dense, dim)

    def forward(self, dense_features: torch.Tensor, sparse_indices: torch.Tensor):
        return self.table(sparse_indices).sum(dim=1), torch.relu(self.proj(dense_features))


def traced(module: nn.Module | None = None) -> fx.GraphModule:
    torch.manual_seed(0)
    return fx.symbolic_trace((module or HostLike()).eval())


def artifact(payload=None, **overrides) -> PartitionArtifact:
    fields = {"name": "sparse", "format": "torch-fx", "payload": payload if payload is not None else traced(),
              "input_names": INPUTS, "output_names": OUTPUTS, "param_bytes": 50 * 4 * 4 + 16, **overrides}
    return PartitionArtifact(**fields)


def feed(rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"dense_features": rng.standard_normal((rows, 3), dtype=np.float32),
            "sparse_indices": rng.integers(0, 50, size=(rows, 6), dtype=np.int64)}


def expected(module: nn.Module, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    with torch.no_grad():
        return [t.numpy() for t in module(*(torch.tensor(inputs[n]) for n in INPUTS))]


def test_outputs_equal_the_module_at_every_batch_size():
    a = artifact()
    exe = TorchBackend().load(a, load_spec("host-cpu"))
    for rows in range(1, 33):
        inputs = feed(rows, seed=rows)
        out = exe.run({**inputs, "ignored": np.zeros(1)})
        assert list(out) == list(OUTPUTS)
        for name, want in zip(OUTPUTS, expected(a.payload, inputs)):
            assert out[name].shape[0] == rows
            np.testing.assert_allclose(out[name], want, rtol=1e-6, atol=1e-6)
    exe.close()


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")  # torch warns once per process
def test_arrays_cross_without_copies_even_read_only_ones():
    class Identity(nn.Module):
        def forward(self, x):
            return x

    a = artifact(traced(Identity()), input_names=("x",), output_names=("y",))
    exe = TorchBackend().load(a, load_spec("host-cpu"))
    x = np.frombuffer(np.arange(12, dtype=np.float32).tobytes(), dtype=np.float32).reshape(4, 3)
    assert not x.flags.writeable  # like a tensor decoded from a gRPC buffer
    y = exe.run({"x": x})["y"]
    assert np.shares_memory(x, y)
    np.testing.assert_array_equal(x, y)


def test_concurrent_runs_from_several_threads():
    a = artifact()
    exe = TorchBackend().load(a, load_spec("host-cpu"))
    inputs = [feed(1 + i % 20, seed=i) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        outs = list(pool.map(exe.run, inputs))
    for inp, out in zip(inputs, outs):
        for name, want in zip(OUTPUTS, expected(a.payload, inp)):
            np.testing.assert_allclose(out[name], want, rtol=1e-6, atol=1e-6)


async def test_infer_is_awaitable():
    exe = TorchBackend().load(artifact(), load_spec("host-cpu"))
    out = await exe.infer(feed(5))
    assert out["pooled"].shape == (5, 4)
    exe.close()


def test_a_single_tensor_result_fills_a_single_output():
    a = artifact(traced(nn.Linear(3, 2)), input_names=("dense_features",), output_names=("y",))
    out = TorchBackend().load(a, load_spec("host-cpu")).run(feed(3))
    assert out["y"].shape == (3, 2)


def test_inference_mode_no_autograd_state_leaks():
    exe = TorchBackend().load(artifact(), load_spec("host-cpu"))
    out = exe.run(feed(2))
    assert all(isinstance(v, np.ndarray) for v in out.values())
    assert torch.is_grad_enabled()  # inference_mode is scoped to the call


def test_wrong_output_count_is_an_error():
    a = artifact(output_names=("pooled",))
    with pytest.raises(BackendError, match="partition sparse returned 2 output.s.; expected 1 .pooled."):
        TorchBackend().load(a, load_spec("host-cpu")).run(feed(2))


def test_module_errors_are_wrapped_with_the_partition_name():
    exe = TorchBackend().load(artifact(), load_spec("host-cpu"))
    bad = {**feed(2), "sparse_indices": np.full((2, 6), 999, dtype=np.int64)}  # out of the table's range
    with pytest.raises(BackendError, match="torch failed on partition sparse: IndexError"):
        exe.run(bad)
    with pytest.raises(BackendError, match="partition sparse: missing input 'sparse_indices'"):
        exe.run({"dense_features": feed(1)["dense_features"]})


def test_refusals():
    backend = TorchBackend()
    with pytest.raises(DoesNotFit, match="partition sparse needs 32.0 GiB; device m2-card has 16.0 GiB free"):
        backend.load(artifact(param_bytes=32 * 2**30), load_spec("m2-card"))
    with pytest.raises(BackendError, match="must be a callable torch.nn.Module, got bytes"):
        backend.load(artifact(payload=b"onnx?"), load_spec("host-cpu"))
    with pytest.raises(BackendError, match="takes torch-fx partitions; partition sparse is 'onnx'"):
        backend.load(artifact(format="onnx"), load_spec("host-cpu"))
    with pytest.raises(BackendError, match="unknown option"):
        TorchBackend(device="cuda")


def test_gpu_spec_without_cuda_runs_on_cpu(caplog):
    caplog.set_level("WARNING", logger="sixfold.backends.builtin.torch_backend")
    gpu = device("gpu0", kind="gpu")
    exe = TorchBackend().load(artifact(), gpu)
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert exe.torch_device == expected_device
    assert exe.run(feed(2))["pooled"].shape == (2, 4)
    if expected_device == "cpu":
        assert "gpu0 is a gpu but CUDA is not available; partition sparse runs on CPU" in caplog.text


def test_closed_executable_refuses():
    exe = TorchBackend().load(artifact(), load_spec("host-cpu"))
    exe.close()
    with pytest.raises(BackendError, match="closed"):
        exe.run(feed(1))


def test_outputs_numpy_cannot_hold_are_an_error():
    class Half(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16)

    a = artifact(traced(Half()), input_names=("x",), output_names=("y",))
    with pytest.raises(BackendError, match="partition sparse: an output has no numpy equivalent"):
        TorchBackend().load(a, load_spec("host-cpu")).run({"x": np.ones((2, 2), np.float32)})
