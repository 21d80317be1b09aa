"""Triton's system shared memory extension: tensors in a co-located client's POSIX segments.

A client on the same host (a ranking service's sidecar, ``sixfold-loadgen --client shm``,
``perf_analyzer --shared-memory system``) writes a query's tensors into a segment it made with
``shm_open``, registers the segment once under a region name, and then sends requests that name a
region, an offset and a byte size instead of carrying the bytes. A 700-item rm2 query is 21 MB of
ids: over gRPC those bytes are copied by the client's stack, the loopback and the server's stack,
on the same cores the host stage needs; from a region, the server's input arrays are read-only
views of the client's pages and nothing is copied before the batcher.

The contract is Triton's: the client keeps a region's bytes unchanged while a request that reads
them is in flight, and does not shrink a segment while it is registered. The server checks the
segment's size on every use, so a segment shrunk between requests fails the request (naming the
region) instead of faulting the process; one shrunk *during* a request is the client breaking the
contract, as with Triton. A region unregistered while requests still read it stays mapped until
the last of them is answered.

Errors follow Triton's codes: registering a name twice is ALREADY_EXISTS, the status of an unknown
region NOT_FOUND, a request naming an unknown region or bytes outside it INVALID_ARGUMENT.

Only a client on this host can share memory with the server, so a registration from any other peer
is a mistake or an attack (a remote client naming a local segment, to have scores written into it):
it is refused with PERMISSION_DENIED (``check_local_peer``), whatever ``--host`` the server binds.
Unregistering is guarded the same way (``check_local_peer`` in both front ends' unregister).

Only regular POSIX shared memory objects are mapped: the key is one name (no '/', no '..', no NUL),
opened relative to the shm directory with ``O_NOFOLLOW`` (a symlink is refused, so a client cannot
have scores written into a file it points at, as the server's user), and the opened object must be a
regular file on the shm directory's filesystem (``fstat``: ``S_ISREG`` and the same ``st_dev``).
Each mapping holds a descriptor (CPython's mmap keeps a dup), so the number of regions and the bytes
they map are capped (``MAX_REGIONS``, ``MAX_REGION_BYTES``): beyond a cap, RESOURCE_EXHAUSTED (REST 429).
"""

from __future__ import annotations

import ipaddress
import math
import mmap
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from sixfold.server.errors import InvalidInput, Overloaded, Unavailable, clip

__all__ = ["RegionStatus", "SharedMemoryRegistry", "RegionExists", "RegionNotFound", "NotLocal", "TooManyRegions",
           "SHM_ROOT", "MAX_REGIONS", "MAX_REGION_BYTES",
           "SharedMemoryRef", "check_local_peer", "grpc_peer_host", "enabled", "tensor_from_region",
           "check_output_region", "write_output"]

SharedMemoryRef = tuple[str, int, int]
"""(region name, offset, byte size) of a tensor kept in shared memory, as a request names it."""

SHM_ROOT = Path("/dev/shm")
"""Where Linux keeps ``shm_open``'s objects: key ``/name`` is the file ``/dev/shm/name``."""


MAX_REGIONS = 1024
"""Most regions one server holds at once (each mapping holds a file descriptor)."""

MAX_REGION_BYTES = 64 << 30
"""Most bytes (``offset + byte_size`` of every region, what is mapped) one server maps at once: 64 GiB."""


class TooManyRegions(Overloaded):
    """A registration past MAX_REGIONS or MAX_REGION_BYTES (gRPC RESOURCE_EXHAUSTED; REST 429)."""

    reason = "shm_limit"


class RegionExists(InvalidInput):
    """Registering a name twice (gRPC ALREADY_EXISTS; REST 400, as Triton answers)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class RegionNotFound(InvalidInput):
    """The status of a region nobody registered (gRPC NOT_FOUND; REST 400)."""

    code = grpc.StatusCode.NOT_FOUND


class NotLocal(InvalidInput):
    """A registration from a peer that is not on this host (gRPC PERMISSION_DENIED; REST 403)."""

    code = grpc.StatusCode.PERMISSION_DENIED
    reason = "not_local"


def check_local_peer(host: str | None, action: str = "registration") -> None:
    """Refuse a peer that is not on this host: ``host`` is an address (REST's client host, or the
    address part of gRPC's ``ipv4:A:P`` / ``ipv6:[A]:P`` peer), None or empty for a Unix socket;
    ``action`` ("registration", "unregistration") names what is refused."""
    if not host or host.startswith("unix:"):
        return
    try:
        address = ipaddress.ip_address(host)
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual-stack socket
        local = (mapped or address).is_loopback
    except ValueError:
        local = host == "localhost"
    if not local:
        raise NotLocal(f"system shared memory is for clients on this host; {action} from {host} is "
                       "refused (connect over loopback, from the server's network namespace)")


def grpc_peer_host(peer: str) -> str:
    """The address in a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``)."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return peer if kind == "unix" else rest or peer


