"""simcard fault injection: crash after K batches, hang, slow down, and the option checks."""

from __future__ import annotations

import asyncio

import pytest

from sixfold.backends.api import BackendError
from sixfold.backends.builtin.simcard import SimCardBackend
from tests.backends.factories import FakeClock, batch, device, mlp

MLP = mlp()


def card(clock: FakeClock, **faults):
    backend = SimCardBackend(clock=clock, sleep=clock.sleep, faults=faults)
    return backend.load(MLP.artifact(flops_per_item=1e6), device())


async def test_crash_after_k_batches_fails_every_later_batch():
    exe = card(FakeClock(), crash_after=2)
    for _ in range(2):
        await exe.infer(batch(MLP, 1))
    for _ in range(2):
        with pytest.raises(BackendError, match="simcard unit-card: partition dense crashed .injected fault"):
            await exe.infer(batch(MLP, 1))
    s = exe.stats()
    assert (s.batches, s.outstanding) == (2, 0)
    exe.close()


async def test_hang_never_answers_until_cancelled():
    exe = card(FakeClock(), crash_after=1, hang=True)
    await exe.infer(batch(MLP, 1))
    stuck = asyncio.create_task(exe.infer(batch(MLP, 1)))
    done, _ = await asyncio.wait({stuck}, timeout=0.05)
    assert not done
    assert exe.stats().outstanding == 1                 # in flight, as a wedged card's batch is
    stuck.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stuck
    assert exe.stats().outstanding == 0
    exe.close()


async def test_slow_factor_scales_the_modelled_service_time():
    normal, slow = FakeClock(), FakeClock()
    await card(normal).infer(batch(MLP, 4))
    await card(slow, slow_factor=3.0).infer(batch(MLP, 4))
    assert slow.sleeps == [pytest.approx(3 * normal.sleeps[0])]


@pytest.mark.parametrize("faults, message", [
    ({"crash_afterr": 1}, "unknown option.*crash_afterr"),
    ({"crash_after": -1}, "faults.crash_after must be an int >= 0, got -1"),
    ({"slow_factor": 0}, "faults.slow_factor must be a number > 0, got 0"),
])
def test_bad_faults_are_refused(faults, message):
    with pytest.raises(BackendError, match=message):
        SimCardBackend(faults=faults)
