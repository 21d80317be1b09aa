"""Named device specs from vendor packages: entry points (sixfold.device_specs) and Backend.devices().

Before: only backends/specs/*.json names resolved; devices() was never called.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from sixfold.backends import registry, spec_catalog
from sixfold.backends.spec_catalog import load_spec
from sixfold.backends.spec_catalog import SpecConflict, UnknownSpec, describe_specs
from tests.backends.dummy_plugins import CLASHES_WITH_M2, VENDOR_CARD

SPECS = spec_catalog.SPECS_GROUP


def ep(name: str, value: str, group: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=group)


BACKEND_EPS = [ep("ships-devices", "tests.backends.dummy_plugins:ShipsDevices", registry.ENTRY_POINT_GROUP),
               ep("devices-raise", "tests.backends.dummy_plugins:DevicesRaise", registry.ENTRY_POINT_GROUP),
               ep("onnxruntime", "sixfold.backends.builtin.onnxruntime_backend:OnnxRuntimeBackend", registry.ENTRY_POINT_GROUP)]


@pytest.fixture
def installed(fresh_registry, monkeypatch):
    """``installed(spec_eps, backend_eps)``: discovery sees exactly those entry points."""

    def install(spec_eps: list[EntryPoint], backend_eps: list[EntryPoint] = BACKEND_EPS) -> None:
        def fake(*, group: str):
            return {SPECS: spec_eps, registry.ENTRY_POINT_GROUP: backend_eps}[group]
        monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
        monkeypatch.setattr(spec_catalog, "entry_points", fake)
        monkeypatch.setattr(registry, "entry_points", fake)
        registry.discover(reload=True)
        spec_catalog.catalog(reload=True)

    yield install
    monkeypatch.undo()
    registry.discover(reload=True)
    spec_catalog.catalog(reload=True)


def test_vendor_specs_resolve_by_name_from_entry_points_and_devices(installed):
    installed([ep("vendor", "tests.backends.dummy_plugins:vendor_specs", SPECS)])
    assert load_spec("vendor-card") == VENDOR_CARD                      # entry point -> function -> list
    assert load_spec("vendor-card-lite").memory_bytes == 4 * 2**30      # a dict of fields
    assert load_spec("ships-card-0").memory_bytes == 16 * 2**30         # Backend.devices()
    assert load_spec("m2-card").name == "m2-card"                       # sixfold's own still resolve
    entries = spec_catalog.catalog()
    assert "entry point vendor = tests.backends.dummy_plugins:vendor_specs" in entries["vendor-card"].source
    assert entries["ships-card-0"].source.startswith("backend ships-devices.devices()")
    assert entries["m2-card"].source == "sixfold backends/specs/m2-card.json"
    # devices-raise's probe crashed: skipped, said, and the rest resolve.
    assert any("devices-raise" in p and "permission denied" in p for p in spec_catalog.problems())
    listing = describe_specs()
    assert "ships-card-0" in listing and "failed: backend devices-raise.devices()" in listing


def test_an_unknown_name_lists_every_known_name_and_its_source(installed):
    installed([ep("vendor", "tests.backends.dummy_plugins:VENDOR_SPECS", SPECS)])
    with pytest.raises(FileNotFoundError) as info:
        load_spec("vendr-card")
    message = str(info.value)
    assert isinstance(info.value, UnknownSpec) and "'vendr-card'" in message
    assert "vendor-card (entry point vendor = tests.backends.dummy_plugins:VENDOR_SPECS" in message
    assert "ships-card-0 (backend ships-devices.devices()" in message
    assert "m2-card (sixfold backends/specs/m2-card.json)" in message
    assert "devices-raise" in message  # the source that failed is named too


def test_a_name_given_differently_by_two_sources_is_refused_naming_both(installed):
    installed([ep("clash", "tests.backends.dummy_plugins:CLASHES_WITH_M2", SPECS),
               ep("vendor", "tests.backends.dummy_plugins:VENDOR_SPECS", SPECS)])
    with pytest.raises(SpecConflict) as info:
        load_spec("m2-card")
    message = str(info.value)
    assert "sixfold backends/specs/m2-card.json" in message
    assert "entry point clash = tests.backends.dummy_plugins:CLASHES_WITH_M2" in message
    assert CLASHES_WITH_M2.memory_bytes != load_spec("backends/specs/m2-card.json").memory_bytes  # a path still works
    # The same figures from two sources (an entry point and devices()) are one spec, not a conflict.
    assert load_spec("vendor-card") == VENDOR_CARD
    assert "CONFLICT" in describe_specs()


def test_a_broken_spec_entry_point_is_skipped_with_its_reason(installed):
    installed([ep("missing", "no_such_vendor_pkg:SPECS", SPECS),
               ep("wrong", "collections:OrderedDict", SPECS)])
    assert load_spec("ships-card-0").name == "ships-card-0"
    issues = " ".join(spec_catalog.problems())
    assert "no_such_vendor_pkg" in issues and "ModuleNotFoundError" in issues and "wrong" in issues
