"""numpy-ref: an example out-of-tree sixfold backend that runs ONNX partitions on numpy.

It stands in for a vendor's card runtime: ``load`` "compiles" the partition
(here: builds an ``onnx.reference.ReferenceEvaluator``, numpy all the way
down) after checking it fits the device; ``run`` checks its inputs and
executes. It is slow next to ONNX Runtime and exact enough to pass the
conformance kit (``python -m sixfold.backends.conformance numpy-ref``).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# Only names from sixfold.backends (its __all__: the versioned Backend API); nothing from its submodules.
from sixfold.backends import (
    Backend, BackendError, DeviceSpec, Executable, PartitionArtifact, check_fits, reject_unknown,
)

__all__ = ["NumpyRefBackend", "NumpyRefExecutable", "SPECS_DIR"]

SPECS_DIR = Path(__file__).parent / "specs"
"""The named specs this package ships (entry point group ``sixfold.device_specs`` points here)."""

_DTYPES = {1: np.float32, 6: np.int32, 7: np.int64, 10: np.float16, 11: np.float64}  # onnx TensorProto codes


class NumpyRefExecutable(Executable):
    """One partition "on the card": a ReferenceEvaluator plus the input contract it checks."""

    def __init__(self, artifact: PartitionArtifact, device: DeviceSpec, evaluator: Any,
                 contract: dict[str, tuple[Any, tuple[int | None, ...]]], weight_bytes: int,
                 backend: "NumpyRefBackend") -> None:
        super().__init__(artifact, device)
        self._evaluator = evaluator
        self._contract = contract
        self._weight_bytes = weight_bytes
        self._backend = backend

    def _check(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The partition's inputs, checked against the model's declared dtypes and shapes."""
        feed: dict[str, np.ndarray] = {}
        for name in self.input_names:
            if name not in inputs:
                raise BackendError(f"numpy-ref: partition {self.artifact.name}: missing input {name!r}; "
                                   f"got {', '.join(sorted(inputs)) or 'none'}")
            array = np.asarray(inputs[name])
            dtype, shape = self._contract[name]
            if dtype is not None and array.dtype != dtype:
                raise BackendError(f"numpy-ref: input {name} is {array.dtype}, the partition takes {np.dtype(dtype)}")
            if len(shape) != array.ndim or any(d is not None and d != a for d, a in zip(shape, array.shape)):
                want = "x".join("?" if d is None else str(d) for d in shape)
                raise BackendError(f"numpy-ref: input {name} has shape {array.shape}, the partition takes [{want}]")
            feed[name] = array
        return feed

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        evaluator = self._evaluator
        if evaluator is None:
            raise BackendError(f"numpy-ref: partition {self.artifact.name} on {self.device.name} is closed")
        feed = self._check(inputs)
        try:
            values = evaluator.run(list(self.output_names), feed)
        except Exception as exc:
            raise BackendError(f"numpy-ref failed on partition {self.artifact.name}: {type(exc).__name__}: {exc}") from exc
        return {n: np.asarray(v) for n, v in zip(self.output_names, values)}

    def memory_bytes(self) -> int:
        return self._weight_bytes

    def close(self) -> None:
        """Free the evaluator and give this partition's memory back to its device (idempotent)."""
        super().close()
        if self._evaluator is not None:
            self._evaluator = None
            card = self.artifact.card.device_name if self.artifact.card is not None else self.device.name
            self._backend._release(card, self._weight_bytes)


class NumpyRefBackend(Backend):
    """ONNX partitions on numpy through ``onnx.reference.ReferenceEvaluator``.

    No options. Memory is budgeted per physical card (``artifact.card``, else the device's name): partitions
    loaded on one card share its ``memory_bytes``, and ``close()`` gives a share back.
    """

    name = "numpy-ref"
    formats = ("onnx",)
    api_version = "1.3"  # the sixfold.backends.BACKEND_API_VERSION this was written against

    def __init__(self, **options: Any) -> None:
        reject_unknown(self.name, options, ())
        super().__init__()
        self._lock = threading.Lock()
        self._used: dict[str, int] = {}

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            from onnx.reference import ReferenceEvaluator  # noqa: F401
        except ImportError as exc:
            return False, f"onnx.reference is not importable: {exc}"
        return True, ""

    def devices(self) -> list[DeviceSpec]:
        """The "card" found on this machine: the host's cores and a quarter of its memory, probed now.

        sixfold lists it as ``numpy-ref-local`` (``--card-spec numpy-ref-local``).
        """
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
        except (ValueError, OSError, AttributeError):
            memory = 2**31
        cores = os.cpu_count() or 1
        return [DeviceSpec(name="numpy-ref-local", memory_bytes=int(memory), peak_flops={"fp32": 5e10 * cores},
                           memory_bandwidth=1e10, link_bandwidth=0.0, kind="card",
                           description=f"numpy on this host ({cores} cores), probed by numpy-ref")]

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> NumpyRefExecutable:
        if not self.supports(artifact):
            raise BackendError(f"numpy-ref takes onnx partitions; partition {artifact.name} is {artifact.format!r}")
        import onnx
        from onnx.reference import ReferenceEvaluator

        try:
            model = (onnx.load_model_from_string(bytes(artifact.payload))
                     if isinstance(artifact.payload, (bytes, bytearray, memoryview)) else onnx.load(str(artifact.payload)))
        except Exception as exc:
            raise BackendError(f"numpy-ref could not read partition {artifact.name}: {exc}") from exc
        weights = sum(int(onnx.numpy_helper.to_array(t).nbytes) for t in model.graph.initializer)
        need = max(weights, artifact.param_bytes)
        # The physical card this load is for (Backend API 1.3): a real driver opens device artifact.card.index
        # here. Loads for no one card (artifact.card None: the kit's own, a tool's) budget by the device's name.
        card = artifact.card.device_name if artifact.card is not None else device.name
        with self._lock:  # reserve before compiling: refuse at load, quoting both numbers
            used = self._used.get(card, 0)
            check_fits(dataclasses.replace(artifact, param_bytes=need), device, device.memory_bytes - used)
            self._used[card] = used + need
        try:
            evaluator = ReferenceEvaluator(model)
            contract = {vi.name: _contract(vi) for vi in model.graph.input}
            missing = [n for n in artifact.input_names if n not in contract]
            if missing:
                raise BackendError(f"numpy-ref: partition {artifact.name}: inputs {missing} not in the model")
        except BaseException:
            self._release(card, need)
            raise
        return NumpyRefExecutable(artifact, device, evaluator, contract, need, self)

    def _release(self, device_name: str, nbytes: int) -> None:
        with self._lock:
            self._used[device_name] = max(0, self._used.get(device_name, 0) - nbytes)


def _contract(value_info: Any) -> tuple[Any, tuple[int | None, ...]]:
    """(numpy dtype or None, dims with None for symbolic ones) from an ONNX graph input."""
    tensor = value_info.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
    return _DTYPES.get(tensor.elem_type), dims
