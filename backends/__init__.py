"""Device layer: the Backend interface, device specs, the registry and built-in backends."""

from .api import Arrays, Backend, BackendError, DoesNotFit, Executable, PartitionArtifact
from .spec import DeviceSpec, load_spec, spec_names

__all__ = [
    "Arrays", "Backend", "BackendError", "DoesNotFit", "Executable", "PartitionArtifact",
    "DeviceSpec", "load_spec", "spec_names",
]
