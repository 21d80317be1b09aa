"""``--host-spec auto``: this machine calibrated on first use, then read from its cache."""

from __future__ import annotations

import pytest

import sixfold.backends.host.calibrate as calibrate
from sixfold.backends.spec import DeviceSpec
from sixfold.backends.spec_catalog import load_spec


def test_auto_calibrates_once_then_reads_the_cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_calibrate(seconds: float, *, name: str) -> DeviceSpec:
        calls.append(seconds)
        return DeviceSpec(name=name, memory_bytes=1 << 30, peak_flops={"fp32": 1e11}, memory_bandwidth=2e10,
                          link_bandwidth=0, kind="host", per_id_seconds=1e-9)

    monkeypatch.setattr(calibrate, "calibrate_host", fake_calibrate)
    assert calibrate.cached_host_spec() is None
    first = load_spec("auto")
    assert calls == [10.0] and first.name == f"host-auto-{calibrate.machine_key()}"
    assert calibrate.cached_host_spec() == tmp_path / f"host-{calibrate.machine_key()}.json"
    assert load_spec("auto") == first and calls == [10.0]  # the cache answers; no second calibration
    calibrate.cached_host_spec().write_text("{not json")  # a damaged cache is measured again
    assert load_spec("auto") == first and len(calls) == 2


def test_the_machine_key_is_stable() -> None:
    assert calibrate.machine_key() == calibrate.machine_key()
    assert len(calibrate.machine_key()) == 12
