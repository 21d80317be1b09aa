"""The serving core: models by name and version, readiness, inference. No transport code here."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from sixfold.server.errors import ModelNotFound, Unavailable, clip
from sixfold.server.model.served import ServedModel
from sixfold.server.protocol.shared_memory import SharedMemoryRegistry

__all__ = ["InferenceCore"]

log = logging.getLogger(__name__)


def _version_key(version: str) -> tuple[int, str]:
    return (int(version), version) if version.isdigit() else (-1, version)


class InferenceCore:
    """Every ready model version, by name. A request without a version goes to the newest one.

    Adding and removing versions happens on the event loop between awaits, so a
    request sees either the old set or the new one, never a half-made model.
    """

    def __init__(self, models: Iterable[ServedModel] = ()) -> None:
        self.versions: dict[str, dict[str, ServedModel]] = {}
        self._newest: dict[str, ServedModel] = {}
        """Each model's newest version, kept by add/remove: a request without a version looks it up."""
        for model in models:
            self.add(model)
        self.accepting = True
        self.draining = False
        """Shutting down but still serving (``ServerConfig.drain_seconds``): not ready."""
        self.active_rpcs = 0
        self.last_rpc_at = 0.0
        self.control = None
        """A ModelControl when the server has a model repository (RepositoryIndex/Load/Unload)."""
        self.shared_memory: SharedMemoryRegistry | None = SharedMemoryRegistry()
        """System shared memory regions clients registered (Triton's extension); None: refused."""
        self._was_ready: dict[tuple[str, str, int], bool] = {}

    def rpc_started(self) -> None:
        self.active_rpcs += 1
        self.last_rpc_at = time.monotonic()

    def rpc_finished(self) -> None:
        self.active_rpcs -= 1

    @property
    def ready(self) -> bool:
        """Server readiness: accepting, not draining, and every served version ready (``ServedModel.ready``:
        warmed up and with a path that can answer now), as Triton's strict readiness."""
        return self.accepting and not self.draining and bool(self.versions) and all(
            model.ready for versions in self.versions.values() for model in versions.values())

    def model_ready(self, name: str, version: str = "") -> bool:
        """Whether that version (newest without one) is served and can answer now (KServe's model readiness)."""
        try:
            model = self.model(name, version)
        except ModelNotFound:
            return False
        return self.accepting and not self.draining and model.ready

    def readiness_changes(self) -> list[tuple[ServedModel, bool]]:
        """The versions whose readiness changed since the last call, with their new readiness; each change
        is logged (a version going not ready says why). Called by the server's readiness watcher."""
        changes = []
        seen = self._was_ready
        current = {}
        for model in self.all_versions():
            key = (model.name, model.version, id(model))
            ready = current[key] = model.ready
            if seen.get(key, True) != ready:
                changes.append((model, ready))
                if ready:
                    log.warning("model %s version %s is ready again", model.name, model.version)
                else:
                    log.warning("model %s version %s is not ready: %s", model.name, model.version,
                                model.not_ready_because())
        self._was_ready = current
        return changes

    @property
    def models(self) -> dict[str, ServedModel]:
        """The newest version of every model."""
        return {name: self._newest[name] for name in sorted(self.versions)}

    def all_versions(self) -> list[ServedModel]:
        return [m for name in sorted(self.versions)
                for _, m in sorted(self.versions[name].items(), key=lambda kv: _version_key(kv[0]))]

    def _update_newest(self, name: str) -> None:
        versions = self.versions.get(name)
        if versions:
            self._newest[name] = versions[max(versions, key=_version_key)]
        else:
            self._newest.pop(name, None)

    def add(self, model: ServedModel) -> ServedModel | None:
        """Serve ``model``; returns the version it replaces (same name and version), if any."""
        versions = self.versions.setdefault(model.name, {})
        old = versions.get(model.version)
        versions[model.version] = model
        self._update_newest(model.name)
        return old

    def remove(self, name: str, version: str) -> ServedModel | None:
        """Stop routing to one version; the caller drains and closes it."""
        versions = self.versions.get(name, {})
        model = versions.pop(version, None)
        if not versions:
            self.versions.pop(name, None)
        self._update_newest(name)
        return model

    def model(self, name: str, version: str = "") -> ServedModel:
        if version == "":
            newest = self._newest.get(name)
            if newest is not None:
                return newest
        versions = self.versions.get(name)
        if not versions:
            raise ModelNotFound(f"unknown model '{clip(name)}'; serving: {sorted(self.versions)}")
        model = versions.get(version)
        if model is None:
            raise ModelNotFound(f"model '{clip(name)}' has no version '{clip(version)}'; "
                                f"versions: {sorted(versions, key=_version_key)}")
        return model

    def serving(self, name: str, version: str = "") -> ServedModel:
        """The model version an inference request goes to; Unavailable while shutting down."""
        model = self.model(name, version)
        if not self.accepting:
            raise Unavailable("server is shutting down; not accepting new requests")
        return model

    async def shutdown(self) -> None:
        """Stop accepting, answer what is queued and running, then release the devices."""
        self.accepting = False
        models = self.all_versions()
        for model in models:
            await model.batcher.close(drain=True)
        for model in models:
            model.runtime.close()