@dataclass(frozen=True)
class RegionStatus:
    """One registered region, as SystemSharedMemoryStatus reports it."""

    name: str
    key: str
    offset: int
    byte_size: int


class _Region:
    __slots__ = ("status", "map", "view")

    def __init__(self, status: RegionStatus, mapping: mmap.mmap) -> None:
        self.status = status
        self.map = mapping
        self.view = memoryview(mapping)[status.offset:status.offset + status.byte_size]


def _check_int(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{what} must be a non-negative integer, got {clip(repr(value))}")
    return value


class SharedMemoryRegistry:
    """The regions registered with one server, by name (shared by its gRPC and REST front ends)."""

    def __init__(self, root: Path | str = SHM_ROOT, *, max_regions: int = MAX_REGIONS,
                 max_bytes: int = MAX_REGION_BYTES) -> None:
        self.root = Path(root)
        self.max_regions = max_regions
        self.max_bytes = max_bytes
        self._regions: dict[str, _Region] = {}

    @property
    def mapped_bytes(self) -> int:
        """Bytes mapped by every region (``offset + byte_size`` each), what MAX_REGION_BYTES caps."""
        return sum(r.status.offset + r.status.byte_size for r in self._regions.values())

    def __len__(self) -> int:
        return len(self._regions)

    def _name(self, key: str) -> str:
        """The object's name in the shm directory: one component, never one that leads out of it."""
        name = key[1:] if key.startswith("/") else key
        if not name or "/" in name or ".." in name or name == "." or "\0" in name:
            raise InvalidInput(f"shared memory key {clip(repr(key))} must name a POSIX shared memory object "
                               "('/name', no other '/', no '..')")
        return name

    def _open(self, name: str, key: str, region: str) -> int:
        """A descriptor of the regular shm object ``key``: never through a symlink, never a file
        outside the shm filesystem, never a FIFO, device or directory."""
        path = self.root / name
        dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY,
                             dir_fd=dir_fd)
            except FileNotFoundError:
                raise InvalidInput(f"region '{clip(region)}': no shared memory object with key {clip(repr(key))} "
                                   f"({path} does not exist)") from None
            except OSError as exc:
                if os.path.islink(path):  # ELOOP from O_NOFOLLOW
                    raise InvalidInput(f"region '{clip(region)}': shared memory key {clip(repr(key))} is a symbolic link "
                                       f"({path}); only regular shared memory objects are mapped") from None
                raise InvalidInput(f"region '{clip(region)}': cannot open shared memory key {clip(repr(key))}: "
                                   f"{exc.strerror}") from None
            try:
                info, root_info = os.fstat(fd), os.fstat(dir_fd)
                if not stat.S_ISREG(info.st_mode):
                    raise InvalidInput(f"region '{clip(region)}': shared memory key {clip(repr(key))} is not a regular shared "
                                       f"memory object ({path})")
                if info.st_dev != root_info.st_dev:
                    raise InvalidInput(f"region '{clip(region)}': shared memory key {clip(repr(key))} is not on the shared memory "
                                       f"filesystem of {self.root}")
            except BaseException:
                os.close(fd)
                raise
            return fd
        finally:
            os.close(dir_fd)

    def register(self, name: str, key: str, offset: int, byte_size: int) -> RegionStatus:
        """Map ``byte_size`` bytes at ``offset`` of the segment ``key`` under ``name``."""
        if not name:
            raise InvalidInput("shared memory region name is empty")
        if name in self._regions:
            raise RegionExists(f"shared memory region '{clip(name)}' is already registered "
                               f"(key {clip(repr(self._regions[name].status.key))}); unregister it first")
        offset = _check_int(offset, f"region '{clip(name)}': offset")
        byte_size = _check_int(byte_size, f"region '{clip(name)}': byte_size")
        if byte_size == 0:
            raise InvalidInput(f"region '{clip(name)}': byte_size is 0")
        object_name = self._name(key)
        if len(self._regions) >= self.max_regions:
            raise TooManyRegions(f"region '{clip(name)}': {len(self._regions)} shared memory regions are registered, "
                                 f"the server's cap (max regions {self.max_regions}); unregister some first")
        mapped = self.mapped_bytes
        if mapped + offset + byte_size > self.max_bytes:
            raise TooManyRegions(f"region '{clip(name)}': mapping offset {offset} + byte_size {byte_size} would take the "
                                 f"registered shared memory from {mapped} to {mapped + offset + byte_size} bytes, "
                                 f"past the server's cap (max bytes {self.max_bytes}); unregister some first")
        fd = self._open(object_name, key, name)
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInput(f"region '{clip(name)}': offset {offset} + byte_size {byte_size} = "
                                   f"{offset + byte_size} bytes, but shared memory key {clip(repr(key))} holds {size}")
            try:
                mapping = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as exc:
                raise InvalidInput(f"region '{clip(name)}': cannot map shared memory key {clip(repr(key))}: {exc.strerror}") from None
        finally:
            os.close(fd)  # the mapping keeps the pages (and, in CPython, a dup of the descriptor)
        status = RegionStatus(name, key, offset, byte_size)
        self._regions[name] = _Region(status, mapping)
        return status

    def unregister(self, name: str = "") -> list[str]:
        """Forget ``name`` (every region when empty); unknown names are not an error (Triton's
        rule). In-flight requests keep the pages they read mapped until they are answered."""
        names = [name] if name else list(self._regions)
        gone = [n for n in names if self._regions.pop(n, None) is not None]
        return gone

    def status(self, name: str = "") -> list[RegionStatus]:
        """Every region (``name`` empty) or the one named."""
        if not name:
            return [r.status for r in self._regions.values()]
        region = self._regions.get(name)
        if region is None:
            raise RegionNotFound(f"no shared memory region '{clip(name)}' is registered")
        return [region.status]

    def _slice(self, region_name: str, offset: int, byte_size: int, what: str) -> memoryview:
        region = self._regions.get(region_name)
        if region is None:
            raise InvalidInput(f"{what}: no shared memory region '{clip(region_name)}' is registered")
        status = region.status
        if offset + byte_size > status.byte_size:
            raise InvalidInput(f"{what}: offset {offset} + byte_size {byte_size} runs past shared memory region "
                               f"'{clip(region_name)}' ({status.byte_size} bytes)")
        # NOTE: mmap.size() is an fstat of the segment: a segment shrunk since it was registered
        # would fault the process on access (SIGBUS), so it fails the request instead.
        if region.map.size() < status.offset + offset + byte_size:
            raise InvalidInput(f"{what}: shared memory key {clip(repr(status.key))} of region '{clip(region_name)}' was "
                               f"shrunk to {region.map.size()} bytes after it was registered")
        return region.view[offset:offset + byte_size]

    def read(self, region_name: str, offset: int, byte_size: int, *, what: str) -> memoryview:
        """A read-only view of ``byte_size`` bytes at ``offset`` in the region; ``what`` names the
        tensor in errors."""
        return self._slice(region_name, offset, byte_size, what).toreadonly()

    def check(self, region_name: str, offset: int, byte_size: int, *, what: str) -> None:
        """Fail now, before any work, if a write of ``byte_size`` bytes there would fail."""
        self._slice(region_name, offset, byte_size, what)

    def write(self, region_name: str, offset: int, byte_size: int, data: bytes | memoryview, *, what: str) -> None:
        """Copy ``data`` into the region (an output), refusing what does not fit ``byte_size``."""
        if len(data) > byte_size:
            raise InvalidInput(f"{what}: {len(data)} bytes do not fit the {byte_size} bytes given in "
                               f"shared memory region '{clip(region_name)}'")
        self._slice(region_name, offset, byte_size, what)[:len(data)] = data


