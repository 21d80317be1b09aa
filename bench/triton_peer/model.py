"""A Triton Python-backend model serving a sixfold zoo model with plain torch (no partitioning).

``bench/triton_peer/serve.py`` copies this file into a model repository as ``<model>/1/model.py``. It is the
NVIDIA Triton peer of the serving benchmarks: same model, same weights (same seed), same tensors. With
``max_batch_size > 0`` (dynamic batching) each request carries a leading batch dimension of 1 (see
``sixfold.loadgen.batch_dim``); the requests Triton hands one ``execute`` call are concatenated item-wise
and run as one torch batch, then split back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# NOTE: the stub runs the distribution's python3.11 with its own path: numpy, torch and the zoo come from
# the paths serve.py wrote next to this file
for _path in reversed(json.loads(Path(__file__).with_name("sys_path.json").read_text())):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from sixfold import models  # noqa: E402

_ORDER = ("dense_features", "sparse_lengths", "sparse_indices")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        torch.set_num_threads(int(params.get("threads", "1")))
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.empty = params.get("empty") == "true"  # answers zeros: Triton's own cost, no model
        self.model = None if self.empty else models.build(params["zoo_model"], max_rows=int(params["max_rows"]),
                                                          seed=int(params["seed"]))

    def execute(self, requests: list) -> list:
        arrays = [[pb_utils.get_input_tensor_by_name(r, name).as_numpy() for name in _ORDER] for r in requests]
        if self.batched:  # one batch element per request: drop it, run all requests' items at once
            arrays = [[a[0] for a in request] for request in arrays]
        items = [request[0].shape[0] for request in arrays]
        if self.empty:
            zeros = [np.zeros((n, 1), np.float32) for n in items]
            return [pb_utils.InferenceResponse([pb_utils.Tensor("scores", z[np.newaxis] if self.batched else z)])
                    for z in zeros]
        with torch.inference_mode():
            tensors = [torch.from_numpy(np.ascontiguousarray(np.concatenate([r[i] for r in arrays])))
                       for i in range(len(_ORDER))]
            scores = self.model(*tensors).numpy()
        out, start = [], 0
        for n in items:
            part = scores[start:start + n]
            start += n
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("scores", part[np.newaxis] if self.batched
                                                                   else np.ascontiguousarray(part))]))
        return out
