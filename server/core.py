"""The serving core: models by name and version, readiness, inference. No transport code here."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np

from .errors import ModelNotFound, Unavailable
from .model import ServedModel

__all__ = ["InferenceCore"]


class InferenceCore:
    def __init__(self, models: Iterable[ServedModel] = ()) -> None:
        self.models: dict[str, ServedModel] = {m.name: m for m in models}
        self.accepting = True
        self.active_rpcs = 0
        self.last_rpc_at = 0.0

    def rpc_started(self) -> None:
        self.active_rpcs += 1
        self.last_rpc_at = time.monotonic()

    def rpc_finished(self) -> None:
        self.active_rpcs -= 1

    @property
    def ready(self) -> bool:
        return self.accepting and bool(self.models)

    def model(self, name: str, version: str = "") -> ServedModel:
        model = self.models.get(name)
        if model is None:
            raise ModelNotFound(f"unknown model '{name}'; serving: {sorted(self.models)}")
        if version not in ("", model.version):
            raise ModelNotFound(f"model '{name}' has no version '{version}'; versions: ['{model.version}']")
        return model

    async def infer(self, name: str, version: str, inputs: dict[str, np.ndarray],
                    requested: list[str], timeout_s: float | None = None) -> tuple[ServedModel, dict[str, np.ndarray]]:
        model = self.model(name, version)
        if not self.accepting:
            raise Unavailable("server is shutting down; not accepting new requests")
        return model, await model.infer(inputs, requested, timeout_s)

    async def shutdown(self) -> None:
        """Stop accepting, answer what is queued and running, then release the devices."""
        self.accepting = False
        for model in self.models.values():
            await model.batcher.close(drain=True)
        for model in self.models.values():
            model.runtime.close()
