"""Test factories for the backends: a small ONNX MLP (built with onnx.helper), specs, a fake clock.

Keyword defaults everywhere, so a test names only what it is about.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sixfold.backends.api import Arrays, Backend, Executable, PartitionArtifact
from sixfold.backends.spec import DeviceSpec

__all__ = ["Mlp", "mlp", "device", "FakeClock", "Clocked", "batch"]


@dataclass
class Mlp:
    """An ONNX MLP and its numpy twin: scores = sigmoid(relu([a, b] @ w1 + b1) @ w2 + b2)."""

    onnx_bytes: bytes
    weights: dict[str, np.ndarray]
    inputs: tuple[str, ...] = ("dense_features", "boundary")
    widths: tuple[int, ...] = (3, 5)

    def reference(self, feed: Mapping[str, np.ndarray]) -> np.ndarray:
        w = self.weights
        x = np.concatenate([feed[n] for n in self.inputs], axis=1).astype(np.float64)
        h = np.maximum(x @ w["w1"] + w["b1"], 0.0)
        return (1.0 / (1.0 + np.exp(-(h @ w["w2"] + w["b2"])))).astype(np.float32)

    @property
    def param_bytes(self) -> int:
        return sum(a.nbytes for a in self.weights.values())

    def artifact(self, name: str = "dense", *, payload: object | None = None, **costs: object) -> PartitionArtifact:
        """This MLP as a partition artifact; ``costs`` overrides param_bytes, flops_per_item, ..."""
        fields: dict = {"param_bytes": self.param_bytes, **costs}
        return PartitionArtifact(name=name, format="onnx",
                                 payload=self.onnx_bytes if payload is None else payload,
                                 input_names=self.inputs, output_names=("scores",), **fields)


def mlp(widths: tuple[int, int] = (3, 5), hidden: int = 16, seed: int = 0) -> Mlp:
    """Build the MLP with onnx.helper; inputs have a dynamic batch dimension "N"."""
    rng = np.random.default_rng(seed)
    d = sum(widths)
    weights = {
        "w1": rng.standard_normal((d, hidden), dtype=np.float32) / np.float32(np.sqrt(d)),
        "b1": rng.standard_normal(hidden, dtype=np.float32) * np.float32(0.1),
        "w2": rng.standard_normal((hidden, 1), dtype=np.float32) / np.float32(np.sqrt(hidden)),
        "b2": np.array([0.05], dtype=np.float32),
    }
    names = ("dense_features", "boundary")
    nodes = [
        helper.make_node("Concat", list(names), ["x"], axis=1),
        helper.make_node("MatMul", ["x", "w1"], ["xw1"]),
        helper.make_node("Add", ["xw1", "b1"], ["pre"]),
        helper.make_node("Relu", ["pre"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["hw2"]),
        helper.make_node("Add", ["hw2", "b2"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes, "mlp",
        inputs=[helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", w]) for n, w in zip(names, widths)],
        outputs=[helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["N", 1])],
        initializer=[numpy_helper.from_array(a, name=k) for k, a in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="sixfold-tests")
    model.ir_version = 8  # readable by any onnxruntime >= 1.10
    onnx.checker.check_model(model)
    return Mlp(onnx_bytes=model.SerializeToString(), weights=weights, inputs=names, widths=tuple(widths))


def batch(m: Mlp, rows: int, seed: int = 0) -> Arrays:
    """A feed of ``rows`` rows for ``m``."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal((rows, w), dtype=np.float32) for n, w in zip(m.inputs, m.widths)}


def device(name: str = "unit-card", *, memory_bytes: int = 1 << 30, flops: float = 1e9,
           memory_bandwidth: float = 2e9, link_bandwidth: float = 1e9, link_latency_s: float = 1e-3,
           kind: str = "card", **extra: object) -> DeviceSpec:
    """A card with round numbers, so expected service times can be worked out by hand."""
    peak = extra.pop("peak_flops", {"fp32": flops})
    return DeviceSpec(name=name, memory_bytes=memory_bytes, peak_flops=peak,  # type: ignore[arg-type]
                      memory_bandwidth=memory_bandwidth, link_bandwidth=link_bandwidth,
                      link_latency_s=link_latency_s, efficiency=1.0, kind=kind, **extra)  # type: ignore[arg-type]


@dataclass
class FakeClock:
    """A clock that moves only when told. ``sleep`` records the delay and returns without moving it.

    With the clock standing still, a batch released by ``sleep(d)`` requested
    at time t is released at exactly t + d.
    """

    now: float = 0.0
    sleeps: list[float] = field(default_factory=list)

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await asyncio.sleep(0)


class _ClockedExecutable(Executable):
    def __init__(self, inner: Executable, clock: FakeClock, compute_s: float, gate: threading.Event) -> None:
        super().__init__(inner.artifact, inner.device)
        self.inner, self.clock, self.compute_s, self.gate = inner, clock, compute_s, gate

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        if not self.gate.wait(timeout=10):
            raise TimeoutError("the test never opened the gate")
        out = self.inner.run(inputs)
        self.clock.now += self.compute_s
        return out

    def close(self) -> None:
        super().close()
        self.inner.close()


class Clocked(Backend):
    """A real backend whose every run also takes ``compute_s`` on a fake clock (a slow host, scripted).

    Runs wait for ``gate`` (open by default), so a test can queue several
    batches at one fake instant before any of them computes.
    """

    name = "clocked"

    def __init__(self, inner: Backend, clock: FakeClock, compute_s: float, gate_open: bool = True) -> None:
        super().__init__()
        self.inner, self.clock, self.compute_s = inner, clock, compute_s
        self.gate = threading.Event()
        if gate_open:
            self.gate.set()
        self.formats = inner.formats  # type: ignore[misc]

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        return _ClockedExecutable(self.inner.load(artifact, device), self.clock, self.compute_s, self.gate)
