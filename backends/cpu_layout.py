"""Which layout serves a model's dense part: the host's own cores, emulated cards, or a plug-in's devices.

``--backend auto`` (sixfold-serve's default; the simulator's ``--cpu-host``) resolves here, once:

- a plug-in backend (one not shipped with sixfold) that reports a device on this machine: its cards;
- else emulated cards (simcard: six m2-cards unless ``--cards``/``--card-spec`` say otherwise).

``--backend cpu`` asks for the ``cpu`` layout by name: the dense partition on one ONNX Runtime lane per
usable host core (``sixfold.backends.host.usable_cores``), each lane a single-thread session with real
timing, priced with a spec of one core calibrated on this machine (``auto_core_spec``). It is not what
``auto`` picks: measured side by side on the 2-core host (BENCHMARKS.md, "Latency-bounded throughput
against NVIDIA Triton"), six emulated cards served dlrm-mlperf at 2.7x its rate at p99 <= 60 ms and 2.0x at
250 ms, because they split every large batch over the cores where the cpu layout's load-time split probe
kept 700-item batches on one core. ``auto`` picks the cpu layout again once it serves better where it is
measured. Any other name is that backend, as before.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sixfold.backends.host.native import write_json_atomic
from sixfold.backends.host.usable_cores import UsableCores, usable_cores
from sixfold.backends.spec import DeviceSpec

__all__ = ["AUTO", "CPU", "LANE_BACKEND", "BUILTIN_BACKENDS", "Layout", "resolve_layout", "cpu_layout",
           "auto_core_spec", "core_spec_path", "core_spec_from_host"]

AUTO = "auto"
CPU = "cpu"
LANE_BACKEND = "onnxruntime"
"""The backend a cpu lane runs on: ONNX Runtime, one single-thread session per lane."""
CORE_CALIBRATE_SECONDS = 4.0
"""The one-core calibration's default budget: a lane's spec prices one session's small GEMMs, measured in less
time than the whole host's (``--host-spec auto``, 10 s), since the first start of a default server waits for both."""
BUILTIN_BACKENDS = frozenset({"simcard", "onnxruntime", "torch", "host-embedding"})
"""Backends shipped with sixfold: none of them is an accelerator found on this machine."""


@dataclass(frozen=True)
class Layout:
    """What ``--backend`` resolved to."""

    name: str
    """"cpu", or the card backend's name ("simcard", a plug-in's)."""
    backend: str
    """The backend the dense lanes load on."""
    cards: int | None
    """Dense lanes (cards, or host cores); None: as the caller defaults (a repository's plan)."""
    card_spec: str | DeviceSpec | None
    """The lanes' spec; None: as the caller defaults."""
    reason: str
    """Why, in words, for the start-up plan."""
    cores: UsableCores | None = None

    @property
    def on_host(self) -> bool:
        """Whether the dense lanes are the host's own cores (no card emulated, no link)."""
        return self.name == CPU


def core_spec_from_host(host: DeviceSpec, threads: int) -> DeviceSpec:
    """One core of ``host`` (measured with ``threads`` threads), for hosts with no one-thread calibration:
    FLOP/s and bandwidths shared evenly, fixed costs as measured."""
    share = max(1, threads)
    return dataclasses.replace(host, name="host-core", kind="card", link_bandwidth=0, link_latency_s=0.0,
                               peak_flops={k: v / share for k, v in host.peak_flops.items()},
                               memory_bandwidth=host.memory_bandwidth / share,
                               gather_bandwidth=host.gather_bandwidth / share,
                               description=f"one of {share} cores of {host.name}")


def core_spec_path(seconds_budget: float | None = None) -> Path:
    """The cached file of ``auto_core_spec`` (calibrating first when there is none): a spec any ``--card-spec`` takes."""
    auto_core_spec(seconds_budget)
    from sixfold.backends.host.calibrate import cache_dir, machine_key
    return cache_dir() / f"host-core-{machine_key()}.json"


