"""A user's mistakes with sixfold-partition, -delta, -simulate and -loadgen: one line each, naming the flag or
file and what to give, before the slow part (partitioning, measuring, simulating, sending load) starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent


def _refused(*argv: str, code: int = 2) -> str:
    result = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=180)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == code and len(lines) == 1, (argv, result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and not lines[0].rstrip().split(":")[-1].strip().isdigit(), lines
    assert "bottleneck" not in result.stdout  # no plan: refused before partitioning
    return lines[0]


def test_sixfold_partition_mistakes(tmp_path) -> None:
    (tmp_path / "a-file").write_text("x")
    assert "MODEL_FILE " + str(tmp_path / "missing.onnx") + ": no such file; give a torch.export archive" in \
        _refused("sixfold-partition", str(tmp_path / "missing.onnx"), "--out", str(tmp_path / "out"))
    assert "named so" in _refused("sixfold-partition", str(tmp_path / "a-file"), "--out", str(tmp_path / "out"))
    assert "--out " in _refused("sixfold-partition", "--model", "rm1", "--max-rows", "300", "--out",
                                str(tmp_path / "a-file"))
    assert "--host-spec" in _refused("sixfold-partition", "--model", "rm1", "--plan-only", "--host-spec",
                                     str(tmp_path / "missing.json"))
    assert "--disk-spec" in _refused("sixfold-partition", "--model", "rm1", "--plan-only", "--table-memory", "10%",
                                     "--disk-spec", str(tmp_path / "missing.json"))
    assert "--table-memory 'lots'" in _refused("sixfold-partition", "--model", "rm1", "--plan-only",
                                               "--table-memory", "lots")
    assert "--draw" in _refused("sixfold-partition", "--model", "rm1", "--plan-only", "--draw",
                                str(tmp_path / "a-file" / "x.png"))
    assert "--model nope: unknown model 'nope'" in _refused("sixfold-partition", "--model", "nope", "--plan-only")
    # subcommands: calibrate checks where it writes before measuring; the others' mistakes are one line too
    assert "--out" in _refused("sixfold-partition", "calibrate", "--seconds", "1", "--out",
                               str(tmp_path / "a-file" / "host.json"))
    assert "sixfold-partition tiers: PLAN " in _refused("sixfold-partition", "tiers", str(tmp_path / "missing.json"))
    assert "not a readable plan" in _refused("sixfold-partition", "tiers", str(tmp_path / "a-file"))
    assert "sixfold-partition tables: SOURCE " in _refused("sixfold-partition", "tables", "import",
                                                           str(tmp_path / "missing.pt"), "--out", str(tmp_path / "v"))
    assert "sixfold-partition tables: --out " in _refused("sixfold-partition", "tables", "build", "rm1", "--out",
                                                          str(tmp_path / "a-file" / "v"))


def test_sixfold_partition_help_says_every_subcommand() -> None:
    text = subprocess.run([str(BIN / "sixfold-partition"), "--help"], capture_output=True, text=True, timeout=60,
                          check=True).stdout
    for sub in ("calibrate", "show", "tables build|import", "tiers PLAN"):
        assert f"sixfold-partition {sub}" in text, sub
    assert "(default 256)" in text.replace("\n", " ").replace("  ", " ")


def test_sixfold_delta_mistakes_and_help(tmp_path) -> None:
    (tmp_path / "a-file").write_text("x")
    assert "DELTA " in _refused("sixfold-delta", "show", str(tmp_path / "a-file"))
    assert "OLD_VERSION_DIR" in _refused("sixfold-delta", "make", str(tmp_path / "old"), str(tmp_path / "new"),
                                         "--out", str(tmp_path / "d"))
    assert "cannot reach a server at 127.0.0.1:1" in _refused("sixfold-delta", "rollback", "--url", "127.0.0.1:1",
                                                              "--model", "rm1", "--timeout", "5", code=1)
    text = subprocess.run([str(BIN / "sixfold-delta"), "--help"], capture_output=True, text=True, timeout=60,
                          check=True).stdout
    assert "``" not in text and "sixfold-delta make OLD_VERSION_DIR" in text


def test_sixfold_simulate_and_loadgen_check_their_outputs_first(tmp_path) -> None:
    (tmp_path / "a-file").write_text("x")
    inside_a_file = str(tmp_path / "a-file" / "out.json")
    assert "--json" in _refused("sixfold-simulate", "run", "--model", "rm1", "--max-rows", "300", "--qps", "10",
                                "--host-spec", "host-cpu", "--duration", "1", "--json", inside_a_file)
    assert "--report" in _refused("sixfold-loadgen", "--url", "127.0.0.1:1", "--model", "rm1", "--qps", "1",
                                  "--duration", "1", "--report", inside_a_file)
