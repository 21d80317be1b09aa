"""--backend auto / cpu resolution, and the one-core spec the cpu layout's lanes are priced with."""

from __future__ import annotations

import json
from importlib.metadata import EntryPoint

import pytest

from sixfold.backends.cpu_layout import (CPU, LANE_BACKEND, auto_core_spec, core_spec_from_host, core_spec_path,
                                         resolve_layout)
from sixfold.backends.host.usable_cores import UsableCores
from sixfold.backends.registry import discover_from
from sixfold.backends.spec_catalog import load_spec

GROUP = "sixfold.backends"
ORT = EntryPoint("onnxruntime", "sixfold.backends.builtin.onnxruntime_backend:OnnxRuntimeBackend", GROUP)
SIMCARD = EntryPoint("simcard", "sixfold.backends.builtin.simcard:SimCardBackend", GROUP)
SHIPS = EntryPoint("ships-devices", "tests.backends.dummy_plugins:ShipsDevices", GROUP)
NEEDS_DRIVER = EntryPoint("needs-driver", "tests.backends.dummy_plugins:NeedsDriver", GROUP)
THREE = UsableCores(count=3, affinity=4, quota=2.5)
CORE = core_spec_from_host(load_spec("host-calibrated"), threads=2)


def test_auto_with_no_accelerator_emulates_cards_and_cpu_by_name_is_one_lane_per_usable_core() -> None:
    infos = discover_from([ORT, SIMCARD, NEEDS_DRIVER])
    layout = resolve_layout("auto", infos=infos, cores=THREE, core_spec=CORE)
    assert (layout.name, layout.backend, layout.cards, layout.on_host) == ("simcard", "simcard", None, False)
    assert "serve this host better than --backend cpu" in layout.reason
    layout = resolve_layout(CPU, infos=infos, cores=THREE, core_spec=CORE)
    assert (layout.name, layout.backend, layout.cards, layout.card_spec) == (CPU, LANE_BACKEND, 3, CORE)
    assert layout.on_host
    assert layout.reason == "--backend cpu: dense on 3 lanes of 3 host cores (affinity 4, cgroup quota 2.5 CPUs)"


def test_auto_emulates_cards_only_when_cards_or_a_card_spec_are_asked_for() -> None:
    infos = discover_from([ORT, SIMCARD])
    by_count = resolve_layout("auto", cards=6, infos=infos, cores=THREE, core_spec=CORE)
    assert (by_count.name, by_count.cards, by_count.card_spec, by_count.on_host) == ("simcard", 6, None, False)
    assert "--cards given" in by_count.reason
    by_spec = resolve_layout("auto", card_spec="m2-card", infos=infos, cores=THREE, core_spec=CORE)
    assert (by_spec.backend, by_spec.cards, by_spec.card_spec) == ("simcard", None, "m2-card")


def test_auto_takes_a_plugin_that_reports_a_device_here() -> None:
    layout = resolve_layout("auto", infos=discover_from([ORT, SIMCARD, NEEDS_DRIVER, SHIPS]), cores=THREE,
                            core_spec=CORE)
    assert (layout.name, layout.backend, layout.on_host) == ("ships-devices", "ships-devices", False)
    assert "reports a device" in layout.reason


def test_a_named_backend_is_kept_as_given() -> None:
    layout = resolve_layout("simcard", cards=2, card_spec="m2-card")
    assert (layout.backend, layout.cards, layout.card_spec, layout.on_host) == ("simcard", 2, "m2-card", False)


def test_cpu_by_name_takes_a_lane_count_and_refuses_a_card_spec() -> None:
    layout = resolve_layout("cpu", cards=1, cores=THREE, core_spec=CORE)
    assert (layout.cards, layout.backend) == (1, LANE_BACKEND)
    assert layout.reason.startswith("--backend cpu: dense on 1 lane of 3 host cores")
    with pytest.raises(ValueError, match="--card-spec m2-card"):
        resolve_layout("cpu", card_spec="m2-card", cores=THREE, core_spec=CORE)


def test_a_core_is_a_share_of_the_host_with_no_link() -> None:
    host = load_spec("host-calibrated")
    assert CORE.kind == "card" and CORE.link_bandwidth == 0
    assert CORE.peak_flops["fp32"] == pytest.approx(host.peak_flops["fp32"] / 2)
    assert CORE.per_batch_seconds == host.per_batch_seconds  # fixed costs are per call, not shared


def test_the_core_spec_is_calibrated_once_and_read_back(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("SIXFOLD_CACHE_DIR", str(tmp_path))
    spec = auto_core_spec(seconds_budget=0.5)
    assert "calibrating one core" in capsys.readouterr().err
    assert spec.kind == "card" and spec.peak_flops["fp32"] > 0 and "1 thread(s)" in spec.description
    path = core_spec_path()
    assert json.loads(path.read_text())["name"] == spec.name
    assert auto_core_spec() == spec  # read from the cache: no second calibration
    assert "calibrating" not in capsys.readouterr().err
    assert load_spec(str(path)) == spec  # a --card-spec file like any other
