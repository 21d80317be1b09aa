"""Torch backend: runs ``torch-fx`` partitions (the host embedding stage) on CPU, or CUDA when asked.

The payload is a callable ``torch.nn.Module`` that takes the inputs
positionally in ``input_names`` order and returns a tensor, or a tuple/list of
tensors in ``output_names`` order. Arrays cross as zero-copy views
(``torch.from_numpy`` in, ``Tensor.numpy`` out) under ``torch.inference_mode``.
The module is run as given: put it in eval mode before handing it over.
"""

from __future__ import annotations

import warnings

import contextlib
import copy
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from sixfold.backends.api import Arrays, Backend, BackendError, Executable, PartitionArtifact
from sixfold.backends.memory import check_fits
from sixfold.backends.options import reject_unknown
from sixfold.backends.spec import DeviceSpec

# Inputs arrive as read-only views of gRPC buffers; partitions never write to them.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

__all__ = ["TorchBackend", "TorchExecutable"]

log = logging.getLogger(__name__)

class TorchExecutable(Executable):
    """A torch module on one device; ``run`` may be called from several threads."""

    thread_safe = True

    def __init__(self, artifact: PartitionArtifact, device: DeviceSpec, module: Any, torch_device: str) -> None:
        super().__init__(artifact, device)
        self.module: Any | None = module
        self.torch_device = torch_device
        self.stream: Any | None = None
        if torch_device.startswith("cuda"):
            import torch
            self.stream = torch.cuda.Stream()

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        """Call the module on the partition's inputs (others are ignored) and return numpy outputs."""
        import torch

        module, name = self.module, self.artifact.name
        if module is None:
            raise BackendError(f"partition {name} on {self.device.name} is closed")
        try:
            arrays = [inputs[n] for n in self.input_names]
        except KeyError as exc:
            raise BackendError(f"partition {name}: missing input {exc.args[0]!r}; "
                               f"got {', '.join(sorted(inputs)) or 'none'}") from None
        try:
            # NOTE: on CUDA each executable has its own stream, so N executables on one GPU are
            # N logical cards whose batches overlap; on CPU the stream context is a no-op.
            stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
            with torch.inference_mode(), stream:
                # NOTE: gRPC-decoded inputs are read-only; viewing them is safe since
                # nothing writes to inputs (torch warns once per process, not per batch).
                args = [torch.from_numpy(a).to(self.torch_device, non_blocking=True) for a in arrays]
                out = module(*args)
                if self.stream is not None:
                    self.stream.synchronize()
        except Exception as exc:
            raise BackendError(f"torch failed on partition {name}: {type(exc).__name__}: {exc}") from exc
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if len(outs) != len(self.output_names):
            raise BackendError(f"partition {name} returned {len(outs)} output(s); "
                               f"expected {len(self.output_names)} ({', '.join(self.output_names)})")
        if not all(isinstance(t, torch.Tensor) for t in outs):
            kinds = ", ".join(type(t).__name__ for t in outs)
            raise BackendError(f"partition {name} must return tensors; returned {kinds}")
        try:
            return {n: t.detach().cpu().numpy() for n, t in zip(self.output_names, outs)}
        except (TypeError, RuntimeError) as exc:  # e.g. bfloat16, which numpy lacks
            raise BackendError(f"partition {name}: an output has no numpy equivalent: {exc}") from exc

    def close(self) -> None:
        super().close()
        self.module = None


class TorchBackend(Backend):
    """``torch-fx`` partitions on the host CPU; on CUDA when the device spec's kind is "gpu" and CUDA exists."""

    name = "torch"
    formats = ("torch-fx",)

    def __init__(self, **options: Any) -> None:
        reject_unknown(self.name, options, ())
        super().__init__()

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            return False, f"torch is not importable: {exc}"
        return True, ""

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> TorchExecutable:
        """Wrap ``artifact.payload``; DoesNotFit when its weights exceed the device's memory."""
        import torch

        if not self.supports(artifact):
            raise BackendError(f"backend torch takes {', '.join(self.formats)} partitions; "
                               f"partition {artifact.name} is {artifact.format!r}")
        if not callable(artifact.payload):
            raise BackendError(f"partition {artifact.name}: torch-fx payload must be a callable torch.nn.Module, "
                               f"got {type(artifact.payload).__name__}")
        check_fits(artifact, device)
        module, target = artifact.payload, "cpu"
        if device.kind == "gpu":
            if torch.cuda.is_available():
                # NOTE: a copy, so moving to CUDA never mutates the caller's module.
                module, target = copy.deepcopy(module).to("cuda"), "cuda"
            else:
                log.warning("device %s is a gpu but CUDA is not available; partition %s runs on CPU",
                            device.name, artifact.name)
        return TorchExecutable(artifact, device, module, target)
