"""The README's curl examples work as written, against a real server (only the port is swapped)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def _curl_lines() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()
            if line.strip().startswith("curl ")]


def test_the_readme_has_curl_examples() -> None:
    assert len(_curl_lines()) >= 2


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("line", _curl_lines())
def test_a_readme_curl_example_works(line: str, served_rm2) -> None:
    command = line.replace("127.0.0.1:8000", served_rm2.http_url).replace("curl -s", "curl -sf", 1)  # -f: 4xx fails
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (command, result.stderr)
    if "-w '%{http_code}" in command:
        assert result.stdout.strip() == "200"
    else:
        assert '"name": "rm2"' in result.stdout, result.stdout
