"""Shared test helpers: free ports and tritonclient inputs from canonical requests."""

from __future__ import annotations

import socket

import numpy as np

_DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def triton_inputs(client_module, request: dict[str, np.ndarray]) -> list:
    """tritonclient InferInputs (sync or aio module) carrying ``request``'s arrays as raw bytes."""
    inputs = []
    for name, array in request.items():
        item = client_module.InferInput(name, list(array.shape), _DATATYPES[array.dtype])
        item.set_data_from_numpy(array)
        inputs.append(item)
    return inputs
