"""simcard memory: each device name has a budget; partitions accumulate, refusals quote the numbers, close frees."""

from __future__ import annotations

import pytest

from sixfold.backends.api import BackendError, DoesNotFit
from sixfold.backends.builtin.simcard import SimCardBackend
from tests.backends.factories import batch, device, mlp

KiB, MiB = 1 << 10, 1 << 20
MLP = mlp()


def part(name: str, kib: int):
    """The test MLP, declared to hold ``kib`` KiB of weights on its card."""
    return MLP.artifact(name, param_bytes=kib * KiB)


def test_partitions_on_one_device_accumulate_until_one_does_not_fit():
    backend, card = SimCardBackend(), device("card0", memory_bytes=MiB)
    a = backend.load(part("stage0", 400), card)
    b = backend.load(part("stage1", 400), card)
    assert backend.memory_used(card) == backend.memory_used("card0") == 800 * KiB
    with pytest.raises(DoesNotFit) as err:
        backend.load(part("stage2", 400), card)
    assert str(err.value) == ("partition stage2 needs 400.0 KiB; device card0 has 224.0 KiB free "
                              "(1.0 MiB total, 800.0 KiB held by stage0, stage1)")
    assert backend.memory_used(card) == 800 * KiB       # a refusal reserves nothing
    for exe in (a, b):
        exe.close()


def test_close_frees_its_share_once():
    backend, card = SimCardBackend(), device("card0", memory_bytes=MiB)
    a = backend.load(part("a", 600), card)
    with pytest.raises(DoesNotFit, match="has 424.0 KiB free"):
        backend.load(part("b", 600), card)
    a.close()
    a.close()                                           # idempotent: frees once
    assert backend.memory_used(card) == 0
    b = backend.load(part("b", 600), card)
    assert backend.memory_used(card) == 600 * KiB
    assert b.memory_bytes() == 600 * KiB
    b.close()


def test_budgets_are_per_device_name_and_per_backend_instance():
    backend = SimCardBackend()
    card0, card1 = device("card0", memory_bytes=MiB), device("card1", memory_bytes=MiB)
    held = [backend.load(part("dense", 700), card0), backend.load(part("dense", 700), card1)]
    assert SimCardBackend().load(part("dense", 700), card0).memory_bytes() == 700 * KiB  # another instance
    assert backend.memory_used(card0) == backend.memory_used(card1) == 700 * KiB
    for exe in held:
        exe.close()


def test_too_big_for_an_empty_card_quotes_the_total():
    with pytest.raises(DoesNotFit, match=r"^partition dense needs 2.0 MiB; device card0 has 1.0 MiB free "
                                         r"\(1.0 MiB total\)$"):
        SimCardBackend().load(part("dense", 2048), device("card0", memory_bytes=MiB))


def test_a_failed_functional_load_gives_the_memory_back():
    backend, card = SimCardBackend(), device("card0", memory_bytes=MiB)
    with pytest.raises(BackendError, match="onnxruntime could not load partition dense"):
        backend.load(MLP.artifact(payload=b"garbage", param_bytes=512 * KiB), card)
    assert backend.memory_used(card) == 0


def test_closed_card_refuses_work():
    exe = SimCardBackend().load(part("dense", 1), device())
    exe.close()
    with pytest.raises(BackendError, match="partition dense on simcard unit-card is closed"):
        exe.run(batch(MLP, 1))