def auto_core_spec(seconds_budget: float | None = None) -> DeviceSpec:
    """One core of this machine as a lane's spec: calibrated at one thread once, cached beside ``--host-spec auto``.

    The first call measures for ``seconds_budget`` (default $SIXFOLD_CALIBRATE_SECONDS, else ``CORE_CALIBRATE_SECONDS``)
    and says so on stderr; later calls read the file (delete it to measure again).
    """
    from sixfold.backends.host.calibrate import cache_dir, calibrate_host, machine_key

    target = cache_dir() / f"host-core-{machine_key()}.json"
    if target.is_file():
        try:
            return DeviceSpec.from_dict(json.loads(target.read_text()))
        except (ValueError, TypeError, KeyError):  # stale or damaged: measure again
            pass
    budget = seconds_budget or float(os.environ.get("SIXFOLD_CALIBRATE_SECONDS", str(CORE_CALIBRATE_SECONDS)))
    print(f"sixfold: calibrating one core of this host once ({budget:g} s); cached in {target}", file=sys.stderr)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    spec = calibrate_host(budget, threads=1, name=f"host-core-{machine_key()}")
    spec = dataclasses.replace(spec, kind="card",
                               description=f"{spec.description}; load average {load:.1f} while measured")
    write_json_atomic(target, spec.to_dict())
    return spec


def cpu_layout(cards: int | None = None, *, cores: UsableCores | None = None, reason: str = "",
               core_spec: DeviceSpec | None = None) -> Layout:
    """The cpu layout: one lane per usable core (``cards`` lanes when given), priced per core."""
    cores = cores or usable_cores()
    lanes = cards if cards is not None else cores.count
    if lanes < 1:
        raise ValueError(f"the cpu layout needs at least 1 lane, got {lanes}")
    spec = core_spec or auto_core_spec()
    why = reason or f"--backend cpu: dense on {lanes} lane{'s' if lanes != 1 else ''} of {cores.describe()}"
    return Layout(CPU, LANE_BACKEND, lanes, spec, why, cores)


def _plugin_with_device(infos: dict) -> str | None:  # noqa: ANN001 - registry.BackendInfo by name
    """The first usable plug-in backend (not shipped with sixfold) that reports a device here."""
    for name, info in infos.items():
        if name in BUILTIN_BACKENDS or not info.usable or info.cls is None:
            continue
        try:
            if info.cls().devices():
                return name
        except Exception:  # noqa: BLE001 - a backend that cannot list devices has none to offer
            continue
    return None


def resolve_layout(backend: str, *, cards: int | None = None, card_spec: str | None = None,
                   infos: dict | None = None, cores: UsableCores | None = None,
                   core_spec: DeviceSpec | None = None) -> Layout:
    """``--backend`` (with ``--cards``/``--card-spec`` as given, None: not given) as a Layout (module docstring).

    ``infos``: the registry's ``discover()`` (looked up when None); ``cores``/``core_spec``: for tests.
    """
    if backend == CPU:
        if card_spec is not None:
            raise ValueError(f"--backend cpu prices its lanes as this host's cores; --card-spec {card_spec} "
                             "names emulated cards: give --backend simcard for those")
        return cpu_layout(cards, cores=cores, core_spec=core_spec)
    if backend != AUTO:
        return Layout(backend, backend, cards, card_spec, f"--backend {backend}")
    if infos is None:
        from sixfold.backends.registry import discover
        infos = discover()
    plugin = _plugin_with_device(infos)
    if plugin is not None:
        return Layout(plugin, plugin, cards, card_spec, f"accelerator backend {plugin} reports a device here")
    if cards is not None or card_spec is not None:
        given = " and ".join(f for f, v in (("--cards", cards), ("--card-spec", card_spec)) if v is not None)
        return Layout("simcard", "simcard", cards, card_spec, f"no accelerator backend; {given} given: emulated cards")
    return Layout("simcard", "simcard", cards, card_spec,
                  "no accelerator backend: emulated cards (they serve this host better than --backend cpu: "
                  "BENCHMARKS.md)")
