"""The vendor surface: everything a backend plug-in needs, importable as ``from sixfold.backends import ...``.

The names in ``__all__`` are the Backend API, versioned by ``BACKEND_API_VERSION``
("MAJOR.MINOR"; ``sixfold.backends.api`` says what a major and a minor change
mean). A plug-in derives from ``Backend`` and ``Executable``, states the
version it was written against in ``Backend.api_version``, and registers
through the entry-point group ``sixfold.backends`` (``ENTRY_POINT_GROUP``);
named device specs go in the group ``sixfold.device_specs`` (``SPECS_GROUP``).
Modules under ``sixfold.backends`` that are not re-exported here (``host``,
``conformance``'s internals, ``simcard``'s fault options, ...) are sixfold's
own and may change within a major version; the conformance kit is
``sixfold.backends.conformance`` (``python -m sixfold.backends.conformance``).

Modules inside ``sixfold.backends`` import from its submodules
(``sixfold.backends.api``, ``.registry``, ...), never from this package, so it
can re-export the built-in backends without an import cycle.
"""

# The interface and its version.
from sixfold.backends.api import (
    BACKEND_API_VERSION, Arrays, Backend, BackendError, CardRef, DeviceLost, DoesNotFit, Executable, PartitionArtifact,
    TensorLayout, parse_api_version,
)
# Devices: what a partition is priced and checked against, and the named ones.
from sixfold.backends.spec import DeviceSpec, spec_names
from sixfold.backends.spec_catalog import SPECS_GROUP, SpecConflict, UnknownSpec, load_spec
# Memory: refuse at load with both numbers.
from sixfold.backends.memory import check_fits, format_bytes
# Options: refuse misspelt ones, check types.
from sixfold.backends.options import bool_option, int_option, reject_unknown
# Naming the threads a runtime starts.
from sixfold.backends.os_threads import name_this_thread
# Discovery.
from sixfold.backends.registry import (
    BACKENDS_ENV, ENTRY_POINT_GROUP, BackendInfo, BackendNotFound, describe, discover, get_backend,
)
# Built-in backends a plug-in may delegate to (as simcard delegates its outputs to onnxruntime).
from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend, OnnxRuntimeExecutable
from sixfold.backends.builtin.simcard import SimCardBackend, SimCardExecutable, SimCardStats
from sixfold.backends.builtin.torch_backend import TorchBackend, TorchExecutable

__all__ = [
    "BACKEND_API_VERSION", "parse_api_version",
    "Arrays", "Backend", "BackendError", "DeviceLost", "DoesNotFit", "Executable", "PartitionArtifact", "TensorLayout",
    "CardRef",
    "DeviceSpec", "load_spec", "spec_names", "SPECS_GROUP", "SpecConflict", "UnknownSpec",
    "check_fits", "format_bytes",
    "reject_unknown", "int_option", "bool_option",
    "name_this_thread",
    "ENTRY_POINT_GROUP", "BACKENDS_ENV", "BackendInfo", "BackendNotFound", "describe", "discover", "get_backend",
    "OnnxRuntimeBackend", "OnnxRuntimeExecutable",
    "SimCardBackend", "SimCardExecutable", "SimCardStats",
    "TorchBackend", "TorchExecutable",
]
