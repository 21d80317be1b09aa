"""Triton's own C++ load generator (perf_analyzer) runs against sixfold without error."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import models

from .conftest import MAX_ROWS

TOOL = Path(__file__).resolve().parents[3] / "shared" / "tools" / "perf_analyzer"


@pytest.mark.skipif(not TOOL.exists(), reason=f"perf_analyzer wrapper not found at {TOOL}")
def test_perf_analyzer_with_real_tensors(served_rm2, tmp_path) -> None:
    gen = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=5)
    data = []
    for items in (1, 16, 120):
        request = gen.make(items)
        data.append({name: {"content": array.ravel().tolist(), "shape": list(array.shape)}
                     for name, array in request.items()})
    input_data = tmp_path / "input.json"
    input_data.write_text(json.dumps({"data": data}))
    cmd = [str(TOOL), "-m", "rm2", "-i", "grpc", "-u", served_rm2.url, "--input-data", str(input_data),
           "--concurrency-range", "1:2", "--measurement-interval", "1500", "--stability-percentage", "100",
           "--max-trials", "3"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    throughput = [float(x) for x in re.findall(r"Concurrency: \d+, throughput: ([\d.]+) infer/sec", output)]
    assert len(throughput) == 2 and all(t > 0 for t in throughput), output
