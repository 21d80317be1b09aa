"""This host's emulated-card speed: a real calibration on a small ONNX graph, cached once per machine."""

from __future__ import annotations

import json

import pytest

from sixfold.backends.emulation_calibrate import (auto_emulation, calibrate_emulation, emulation_file,
                                                  load_emulation)


def test_a_real_calibration_times_single_thread_calls_and_their_sharing(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    cal = calibrate_emulation(0.6, rows=(1, 64), max_sharing=3)
    assert cal.rows == (1, 64) and all(s > 0 for s in cal.seconds)
    assert cal.seconds[1] > cal.seconds[0]  # 64 rows of a 512-wide MLP take longer than one
    assert cal.sharing[0] == 1.0 and len(cal.sharing) == 3 and all(s >= 1.0 for s in cal.sharing)
    assert 1.0 <= cal.effective_cores <= cal.usable_cores
    assert "load average" in cal.source
    assert 0.0 <= cal.call_overhead_s < 0.05  # simcard's hand-off to its worker thread: well under 50 ms
    with pytest.raises(ValueError, match="seconds_budget"):
        calibrate_emulation(0.0)


def test_auto_measures_once_then_reads_the_cache(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SIXFOLD_CALIBRATE_SECONDS", "0.6")
    assert load_emulation() is None
    first = auto_emulation()
    assert "measuring this host's emulated-card speed once" in capsys.readouterr().err
    assert emulation_file().parent == tmp_path and json.loads(emulation_file().read_text())["rows"]
    assert auto_emulation() == first and capsys.readouterr().err == ""  # read, not measured again
    emulation_file().write_text("{not json")
    assert load_emulation() is None  # damaged: measured again by auto
