"""An MLServer custom runtime serving a sixfold zoo model with plain torch (no partitioning).

It is the non-sixfold KServe v2 server that the load generator and the serving
benchmarks are checked against: same model, same weights (same seed), same
tensors, Seldon's server in front.
"""

from __future__ import annotations

import numpy as np
import torch
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from sixfold import models

_ORDER = ("dense_features", "sparse_lengths", "sparse_indices")


class ZooModel(MLModel):
    async def load(self) -> bool:
        extra = (self.settings.parameters.extra if self.settings.parameters else None) or {}
        torch.set_num_threads(int(extra.get("threads", 1)))
        self.model = models.build(extra.get("model", "rm2"), max_rows=extra.get("max_rows"),
                                  seed=int(extra.get("seed", 0)))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        arrays = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        missing = [n for n in _ORDER if n not in arrays]
        if missing:
            raise ValueError(f"missing inputs {missing}")
        with torch.inference_mode():
            tensors = [torch.from_numpy(np.ascontiguousarray(arrays[n])) for n in _ORDER]
            scores = self.model(*tensors).numpy()
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("scores", scores)])
