"""Backend discovery: built-ins come through the installed entry points; SIXFOLD_BACKENDS filters;
broken plugins are skipped with their reason, which get_backend and describe repeat."""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, distribution

import pytest

from sixfold.backends import registry
from sixfold.backends.api import BackendError
from sixfold.backends.builtin.onnxruntime_backend import OnnxRuntimeBackend
from sixfold.backends.registry import BackendNotFound, describe, discover, discover_from, get_backend
from sixfold.backends.builtin.simcard import SimCardBackend
from sixfold.backends.builtin.torch_backend import TorchBackend
from tests.backends.factories import batch, device, mlp

GROUP = registry.ENTRY_POINT_GROUP
BUILTINS = {"onnxruntime": OnnxRuntimeBackend, "simcard": SimCardBackend, "torch": TorchBackend}


def ep(name: str, value: str) -> EntryPoint:
    return EntryPoint(name=name, value=value, group=GROUP)


BROKEN = ep("broken", "sixfold_no_such_plugin.card:CardBackend")
NOT_A_BACKEND = ep("ordered", "collections:OrderedDict")
NEEDS_DRIVER = ep("needs-driver", "tests.backends.dummy_plugins:NeedsDriver")
PROBE_RAISES = ep("probe-raises", "tests.backends.dummy_plugins:ProbeRaises")
ORT = ep("onnxruntime", "sixfold.backends.builtin.onnxruntime_backend:OnnxRuntimeBackend")


@pytest.fixture(autouse=True)
def _fresh_cache(fresh_registry):
    """Every test here changes discovery; autouse sets the reset up before monkeypatch."""
    yield


def test_builtins_come_from_the_installed_distributions_entry_points(monkeypatch):
    monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
    declared = {e.name: e.value for e in distribution("sixfold").entry_points if e.group == GROUP}
    found = discover(reload=True)
    for name, cls in BUILTINS.items():
        info = found[name]
        assert (info.status, info.reason, info.cls) == ("ok", "", cls)
        assert info.value == declared[name]
        assert cls.name == name
    assert found["torch"].formats == ("torch-fx",)


def test_discovery_runs_once_per_process_unless_reloaded(monkeypatch):
    monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
    first = discover(reload=True)
    monkeypatch.setenv(registry.BACKENDS_ENV, "torch")
    assert discover() == first                          # cached: the environment is read once
    assert discover(reload=True)["simcard"].status == "filtered"


def test_allowlist_filters_without_importing(monkeypatch):
    monkeypatch.setenv(registry.BACKENDS_ENV, " torch , simcard ")
    found = discover(reload=True)
    assert found["onnxruntime"].status == "filtered"
    assert found["onnxruntime"].cls is None
    assert "SIXFOLD_BACKENDS=simcard,torch" in found["onnxruntime"].reason
    assert found["torch"].status == found["simcard"].status == "ok"
    with pytest.raises(BackendNotFound, match="backend 'onnxruntime' is filtered: not in SIXFOLD_BACKENDS"):
        get_backend("onnxruntime")


def test_simcard_keeps_its_builtin_functional_backend_when_onnxruntime_is_filtered(monkeypatch):
    monkeypatch.setenv(registry.BACKENDS_ENV, "simcard")
    discover(reload=True)
    m = mlp()
    card = get_backend("simcard").load(m.artifact(), device())
    try:
        feed = batch(m, rows=2)
        assert card.run(feed)["scores"].shape == (2, 1)
    finally:
        card.close()


def test_blank_allowlist_means_everything(monkeypatch):
    monkeypatch.setenv(registry.BACKENDS_ENV, " , ")
    assert {i.status for i in discover(reload=True).values()} == {"ok"}


def test_allowlist_naming_no_registered_backend_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="sixfold.backends.registry"):
        found = discover_from([ORT], "onnxruntime,mycard")
    assert found["onnxruntime"].status == "ok"
    assert "mycard" in caplog.text


