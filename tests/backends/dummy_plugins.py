"""Backends that registry tests point entry points at: one unavailable, one whose probe raises."""

from __future__ import annotations

from backends.api import Backend, Executable, PartitionArtifact
from backends.spec import DeviceSpec


class NeedsDriver(Backend):
    """A vendor backend whose runtime is not installed here."""

    name = "needs-driver"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return False, "libvendor.so.3 not found (install the vendor driver)"

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        raise AssertionError("never loaded: unavailable")


class ProbeRaises(NeedsDriver):
    """A vendor backend whose availability probe itself crashes."""

    name = "probe-raises"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        raise OSError("device node /dev/vendor0 is busy")