# ---- what both front ends do with a tensor that names a region ------------------------------------

def enabled(registry: SharedMemoryRegistry | None) -> SharedMemoryRegistry:
    """The registry for a register/status/unregister call; UNAVAILABLE when the server turned it off."""
    if registry is None:
        raise Unavailable("system shared memory is disabled on this server (sixfold-serve --no-shared-memory)")
    return registry


def tensor_from_region(registry: SharedMemoryRegistry | None, ref: SharedMemoryRef, dtype: np.dtype,
                       shape: Sequence[int], datatype: str, what: str) -> np.ndarray:
    """An input as a read-only view of its region, after checking its byte size against its shape."""
    if registry is None:
        raise InvalidInput(f"{what}: this server does not accept shared memory inputs")
    region, offset, byte_size = ref
    need = math.prod(shape) * dtype.itemsize
    if byte_size != need:
        raise InvalidInput(f"{what}: shared_memory_byte_size is {byte_size} but shape {list(shape)} of "
                           f"{datatype} needs {need}")
    return np.ndarray(tuple(shape), dtype, registry.read(region, offset, byte_size, what=what))


def check_output_region(registry: SharedMemoryRegistry | None, ref: SharedMemoryRef, what: str) -> None:
    """Refuse, before any work, an output whose region does not exist or cannot hold its bytes."""
    if registry is None:
        raise InvalidInput(f"{what}: this server does not accept shared memory outputs")
    registry.check(*ref, what=what)


def write_output(registry: SharedMemoryRegistry | None, ref: SharedMemoryRef, array: np.ndarray,
                 what: str) -> dict[str, str | int]:
    """Write an output into its region; returns the parameters its response tensor carries."""
    assert registry is not None  # check_output_region refused the request otherwise
    region, offset, byte_size = ref
    registry.write(region, offset, byte_size, np.ascontiguousarray(array).data.cast("B"), what=what)
    parameters: dict[str, str | int] = {"shared_memory_region": region, "shared_memory_byte_size": array.nbytes}
    if offset:
        parameters["shared_memory_offset"] = offset
    return parameters
