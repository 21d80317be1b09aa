"""Executables' worker threads carry their partition and device in the kernel's thread name, and a
simulated card's computes at a lower priority than the server's threads."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from sixfold.backends.api import Backend, BackendError, Executable, PartitionArtifact
from sixfold.backends.os_threads import os_thread_name
from sixfold.backends.spec_catalog import load_spec


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_a_thread_lowers_only_itself() -> None:
    import threading

    from sixfold.backends.os_threads import lower_this_thread

    seen: dict[str, int] = {}

    def worker() -> None:
        lower_this_thread(3)
        seen["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == min(19, main + 3)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_simulated_cards_compute_nicer_than_the_server() -> None:
    from sixfold.backends.builtin.simcard import DEFAULT_WORKER_NICE, SimCardBackend

    main = os.getpriority(os.PRIO_PROCESS, 0)
    for options, expected in (({}, DEFAULT_WORKER_NICE), ({"worker_nice": 0}, 0)):
        backend = SimCardBackend(functional=_EchoBackend(), **options)
        card = backend.load(PartitionArtifact("dense", "echo", b"", ("x",), ("y",)), load_spec("m2-card"))
        try:
            asyncio.run(card.infer({"x": np.arange(2)}))
            tid = next(int(p.parent.name) for p in Path(f"/proc/{os.getpid()}/task").glob("*/comm")
                       if p.read_text().strip() == "dense@m2-card")
            assert os.getpriority(os.PRIO_PROCESS, tid) == min(19, main + expected)
        finally:
            card.close()
    with pytest.raises(BackendError, match="worker_nice"):
        SimCardBackend(functional=_EchoBackend(), worker_nice=-1)


class _EchoBackend(Backend):
    name = "echo-for-test"
    formats = ("echo",)

    def load(self, artifact, device):  # noqa: ANN001, ANN201
        return _Echo(artifact, device)
