"""Device specs: shipped files load, bad specs are refused with the numbers, the roofline is what it says."""

from __future__ import annotations

import json

import pytest

from sixfold.backends.spec import SPEC_DIR, DeviceSpec, spec_names
from sixfold.backends.spec_catalog import load_spec
from tests.backends.factories import device


def test_shipped_specs_load_by_name():
    assert {"host-cpu", "m2-card"} <= set(spec_names())
    card = load_spec("m2-card")
    assert card.memory_bytes == 16 * 2**30
    assert card.kind == "card"
    assert load_spec("host-cpu").transfer_seconds(1e9) == 0.0  # no link to cross on the host


def test_every_shipped_spec_is_valid():
    for path in SPEC_DIR.glob("*.json"):
        spec = DeviceSpec.from_dict(json.loads(path.read_text()))
        assert spec.name == path.stem


def test_spec_loads_from_a_path_and_round_trips(tmp_path):
    spec = device("mine", memory_bytes=3 * 2**30)
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec.to_dict()))
    assert load_spec(path) == spec
    assert load_spec(str(path)) == spec


def test_unknown_name_lists_the_shipped_specs():
    with pytest.raises(FileNotFoundError, match="no-such-card.*m2-card"):
        load_spec("no-such-card")


def test_unknown_fields_are_named():
    data = {**device().to_dict(), "tops": 50}
    with pytest.raises(ValueError, match=r"unknown device spec fields \['tops'\]"):
        DeviceSpec.from_dict(data)


@pytest.mark.parametrize("change, message", [
    ({"memory_bytes": 0}, "memory_bytes must be > 0, got 0"),
    ({"peak_flops": {}}, "peak_flops needs positive values"),
    ({"peak_flops": {"fp32": -1.0}}, "peak_flops needs positive values"),
    ({"memory_bandwidth": 0.0}, "memory_bandwidth must be > 0"),
    ({"efficiency": 1.5}, r"efficiency must be in \(0, 1\], got 1.5"),
])
def test_invalid_specs_are_refused_with_the_number(change, message):
    with pytest.raises(ValueError, match=message):
        DeviceSpec.from_dict({**device().to_dict(), **change})


def test_roofline_takes_the_slower_of_compute_and_memory():
    spec = device(flops=1e9, memory_bandwidth=2e9)
    assert spec.compute_seconds(4e6, 1e3) == pytest.approx(4e-3)      # compute-bound
    assert spec.compute_seconds(1e3, 4e6) == pytest.approx(2e-3)      # memory-bound


def test_flops_per_dtype_falls_back_to_fp32_and_applies_efficiency():
    spec = DeviceSpec(name="c", memory_bytes=1, peak_flops={"fp32": 1e12, "int8": 8e12},
                      memory_bandwidth=1e9, link_bandwidth=1e9, efficiency=0.25)
    assert spec.flops("int8") == 2e12
    assert spec.flops("fp16") == 0.25e12


def test_transfer_is_latency_plus_bytes_over_bandwidth():
    spec = device(link_bandwidth=1e9, link_latency_s=1e-3)
    assert spec.transfer_seconds(5e6) == pytest.approx(1e-3 + 5e-3)
