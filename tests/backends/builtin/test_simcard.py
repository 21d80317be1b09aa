"""simcard as a backend: its outputs are the functional backend's, whichever that is, on many cards at once."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from torch import fx, nn

from sixfold.backends.api import BackendError, PartitionArtifact
from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend
from sixfold.backends.registry import BackendNotFound
from sixfold.backends.builtin.simcard import SimCardBackend
from sixfold.backends.builtin.torch_backend import TorchBackend
from tests.backends.factories import FakeClock, batch, device, mlp

MLP = mlp(hidden=32, seed=5)


async def test_outputs_equal_the_functional_backend_at_every_batch_size():
    clock = FakeClock()
    sim = SimCardBackend(clock=clock, sleep=clock.sleep).load(MLP.artifact(flops_per_item=1e5), device())
    plain = OnnxRuntimeBackend().load(MLP.artifact(), device())
    for rows in range(1, 41):
        feed = batch(MLP, rows, seed=rows)
        want = plain.run(feed)["scores"]
        np.testing.assert_array_equal((await sim.infer(feed))["scores"], want)
        np.testing.assert_array_equal(sim.run(feed)["scores"], want)
    assert sim.stats().batches == 40                    # run() is untimed and uncounted
    sim.close()
    plain.close()


async def test_six_cards_serve_concurrently():
    clock = FakeClock()
    backend = SimCardBackend(clock=clock, sleep=clock.sleep)
    cards = [backend.load(MLP.artifact(), device(f"card{i}")) for i in range(6)]
    feeds = [batch(MLP, 1 + i, seed=i) for i in range(24)]
    outs = await asyncio.gather(*(cards[i % 6].infer(f) for i, f in enumerate(feeds)))
    for feed, out in zip(feeds, outs):
        np.testing.assert_allclose(out["scores"], MLP.reference(feed), rtol=1e-5, atol=1e-6)
    assert [c.stats().batches for c in cards] == [4] * 6
    for c in cards:
        c.close()


def test_options_pass_through_to_the_functional_backend():
    backend = SimCardBackend(intra_op_threads=2)
    assert isinstance(backend.functional, OnnxRuntimeBackend)
    assert backend.functional.intra_op_threads == 2
    assert backend.formats == ("onnx",)
    with pytest.raises(BackendError, match="backend onnxruntime: unknown option"):
        SimCardBackend(intra_threads=2)


def test_a_backend_instance_is_a_functional_backend_and_sets_the_formats():
    class Double(nn.Module):
        def forward(self, x):
            return x * 2

    backend = SimCardBackend(functional=TorchBackend())
    artifact = PartitionArtifact(name="double", format="torch-fx", payload=fx.symbolic_trace(Double()),
                                 input_names=("x",), output_names=("y",))
    assert backend.formats == ("torch-fx",) and backend.supports(artifact)
    assert not backend.supports(MLP.artifact())
    exe = backend.load(artifact, device())
    np.testing.assert_array_equal(exe.run({"x": np.ones((2, 2), np.float32)})["y"], np.full((2, 2), 2.0))
    exe.close()
    with pytest.raises(BackendError, match=r"takes torch-fx partitions; partition dense is 'onnx'"):
        backend.load(MLP.artifact(), device())


def test_functional_backend_choices_are_checked():
    with pytest.raises(BackendError, match="given as an instance; configure it there"):
        SimCardBackend(functional=OnnxRuntimeBackend(), intra_op_threads=2)
    with pytest.raises(BackendError, match="cannot be simcard itself"):
        SimCardBackend(functional="simcard")
    with pytest.raises(BackendNotFound, match="no backend named 'tpu9000'"):
        SimCardBackend(functional="tpu9000")


async def test_cards_loading_one_partition_share_its_functional_executable_and_the_last_card_closes_it():
    clock = FakeClock()
    backend = SimCardBackend(clock=clock, sleep=clock.sleep)
    cards = [backend.load(MLP.artifact(), device(f"card{i}")) for i in range(3)]
    other = backend.load(mlp(hidden=32, seed=6).artifact(), device("card3"))  # another partition: its own
    assert cards[1].inner is cards[0].inner and cards[2].inner is cards[0].inner
    assert other.inner is not cards[0].inner
    feeds = [batch(MLP, 3 + i, seed=i) for i in range(12)]
    outs = await asyncio.gather(*(cards[i % 3].infer(f) for i, f in enumerate(feeds)))
    for feed, out in zip(feeds, outs):
        np.testing.assert_allclose(out["scores"], MLP.reference(feed), rtol=1e-5, atol=1e-6)
    assert [c.stats().batches for c in cards] == [4, 4, 4]  # each card its own queue and counts
    assert backend.memory_used("card1") == MLP.artifact().param_bytes  # each card still holds its copy
    shared = cards[0].inner
    cards[0].close()
    np.testing.assert_allclose((await cards[1].infer(feeds[0]))["scores"], MLP.reference(feeds[0]), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(BackendError, match="closed"):
        cards[0].run(feeds[0])
    cards[1].close()
    cards[2].close()
    with pytest.raises(BackendError, match="closed"):
        shared.run(feeds[0])  # the last card sharing it closed it
    again = backend.load(MLP.artifact(), device("card0"))  # a restarted card loads afresh
    assert again.inner is not shared
    np.testing.assert_allclose(again.run(feeds[1])["scores"], MLP.reference(feeds[1]), rtol=1e-5, atol=1e-6)
    again.close()
    other.close()


def test_with_sharing_off_or_a_functional_backend_not_thread_safe_each_card_loads_its_own():
    class OneAtATime(OnnxRuntimeBackend):
        name = "one-at-a-time"

        def load(self, artifact, device):
            executable = super().load(artifact, device)
            executable.thread_safe = False
            return executable

    for backend in (SimCardBackend(share_functional=False), SimCardBackend(functional=OneAtATime())):
        cards = [backend.load(MLP.artifact(), device(f"card{i}")) for i in range(2)]
        assert cards[0].inner is not cards[1].inner
        cards[0].close()
        feed = batch(MLP, 5, seed=1)
        np.testing.assert_allclose(cards[1].run(feed)["scores"], MLP.reference(feed), rtol=1e-5, atol=1e-6)
        cards[1].close()
    with pytest.raises(BackendError, match="option share_functional must be true or false, got 'yes'"):
        SimCardBackend(share_functional="yes")
