"""calibrate_host: sane positive numbers within a small budget; the spec round-trips through JSON."""

from __future__ import annotations

import json
import time

import pytest

from sixfold.backends.host.calibrate import calibrate_host, main, measure_host
from sixfold.backends.spec import DeviceSpec
from sixfold.backends.spec_catalog import load_spec


def test_calibrate_host_is_sane_and_bounded():
    t0 = time.perf_counter()
    spec = calibrate_host(0.6, threads=1)
    assert time.perf_counter() - t0 < 10
    assert spec.kind == "host" and spec.name == "host-calibrated" and spec.link_bandwidth == 0
    assert 1e8 < spec.peak_flops["fp32"] < 1e14  # 0.1 GFLOP/s .. 100 TFLOP/s
    assert 1e8 < spec.memory_bandwidth < 1e13
    assert spec.memory_bytes > 1 << 28
    assert "row gather" in spec.description
    assert DeviceSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_calibrate_writes_the_op_level_fields():
    spec = calibrate_host(0.6, threads=1)
    assert spec.calibrated
    table = spec.matmul_efficiency
    assert len(table) >= 3
    flops = [f for f, _ in table]
    effs = [e for _, e in table]
    assert flops == sorted(flops) and all(0 < e <= 1 for e in effs)
    assert effs == sorted(effs), "made non-decreasing: a larger product is never slower per FLOP"
    assert max(effs) == pytest.approx(1.0)  # peak_flops is the best measured rate
    assert spec.efficiency == pytest.approx(effs[-1])
    assert 1e8 < spec.gather_bandwidth < 1e13
    assert 0 <= spec.per_id_seconds < 1e-6  # ns per id, not microseconds
    assert 0 <= spec.per_index_seconds < 1e-6  # ONNX Runtime's element Gather: ns per index
    assert 0 < spec.per_op_seconds < 1e-3
    assert 0 <= spec.per_batch_seconds < 1e-2


def test_measure_host_reports_everything_and_rejects_zero_budget():
    m = measure_host(0.3, threads=1)
    assert {"fp32_flops", "memory_bandwidth", "gather_bandwidth", "per_id_seconds", "uniform_gather_bandwidth",
            "per_index_seconds", "per_op_seconds", "per_batch_seconds", "matmul_curve", "matmul_runtime",
            "threads"} <= set(m)
    assert m["matmul_runtime"] in ("onnxruntime", "torch")
    assert all(f > 0 and rate > 0 for f, rate in m["matmul_curve"])
    with pytest.raises(ValueError, match="seconds_budget"):
        measure_host(0)


def test_main_writes_a_loadable_spec_with_the_new_fields(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["--seconds", "0.3", "--threads", "1", "--name", "lab-host", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"matmul_efficiency", "gather_bandwidth", "per_id_seconds", "per_index_seconds", "per_op_seconds",
            "per_batch_seconds"} <= set(data)
    spec = load_spec(out)
    assert spec.name == "lab-host" and spec.kind == "host" and spec.calibrated
    assert "wrote" in capsys.readouterr().err
    for bad in (["--seconds", "0"], ["--seconds", "31"], ["--threads", "0"]):
        with pytest.raises(SystemExit):
            main(bad)
