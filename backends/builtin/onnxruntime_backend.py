"""ONNX Runtime backend: runs ONNX partitions on any execution provider this machine has.

One InferenceSession per load, i.e. per card, so replicas share nothing and a
session's threads belong to its card. Threads default to one per session: the
server runs one worker per card already, and N cards x M threads on a small
host would oversubscribe it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sixfold.backends.api import Arrays, Backend, BackendError, Executable, PartitionArtifact
from sixfold.backends.memory import check_fits
from sixfold.backends.options import int_option, reject_unknown
from sixfold.backends.spec import DeviceSpec

__all__ = ["OnnxRuntimeBackend", "OnnxRuntimeExecutable", "Provider"]

Provider = str | tuple[str, dict[str, Any]]
"""An execution provider name, or (name, provider options) as onnxruntime takes them."""


def _ort() -> Any:
    # NOTE: imported lazily so `import sixfold.backends` stays cheap and a missing
    # onnxruntime makes this backend "unavailable" rather than unimportable.
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendError(f"onnxruntime is not importable: {exc}") from exc
    return onnxruntime


def _run_binding(run: Any, options: Any, outputs: list[str], feed: Mapping[str, np.ndarray]) -> list:
    return run(outputs, feed, options)


class OnnxRuntimeExecutable(Executable):
    """An ONNX partition in its own InferenceSession; ``run`` is thread-safe (onnxruntime's is)."""

    thread_safe = True

    def __init__(self, artifact: PartitionArtifact, device: DeviceSpec, session: Any) -> None:
        super().__init__(artifact, device)
        self._session: Any | None = session
        self._outputs = list(artifact.output_names)
        # NOTE: on the CPU provider alone, the binding's own run: InferenceSession.run adds ~6 us of
        # Python per call (an input-name check sixfold's feed never fails, and a provider-fallback
        # retry that only GPU providers use), a tenth of a small batch's dense stage.
        binding = getattr(session, "_sess", None)
        if list(session.get_providers()) == ["CPUExecutionProvider"] and hasattr(binding, "run"):
            self._run = functools.partial(_run_binding, binding.run, _ort().RunOptions())
        else:
            self._run = session.run

    @property
    def providers(self) -> list[str]:
        """The providers the session actually runs on, in priority order."""
        return list(self._live_session().get_providers())

    def _live_session(self) -> Any:
        if self._session is None:
            raise BackendError(f"partition {self.artifact.name} on {self.device.name} is closed")
        return self._session

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """Feed only the partition's inputs (callers may pass more) and return its outputs."""
        self._live_session()  # raises once closed
        try:
            feed = {n: inputs[n] for n in self.input_names}
        except KeyError as exc:
            raise BackendError(f"partition {self.artifact.name}: missing input {exc.args[0]!r}; "
                               f"got {', '.join(sorted(inputs)) or 'none'}") from None
        try:
            values = self._run(self._outputs, feed)
        except Exception as exc:
            raise BackendError(f"onnxruntime failed on partition {self.artifact.name}: {exc}") from exc
        return dict(zip(self._outputs, values))

    def close(self) -> None:
        super().close()
        self._session = None


class OnnxRuntimeBackend(Backend):
    """ONNX partitions through ONNX Runtime.

    Options: ``providers`` (default ["CPUExecutionProvider"]; each must be in
    ``onnxruntime.get_available_providers()``), ``intra_op_threads`` and
    ``inter_op_threads`` (default 1 each; 0 lets onnxruntime choose).
    """

    name = "onnxruntime"
    formats = ("onnx",)

    def __init__(self, *, providers: Sequence[Provider] | None = None, intra_op_threads: int = 1,
                 inter_op_threads: int = 1, **options: Any) -> None:
        reject_unknown(self.name, options, ("providers", "intra_op_threads", "inter_op_threads"))
        providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self.providers = self._check_providers(providers)
        self.intra_op_threads = int_option(self.name, "intra_op_threads", intra_op_threads)
        self.inter_op_threads = int_option(self.name, "inter_op_threads", inter_op_threads)
        super().__init__(providers=self.providers, intra_op_threads=self.intra_op_threads,
                         inter_op_threads=self.inter_op_threads)

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            _ort()
        except BackendError as exc:
            return False, str(exc)
        return True, ""

    @staticmethod
    def _check_providers(providers: list[Provider]) -> list[Provider]:
        here = list(_ort().get_available_providers())
        if not providers:
            raise BackendError(f"backend onnxruntime: providers is empty; available here: {', '.join(here)}")
        names = [p if isinstance(p, str) else p[0] for p in providers]
        missing = [n for n in names if n not in here]
        if missing:
            raise BackendError(f"backend onnxruntime: execution provider(s) {', '.join(missing)} "
                               f"not available here; available: {', '.join(here)}")
        return providers

    def _session_options(self) -> Any:
        so = _ort().SessionOptions()
        so.intra_op_num_threads = self.intra_op_threads
        so.inter_op_num_threads = self.inter_op_threads
        so.log_severity_level = 3  # errors only; warnings become BackendErrors or noise
        return so

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> OnnxRuntimeExecutable:
        """Open an InferenceSession for ``artifact`` (ONNX bytes or a path); DoesNotFit if too big."""
        if not self.supports(artifact):
            raise BackendError(f"backend onnxruntime takes {', '.join(self.formats)} partitions; "
                               f"partition {artifact.name} is {artifact.format!r}")
        check_fits(artifact, device)
        model = _model_source(artifact)
        try:
            session = _ort().InferenceSession(model, sess_options=self._session_options(),
                                              providers=self.providers)
        except Exception as exc:
            raise BackendError(f"onnxruntime could not load partition {artifact.name}: {exc}") from exc
        _check_names(artifact, "input", [i.name for i in session.get_inputs()], artifact.input_names)
        _check_names(artifact, "output", [o.name for o in session.get_outputs()], artifact.output_names)
        return OnnxRuntimeExecutable(artifact, device, session)


def _model_source(artifact: PartitionArtifact) -> str | bytes:
    payload = artifact.payload
    if isinstance(payload, (str, os.PathLike)):
        path = Path(payload)
        if not path.is_file():
            raise BackendError(f"partition {artifact.name}: no ONNX file at {path}")
        return str(path)
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    raise BackendError(f"partition {artifact.name}: ONNX payload must be bytes or a path, "
                       f"got {type(payload).__name__}")


def _check_names(artifact: PartitionArtifact, kind: str, model_names: list[str], wanted: Sequence[str]) -> None:
    missing = [n for n in wanted if n not in model_names]
    if missing:
        raise BackendError(f"partition {artifact.name}: {kind}(s) {', '.join(missing)} not in the ONNX model; "
                           f"its {kind}s: {', '.join(model_names)}")
