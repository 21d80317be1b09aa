"""Backend API 1.3: the artifact a backend loads names the physical card (index and spec), in one naming scheme."""

from __future__ import annotations

import threading

import pytest

import sixfold.backends
from sixfold.backends import CardRef, DeviceSpec, OnnxRuntimeBackend, PartitionArtifact
from sixfold.backends.api import BACKEND_API_VERSION, Executable
from sixfold.backends.conformance import run_conformance
from tests.backends.factories import mlp


class _Recording(OnnxRuntimeBackend):
    """Remembers which card each load was for, as a vendor's multi-device runtime needs to."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[tuple[CardRef | None, str, int]] = []
        self._lock = threading.Lock()

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        with self._lock:
            self.loads.append((artifact.card, device.name, device.memory_bytes))
        return super().load(artifact, device)


def test_the_version_and_the_name_are_public() -> None:
    assert BACKEND_API_VERSION == "1.3"
    assert "CardRef" in sixfold.backends.__all__ and sixfold.backends.CardRef is CardRef


def test_every_kit_load_is_for_its_own_card_named_spec_slash_card_k() -> None:
    backend = _Recording()
    report = run_conformance(backend, models=("rm2",), max_batch=4, ops=False,
                             checks=["load", "concurrency", "bad-input", "does-not-fit"])
    assert report.passed, [(r.check, r.detail) for r in report.failures]
    cards = [card for card, _, _ in backend.loads]
    assert all(card is not None and card.spec == "m2-card" for card in cards)
    assert [c.index for c in cards] == list(range(len(cards))) and len(cards) >= 5  # 1 + 2 + 1 + 1 loads
    assert all(name == card.device_name == f"m2-card/card{card.index}" for card, name, _ in backend.loads)
    assert "m2-card/card" in report.result("rm2", "does-not-fit").detail  # the refusal names the card too
    assert min(memory for _, _, memory in backend.loads) < backend.loads[0][2]


def test_for_card_labels_a_copy_and_shares_the_payload() -> None:
    artifact = mlp().artifact()
    labelled = artifact.for_card(CardRef(3, "mycard-x1"))
    assert artifact.card is None and labelled.card == CardRef(3, "mycard-x1")
    assert labelled.payload is artifact.payload and labelled.layouts == artifact.layouts
    assert labelled.card.name == "card3" and labelled.card.device_name == "mycard-x1/card3"


@pytest.mark.parametrize("index, spec, words", [(-1, "m2-card", "index must be an int >= 0"),
                                                (True, "m2-card", "index must be an int >= 0"),
                                                (0, "m2-card/card0", "without '/'"), (0, "", "without '/'")])
def test_a_bad_card_ref_is_refused_naming_the_field(index, spec, words) -> None:
    with pytest.raises(ValueError, match=words):
        CardRef(index, spec)
