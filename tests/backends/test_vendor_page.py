"""docs/vendor.md's walkthrough, run as written: install the example package, find it and its specs, pass the kit."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "vendor.md"
BLOCK = re.compile(r"<!-- walkthrough -->\s*```sh\n(.*?)```", re.S)


def walkthrough() -> list[str]:
    return BLOCK.findall(PAGE.read_text())


def test_the_page_names_only_what_exists():
    text = PAGE.read_text()
    for name in ("Backend", "Executable", "DoesNotFit", "BackendError", "DeviceSpec"):
        assert f"`{name}" in text
    from sixfold import backends
    assert all(hasattr(backends, n) for n in ("Backend", "Executable", "DoesNotFit", "BackendError", "DeviceSpec"))
    from sixfold.backends.conformance import CHECKS
    for check in CHECKS:
        assert f"| `{check}` |" in text, f"the kit's {check} check is not described on the page"
    assert "sixfold.device_specs" in text and "sixfold.backends" in text


def test_the_walkthrough_runs_as_written(tmp_path):
    blocks = walkthrough()
    assert len(blocks) == 3, "the page's walkthrough blocks moved: keep this test and the page in step"
    script = "set -euo pipefail\n" + "\n".join(blocks)
    env = {k: v for k, v in os.environ.items() if k not in ("SIXFOLD_BACKENDS", "PYTHONPATH")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["WORK"] = str(tmp_path)
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = (tmp_path / "kit.txt").read_text()
    assert "PASSED" in report and "op Gemm" in report
