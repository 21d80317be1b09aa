"""Explicit model control over a model repository: index, load, unload, version swaps.

Loading reads and loads a version off the event loop (it can take seconds),
then swaps it in between two awaits: a request without a version goes to the
new one from then on; the versions the policy no longer selects stop taking
requests and drain (what they queued is answered) before their devices close.
So a version swap under traffic fails no request, and loading or unloading one
model never touches another's queue.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sixfold.server.core import InferenceCore
from sixfold.server.errors import (InvalidInput, ModelNotFound, ServingError, Unauthenticated, Unavailable,
                                   clip_names)
from sixfold.server.memory.gc_pause import freeze_loaded_objects, thaw
from sixfold.server.model.served import ServedModel
from sixfold.server.loading.repository import ModelRepository, RepositoryError
from sixfold.server.model.warmup import warm_up

__all__ = ["ModelControl", "ModelState", "LoadFn", "check_change_parameters", "authorized_control"]

log = logging.getLogger(__name__)

LoadFn = Callable[[ModelRepository, str, str], ServedModel]
"""(repository, name, version) -> a loaded, ready ServedModel. Runs in a worker thread."""


def authorized_control(core: InferenceCore, authorization: str, token: str | None, *,
                       changes: bool) -> "ModelControl":
    """The core's ModelControl for a caller of either transport: model control must be on and, for a
    change, explicit and (with a ``--control-token``) ``authorization`` must be ``Bearer <token>``."""
    control = core.control
    if control is None:
        raise Unavailable("this server has no model repository (start sixfold-serve with --model-repository)")
    if not changes:
        return control
    if not control.explicit:
        raise Unavailable("model control is disabled; start sixfold-serve with --model-control-mode explicit")
    if token is not None and not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
        raise Unauthenticated("model control needs the header 'authorization: Bearer <token>' "
                              "with the server's --control-token")
    return control


def check_change_parameters(action: str, names: Iterable[str]) -> None:
    """Refuse the parameters of a model load or unload that sixfold does not take (InvalidInput: 400 over
    REST, INVALID_ARGUMENT over gRPC): a ``config`` or ``file:`` override above all, which Triton would
    load instead of the repository's; one check for both transports, so neither ignores what the other
    refuses. ``names``: the parameters left once a table delta (``sixfold.server.deltas``) is ruled out.
    """
    # NOTE: unload_dependents (tritonclient sends it) means nothing without ensembles.
    unsupported = sorted(set(names) - ({"unload_dependents"} if action == "unload" else set()))
    if unsupported:
        raise InvalidInput(f"model {action}: 'parameters' {clip_names(unsupported)} are not supported (no config or file "
                           "overrides); sixfold loads what the repository holds")


@dataclass
class ModelState:
    name: str
    version: str
    state: str
    """Triton's words: READY, LOADING, UNLOADING, UNAVAILABLE."""
    reason: str = ""