def test_plugin_that_fails_to_import_is_logged_and_skipped(caplog):
    with caplog.at_level(logging.ERROR, logger="sixfold.backends.registry"):
        found = discover_from([BROKEN, ORT])
    assert found["onnxruntime"].status == "ok"
    broken = found["broken"]
    assert (broken.status, broken.cls) == ("failed", None)
    assert "ModuleNotFoundError" in broken.reason and "sixfold_no_such_plugin" in broken.reason
    assert "broken" in caplog.text and "sixfold_no_such_plugin" in caplog.text


def test_plugin_that_is_not_a_backend_subclass_fails():
    info = discover_from([NOT_A_BACKEND])["ordered"]
    assert info.status == "failed"
    assert "not a subclass of sixfold.backends.api.Backend" in info.reason


def test_unavailable_plugin_keeps_its_class_and_reason():
    info = discover_from([NEEDS_DRIVER])["needs-driver"]
    assert info.status == "unavailable"
    assert info.cls is not None and info.cls.__name__ == "NeedsDriver"
    assert info.reason == "libvendor.so.3 not found (install the vendor driver)"


def test_probe_that_raises_is_a_failure_not_a_crash():
    info = discover_from([PROBE_RAISES])["probe-raises"]
    assert info.status == "failed"
    assert "OSError" in info.reason and "/dev/vendor0" in info.reason


def test_first_registration_of_a_name_wins():
    found = discover_from([ORT, ep("onnxruntime", "tests.backends.dummy_plugins:NeedsDriver")])
    assert found["onnxruntime"].cls is OnnxRuntimeBackend


@pytest.fixture
def with_plugins(monkeypatch):
    """The real registered entry points plus broken/unavailable ones, as if a vendor package were installed."""
    real = list(registry.entry_points(group=GROUP))
    monkeypatch.setattr(registry, "entry_points", lambda group: [*real, BROKEN, NEEDS_DRIVER])
    monkeypatch.delenv(registry.BACKENDS_ENV, raising=False)
    discover(reload=True)


def test_get_backend_errors_list_what_exists_and_why_not(with_plugins):
    with pytest.raises(KeyError) as unknown:
        get_backend("tpu9000")
    message = str(unknown.value)
    assert message.startswith("no backend named 'tpu9000'; registered: ")
    for name in ("onnxruntime", "simcard", "torch", "broken (failed: ", "needs-driver (unavailable: "):
        assert name in message
    with pytest.raises(BackendError, match="backend 'needs-driver' is unavailable: libvendor.so.3 not found"):
        get_backend("needs-driver")
    with pytest.raises(BackendError, match="backend 'broken' is failed: import failed: ModuleNotFoundError"):
        get_backend("broken")


def test_describe_is_a_table_with_reasons(with_plugins):
    lines = describe().splitlines()
    assert lines[0].split() == ["NAME", "STATUS", "FORMATS", "ENTRY", "POINT"]
    rows = {line.split()[0]: i for i, line in enumerate(lines) if not line.startswith(" ")}
    assert lines[rows["torch"]].split() == ["torch", "ok", "torch-fx", "sixfold.backends.builtin.torch_backend:TorchBackend"]
    assert lines[rows["needs-driver"]].split()[1:3] == ["unavailable", "onnx"]
    assert lines[rows["needs-driver"] + 1] == "    libvendor.so.3 not found (install the vendor driver)"
    assert lines[rows["broken"]].split()[1] == "failed"
    assert "ModuleNotFoundError" in lines[rows["broken"] + 1]
    assert lines[-1] == "SIXFOLD_BACKENDS is unset: every registered backend is loaded"


def test_get_backend_passes_options_and_they_are_checked():
    backend = get_backend("onnxruntime", intra_op_threads=2)
    assert isinstance(backend, OnnxRuntimeBackend) and backend.intra_op_threads == 2
    with pytest.raises(BackendError, match="unknown option.*intra_threads.*known: inter_op_threads"):
        get_backend("onnxruntime", intra_threads=2)
