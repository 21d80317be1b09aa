"""Device layer: the Backend interface, device specs, the registry and built-in backends."""

from .api import Arrays, Backend, BackendError, DoesNotFit, Executable, PartitionArtifact
from .memory import check_fits, format_bytes
from .onnxruntime_backend import OnnxRuntimeBackend, OnnxRuntimeExecutable
from .registry import BackendInfo, BackendNotFound, describe, discover, get_backend
from .simcard import SimCardBackend, SimCardExecutable, SimCardStats
from .spec import DeviceSpec, load_spec, spec_names
from .torch_backend import TorchBackend, TorchExecutable

__all__ = [
    "Arrays", "Backend", "BackendError", "DoesNotFit", "Executable", "PartitionArtifact",
    "DeviceSpec", "load_spec", "spec_names",
    "check_fits", "format_bytes",
    "BackendInfo", "BackendNotFound", "describe", "discover", "get_backend",
    "OnnxRuntimeBackend", "OnnxRuntimeExecutable",
    "SimCardBackend", "SimCardExecutable", "SimCardStats",
    "TorchBackend", "TorchExecutable",
]
