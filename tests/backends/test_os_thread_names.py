"""Executables' worker threads carry their partition and device in the kernel's thread name."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from backends.api import Executable, PartitionArtifact
from backends.os_thread_names import os_thread_name
from backends.spec import load_spec


class _Echo(Executable):
    def run(self, inputs):  # noqa: ANN001, ANN201
        return {"y": np.asarray(inputs["x"])}


def _kernel_names() -> list[str]:
    return sorted(p.read_text().strip() for p in Path(f"/proc/{os.getpid()}/task").glob("*/comm"))


def test_name_keeps_the_card_and_fits_the_kernel() -> None:
    assert os_thread_name("dense", "m2-card/card3") == "dense@card3"
    assert os_thread_name("sparse", "host-cpu") == "sparse@host-cpu"
    long = os_thread_name("dense_stage_12", "m2-card/card5")
    assert long == "dense_stage_12@"[:15] and len(long.encode()) <= 15


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc thread names are Linux's")
def test_worker_thread_is_named_in_the_kernel() -> None:
    spec = load_spec("m2-card")
    exe = _Echo(PartitionArtifact("dense", "onnx", b"", ("x",), ("y",)), spec)
    try:
        assert "dense@m2-card" not in _kernel_names()
        out = asyncio.run(exe.infer({"x": np.arange(3)}))
        assert out["y"].tolist() == [0, 1, 2]
        assert "dense@m2-card" in _kernel_names()
    finally:
        exe.close()
    assert "dense@m2-card" not in _kernel_names()
