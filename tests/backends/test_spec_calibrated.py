"""The calibrated, op-level DeviceSpec fields: defaults keep old specs, JSON round-trips, bad values are named."""

from __future__ import annotations

import json
import math

import pytest

from sixfold.backends.spec import SPEC_DIR, DeviceSpec
from sixfold.backends.spec_catalog import load_spec
from tests.backends.factories import device

TABLE = ((1e4, 0.1), (1e6, 0.4), (1e9, 0.9))


def test_shipped_specs_without_the_fields_load_uncalibrated():
    for path in SPEC_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        spec = load_spec(path)
        if "matmul_efficiency" not in data:
            assert not spec.calibrated, path.name
            assert spec.matmul_efficiency == () and spec.gather_bandwidth == 0.0
            assert spec.matmul_efficiency_at(1e6) == spec.efficiency


def test_an_old_spec_file_without_the_fields_still_loads(tmp_path):
    old = {"name": "old-card", "memory_bytes": 1 << 30, "peak_flops": {"fp32": 1e12},
           "memory_bandwidth": 5e10, "link_bandwidth": 1e9, "efficiency": 0.4, "kind": "card"}
    path = tmp_path / "old-card.json"
    path.write_text(json.dumps(old))
    spec = load_spec(path)
    assert not spec.calibrated and spec.per_op_seconds == 0.0 and spec.per_batch_seconds == 0.0


def test_the_fields_round_trip_through_json(tmp_path):
    spec = device("cal", matmul_efficiency=TABLE, gather_bandwidth=3e10, per_id_seconds=4e-9,
                  per_op_seconds=2e-6, per_batch_seconds=5e-6)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(spec.to_dict()))
    loaded = load_spec(path)
    assert loaded == spec and loaded.calibrated
    assert loaded.matmul_efficiency == TABLE  # JSON lists come back as tuples


def test_the_shipped_calibrated_host_is_calibrated():
    spec = load_spec("host-calibrated")
    assert spec.kind == "host" and spec.calibrated
    assert spec.matmul_efficiency and spec.gather_bandwidth > 0 and spec.per_op_seconds > 0


def test_efficiency_interpolates_in_log_space_and_clamps():
    spec = device(matmul_efficiency=TABLE)
    assert spec.matmul_efficiency_at(1e4) == pytest.approx(0.1)
    assert spec.matmul_efficiency_at(1e3) == pytest.approx(0.1)    # below the table: its first value
    assert spec.matmul_efficiency_at(1e12) == pytest.approx(0.9)   # above: its last
    # 1e5 is halfway between 1e4 and 1e6 in log FLOPs: the geometric mean of 0.1 and 0.4.
    assert spec.matmul_efficiency_at(1e5) == pytest.approx(0.2)
    # flops / (peak * efficiency): 1e9 FLOPs in products of 1e5 FLOPs at 1e9 FLOP/s peak and 0.2.
    assert spec.matmul_seconds(1e9, 1e5) == pytest.approx(5.0)


def test_gather_seconds_is_per_id_plus_row_bytes_over_gather_bandwidth():
    spec = device(memory_bandwidth=2e9, gather_bandwidth=1e9, per_id_seconds=1e-8)
    assert spec.gather_seconds(1000, 100) == pytest.approx(1000 * (1e-8 + 100 / 1e9))
    assert device(memory_bandwidth=2e9).gather_seconds(1000, 100) == pytest.approx(1000 * 100 / 2e9)


def test_index_seconds_is_per_index_falling_back_to_per_id():
    assert device(per_id_seconds=1e-8, per_index_seconds=3e-9).index_seconds(1000) == pytest.approx(3e-6)
    assert device(per_id_seconds=1e-8).index_seconds(1000) == pytest.approx(1e-5)
    assert device(per_index_seconds=3e-9).calibrated


@pytest.mark.parametrize("change, message", [
    ({"matmul_efficiency": [[1e4, 1.5]]}, r"matmul_efficiency entries need FLOPs > 0 and an efficiency in \(0, 1\]"),
    ({"matmul_efficiency": [[0, 0.5]]}, r"matmul_efficiency entries need FLOPs > 0"),
    ({"matmul_efficiency": [[1e6, 0.5], [1e4, 0.6]]}, r"FLOPs must rise strictly, got \[1000000.0, 10000.0\]"),
    ({"gather_bandwidth": -1.0}, "gather_bandwidth must be a finite number >= 0, got -1.0"),
    ({"per_id_seconds": math.inf}, "per_id_seconds must be a finite number >= 0"),
    ({"per_index_seconds": -1e-9}, "per_index_seconds must be a finite number >= 0"),
    ({"per_op_seconds": "2us"}, "per_op_seconds must be a finite number >= 0, got '2us'"),
    ({"per_batch_seconds": -1e-6}, "per_batch_seconds must be a finite number >= 0"),
])
def test_bad_calibrated_fields_are_refused_with_the_value(change, message):
    with pytest.raises(ValueError, match=message):
        DeviceSpec.from_dict({**device().to_dict(), **change})
