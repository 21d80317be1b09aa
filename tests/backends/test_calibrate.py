"""calibrate_host: sane positive numbers within a small budget; the spec round-trips through JSON."""

from __future__ import annotations

import json
import time

import pytest

from backends.calibrate import calibrate_host, main, measure_host
from backends.spec import DeviceSpec, load_spec


def test_calibrate_host_is_sane_and_bounded():
    t0 = time.perf_counter()
    spec = calibrate_host(0.6, threads=1)
    assert time.perf_counter() - t0 < 10
    assert spec.kind == "host" and spec.name == "host-calibrated" and spec.link_bandwidth == 0
    assert 1e8 < spec.peak_flops["fp32"] < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s
    assert 1e8 < spec.memory_bandwidth < 1e13
    assert spec.memory_bytes > 1 << 28
    assert "random row gather" in spec.description
    assert DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_measure_host_reports_gather_and_rejects_zero_budget():
    m = measure_host(0.3, threads=1)
    assert set(m) == {"fp32_flops", "memory_bandwidth", "gather_bandwidth", "threads"}
    assert all(v > 0 for v in m.values())
    with pytest.raises(ValueError, match="seconds_budget"):
        measure_host(0)


def test_main_writes_a_loadable_spec(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["--seconds", "0.3", "--threads", "1", "--name", "lab-host", "--out", str(out)]) == 0
    spec = load_spec(out)
    assert spec.name == "lab-host" and spec.kind == "host"
    assert "wrote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
