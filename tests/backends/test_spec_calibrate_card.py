"""sixfold-partition calibrate --card --backend NAME: a card measured through its backend, as a spec the
planner and the simulator take. Small sizes and a 2 s budget: the figures are checked for what they mean,
not for speed (the host running the tests is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sixfold.backends import OnnxRuntimeBackend, PartitionArtifact
from sixfold.backends.spec_calibrate import calibrate_card, copy_partition, mlp_partition
from sixfold.backends.spec_catalog import load_spec

BIN = Path(sys.executable).parent
SMALL = ["--seconds", "2", "--rows", "4,32", "--typical-rows", "32", "--width", "128"]


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def card_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("calibrate") / "sub" / "card.json"
    proc = _run("sixfold-partition", "calibrate", "--card", "--backend", "onnxruntime", "--card-spec", "m2-card",
                *SMALL, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fp32:" in proc.stderr and "int8:" in proc.stderr and "copies:" in proc.stderr
    return out


def test_it_writes_a_spec_with_measured_flops_per_precision_and_link(card_json: Path) -> None:
    spec = load_spec(card_json)
    base = load_spec("m2-card")
    assert spec.name == "onnxruntime-calibrated" and spec.kind == "card"
    assert set(spec.peak_flops) == {"fp32", "fp16", "int8"} and min(spec.peak_flops.values()) > 0
    assert spec.peak_flops != base.peak_flops and spec.link_bandwidth != base.link_bandwidth
    assert spec.memory_bytes == base.memory_bytes and spec.memory_bandwidth == base.memory_bandwidth  # kept
    assert 0 < spec.efficiency <= 1 and spec.link_bandwidth > 0 and spec.link_latency_s >= 0
    assert json.loads(card_json.read_text())["description"].startswith("m2-card measured through backend onnxruntime")


def test_the_planner_and_the_simulator_take_it(card_json: Path, tmp_path: Path) -> None:
    plan = _run("sixfold-partition", "--model", "rm2", "--max-rows", "200", "--cards", "2", "--card-spec",
                str(card_json), "--out", str(tmp_path / "rm2"))
    assert plan.returncode == 0, plan.stderr[-3000:]
    devices = json.loads((tmp_path / "rm2" / "plan.json").read_text())["devices"]
    assert [d["spec"]["name"] for d in devices if d["id"] != "host"] == ["onnxruntime-calibrated"] * 2
    sim = _run("sixfold-simulate", "run", "--model", "rm2", "--max-rows", "200", "--cards", "2", "--card-spec",
               str(card_json), "--host-spec", "host-cpu", "--qps", "200", "--duration", "0.5")
    assert sim.returncode == 0, sim.stderr[-3000:]
    assert "2 x onnxruntime-calibrated" in " ".join(sim.stdout.split())


def test_the_figures_are_what_the_runs_took() -> None:
    """The fp32 peak is FLOPs over the median run time of a real partition: re-timing it lands near it."""
    backend = OnnxRuntimeBackend()
    spec, measured = calibrate_card(backend, load_spec("m2-card"), seconds_budget=1.0, rows=(8, 32),
                                    typical_rows=32, width=64, layers=2, copy_width=256, copy_rows=32)
    curve = {int(n): f for n, f in measured["flops_per_second"]["fp32"].items()}
    assert spec.peak_flops["fp32"] == max(curve.values())
    assert spec.efficiency == pytest.approx(curve[32] / max(curve.values()))
    artifact = mlp_partition("fp32", width=64, layers=2)
    assert artifact.flops_per_item == 2 * 64 * 64 * 2
    exe = backend.load(artifact, load_spec("m2-card"))
    try:
        out = exe.run({"x": np.ones((3, 64), np.float32)})["y"]
        assert out.shape == (3, 64) and (out >= 0).all()  # Gemm+Relu, really run
    finally:
        exe.close()
    assert copy_partition(256).bytes_per_item == 8 * 256


class _Fp32Only(OnnxRuntimeBackend):
    name = "fp32-only"

    def supports(self, artifact: PartitionArtifact) -> bool:
        return artifact.dtype == "fp32" and super().supports(artifact)


def test_a_precision_the_backend_declines_is_left_out() -> None:
    spec, measured = calibrate_card(_Fp32Only(), load_spec("m2-card"), seconds_budget=0.5, rows=(4,),
                                    typical_rows=4, width=32, layers=1, copy_width=64, copy_rows=8)
    assert set(spec.peak_flops) == {"fp32"} and measured["declined"] == ["fp16", "int8"]
    assert spec.name == "fp32-only-calibrated"


def test_without_a_base_spec_a_backend_reporting_no_devices_is_refused() -> None:
    with pytest.raises(ValueError, match="reports no devices\\(\\); give the card's base spec with --card-spec"):
        calibrate_card(OnnxRuntimeBackend(), None, seconds_budget=0.1)


@pytest.mark.parametrize("args, words", [
    (["--backend", "onnxruntime"], "--backend measures a card: add --card"),
    (["--card", "--backend", "no-such-card"], "no backend named 'no-such-card'"),
    (["--card", "--backend", "onnxruntime", "--card-spec", "no-such-spec"], "--card-spec"),
    (["--card", "--backend", "onnxruntime", "--rows", "a,b"], "--rows 'a,b'"),
])
def test_mistakes_are_one_line_naming_the_flag(args: list[str], words: str) -> None:
    proc = _run("sixfold-partition", "calibrate", *args)
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_an_out_path_that_cannot_be_written_is_named_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "card.json"
    proc = _run("sixfold-partition", "calibrate", "--card", "--backend", "onnxruntime", "--out", str(out))
    assert proc.returncode == 2 and f"--out {out}: " in proc.stderr and "is a file, not a folder" in proc.stderr
    assert "fp32:" not in proc.stderr  # refused before any measuring
