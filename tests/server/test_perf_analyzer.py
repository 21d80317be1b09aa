"""Triton's own C++ load generator (perf_analyzer) runs against sixfold without error.

It runs through the project's ``scripts/perf_analyzer``, exactly as a user would
(``make perf-analyzer``): the script fetches the two libraries the binary needs on
first use. The test is skipped only when they cannot be obtained (no network, no apt).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from sixfold import models
from sixfold.loadgen import write_perf_analyzer_json

from tests.server.conftest import MAX_ROWS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "perf_analyzer"


@pytest.fixture(scope="module")
def perf_analyzer() -> Path:
    """The script, after it has made sure the binary's libraries are in its cache."""
    result = subprocess.run([str(SCRIPT), "--install-only"], capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.skip(f"perf_analyzer's libraries could not be obtained: {result.stderr.strip()[-400:]}")
    return SCRIPT


@pytest.mark.parametrize("shared_memory", ["none", "system"])
def test_perf_analyzer_with_real_tensors(perf_analyzer, served_rm2, tmp_path, shared_memory) -> None:
    gen = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=5)
    input_data, count = write_perf_analyzer_json((gen.make(items) for items in (1, 16, 120)),
                                                 tmp_path / "input.json")
    assert count == 3
    cmd = [str(perf_analyzer), "-m", "rm2", "-i", "grpc", "-u", served_rm2.url, "--input-data", str(input_data),
           "--concurrency-range", "1:2", "--measurement-interval", "1500", "--stability-percentage", "999",
           "--max-trials", "6",  # NOTE: loose stability: a busy machine must not fail a protocol test
           "--shared-memory", shared_memory, "--output-shared-memory-size", "4096"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    throughput = [float(x) for x in re.findall(r"Concurrency: \d+, throughput: ([\d.]+) infer/sec", output)]
    assert len(throughput) == 2 and all(t > 0 for t in throughput), output


def test_bad_arguments_reach_perf_analyzer(perf_analyzer) -> None:
    """The script passes its arguments through: perf_analyzer itself rejects a missing model name."""
    result = subprocess.run([str(perf_analyzer), "-i", "grpc", "-u", "127.0.0.1:1"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0
    assert "Failed to parse -m (model name)" in result.stdout + result.stderr, result.stdout + result.stderr
