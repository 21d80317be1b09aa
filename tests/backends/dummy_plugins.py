"""Backends that registry tests point entry points at: one unavailable, one whose probe raises."""

from __future__ import annotations

from sixfold.backends.api import Backend, Executable, PartitionArtifact
from sixfold.backends.spec import DeviceSpec


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


# Device specs a vendor package ships (entry-point group sixfold.device_specs) or finds (devices()).

def _card(name: str, gib: int = 8, **kw) -> DeviceSpec:
    return DeviceSpec(name=name, memory_bytes=gib * 2**30, peak_flops={"fp32": 4e12, "int8": 32e12},
                      memory_bandwidth=100e9, link_bandwidth=8e9, link_latency_s=10e-6, **kw)


VENDOR_CARD = _card("vendor-card", description="the vendor's card, as its package ships it")
VENDOR_SPECS = [VENDOR_CARD, {"name": "vendor-card-lite", "memory_bytes": 4 * 2**30, "peak_flops": {"fp32": 1e12},
                              "memory_bandwidth": 50e9, "link_bandwidth": 4e9}]
CLASHES_WITH_M2 = _card("m2-card", gib=32)
"""Another package's "m2-card" with other figures than sixfold's own: a conflict."""


def vendor_specs() -> list:
    """An entry point may name a function returning specs."""
    return VENDOR_SPECS


class ShipsDevices(Backend):
    """A vendor backend that finds its devices on this machine (``devices()``)."""

    name = "ships-devices"

    def devices(self) -> list[DeviceSpec]:
        return [_card("ships-card-0", gib=16), VENDOR_CARD]  # the same vendor-card again: not a conflict

    def load(self, artifact: PartitionArtifact, device: DeviceSpec) -> Executable:
        raise AssertionError("not loaded in these tests")


class DevicesRaise(ShipsDevices):
    """A backend whose device probe crashes: its specs are skipped, the others still resolve."""

    name = "devices-raise"

    def devices(self) -> list[DeviceSpec]:
        raise OSError("/dev/vendor0: permission denied")


# Plug-ins declaring the Backend API they were written against (Backend.api_version).

class FromNextMajor(NeedsDriver):
    """Written against a Backend API major this sixfold does not provide: refused before ``available()``."""

    name = "from-next-major"
    api_version = "2.0"

    @classmethod
    def available(cls) -> tuple[bool, str]:
        raise AssertionError("a plug-in of another major is not probed")


class FromNewerMinor(ShipsDevices):
    """Written against a later minor of this major: loaded, with a warning."""

    name = "from-newer-minor"
    api_version = "1.99"


class MalformedVersion(ShipsDevices):
    """An api_version that is not "MAJOR.MINOR"."""

    name = "malformed-version"
    api_version = 1  # type: ignore[assignment]
