"""Device layer: the Backend interface, device specs, the registry and built-in backends."""

from sixfold.backends.api import Arrays, Backend, BackendError, DoesNotFit, Executable, PartitionArtifact
from sixfold.backends.memory import check_fits, format_bytes
from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend, OnnxRuntimeExecutable
from sixfold.backends.registry import BackendInfo, BackendNotFound, describe, discover, get_backend
from sixfold.backends.builtin.simcard import SimCardBackend, SimCardExecutable, SimCardStats
from sixfold.backends.spec import DeviceSpec, spec_names
from sixfold.backends.spec_catalog import load_spec
from sixfold.backends.builtin.torch_backend import TorchBackend, TorchExecutable

__all__ = [
    "Arrays", "Backend", "BackendError", "DoesNotFit", "Executable", "PartitionArtifact",
    "DeviceSpec", "load_spec", "spec_names",
    "check_fits", "format_bytes",
    "BackendInfo", "BackendNotFound", "describe", "discover", "get_backend",
    "OnnxRuntimeBackend", "OnnxRuntimeExecutable",
    "SimCardBackend", "SimCardExecutable", "SimCardStats",
    "TorchBackend", "TorchExecutable",
]