class ModelControl:
    def __init__(self, core: InferenceCore, repository: ModelRepository, load: LoadFn, *,
                 explicit: bool = False, warmup: bool = True) -> None:
        self.core, self.repository, self._load = core, repository, load
        self.warmup = warmup
        """Run synthetic batches through a loaded version before it is served (``sixfold.server.model.warmup``)."""
        self.explicit = explicit
        """Whether clients may load and unload models (Triton's --model-control-mode=explicit)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._states: dict[str, ModelState] = {}

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    def index(self, ready_only: bool = False) -> list[ModelState]:
        """Every model in the repository (and every loaded version), with its state."""
        states: list[ModelState] = []
        names = set(self.repository.names()) | set(self.core.versions)
        for name in sorted(names):
            loaded = self.core.versions.get(name, {})
            for version in sorted(loaded, key=lambda v: (len(v), v)):
                model = loaded[version]  # loaded but unable to answer now (every card out, no host fallback)
                states.append(ModelState(name, version, "READY") if model.ready
                              else ModelState(name, version, "UNAVAILABLE", model.not_ready_because()))
            if not loaded:
                states.append(self._states.get(name, ModelState(name, "", "UNAVAILABLE", "unloaded")))
        return [s for s in states if s.state == "READY"] if ready_only else states

    async def load(self, name: str) -> list[str]:
        """Load (or reload) the versions the model's policy selects; returns them.

        Versions already served and still selected are kept as they are; new ones
        are loaded before anything is removed, so the model never goes missing.
        """
        async with self._lock(name):
            try:
                wanted = await asyncio.to_thread(self.repository.served_versions, name)
            except RepositoryError as exc:
                raise ModelNotFound(str(exc)) from None
            current = dict(self.core.versions.get(name, {}))
            fresh = [v for v in wanted if v not in current]
            self._states[name] = ModelState(name, ",".join(fresh), "LOADING")
            loaded: list[ServedModel] = []
            try:
                for version in fresh:
                    log.info("loading model %s version %s", name, version,
                             extra={"event": "model_loading", "model": name, "version": version})
                    loaded.append(await asyncio.to_thread(self._load, self.repository, name, version))
            except Exception as exc:  # noqa: BLE001 - a failed load leaves what was served serving
                for model in loaded:
                    model.runtime.close()
                reason = f"{type(exc).__name__}: {exc}"
                self._states[name] = ModelState(name, "", "UNAVAILABLE", reason)
                log.error("model %s failed to load: %s", name, reason,
                          extra={"event": "model_load_failed", "model": name})
                if isinstance(exc, ServingError):
                    raise
                raise Unavailable(f"failed to load model '{name}': {reason}") from None
            if self.warmup:
                for model in loaded:
                    await warm_up(model)
                broken = [m for m in loaded if m.warmup_failed]
                if broken:  # refused like a failed load: what was served keeps serving
                    for model in loaded:
                        await asyncio.to_thread(model.runtime.close)
                    reason = f"version {broken[0].version}: {broken[0].warmup_failed}"
                    self._states[name] = ModelState(name, "", "UNAVAILABLE", reason)
                    log.error("model %s failed to load: %s", name, reason,
                              extra={"event": "model_load_failed", "model": name})
                    raise Unavailable(f"failed to load model '{name}': {reason}")
            for model in loaded:  # swap in: from here requests without a version reach the newest
                self.core.add(model)
            stale = [v for v in current if v not in wanted]
            for version in stale:
                await self._retire(name, version)
            if loaded or stale:
                freeze_loaded_objects()  # what is served now out of full collections (sixfold.server.memory.gc_pause)
            self._states.pop(name, None)
            for model in loaded:
                log.info("model %s version %s ready", name, model.version,
                         extra={"event": "model_ready", "model": name, "version": model.version})
            return wanted

    async def unload(self, name: str) -> list[str]:
        """Stop serving every version of ``name``; queued requests are answered first."""
        async with self._lock(name):
            versions = list(self.core.versions.get(name, {}))
            if not versions:
                raise ModelNotFound(f"model '{name}' is not loaded; loaded: {sorted(self.core.versions)}")
            for version in versions:
                await self._retire(name, version)
            freeze_loaded_objects()  # collects what the retired versions left, freezes the rest again
            self._states[name] = ModelState(name, "", "UNAVAILABLE", "unloaded")
            return versions

    async def _retire(self, name: str, version: str) -> None:
        model = self.core.remove(name, version)
        if model is None:
            return
        log.info("unloading model %s version %s (draining)", name, version,
                 extra={"event": "model_unloading", "model": name, "version": version})
        await model.batcher.close(drain=True)
        await asyncio.to_thread(model.runtime.close)
        thaw()  # its objects may be frozen: the collector must see its cycles (the caller refreezes)
        log.info("model %s version %s unloaded", name, version,
                 extra={"event": "model_unloaded", "model": name, "version": version})
