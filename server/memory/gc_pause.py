"""Keep the cyclic garbage collector's full passes short: freeze what a loaded server holds for good.

A served model drags in torch, onnxruntime, protobuf and their modules: ~190k objects that the
collector tracks. Python's full (generation 2) collection walks every one of them, and it runs on
whichever thread happens to allocate when the thresholds trip, holding the GIL: measured 95 ms
in a process with rm2 loaded. In the server that is a stall of the event loop and of every stage
worker at once, at random, a few times a minute under load: the 50-60 ms "decode" and 100 ms
"host stage" outliers of MLPerf-sized rm2 traffic (``bench/latency_breakdown.py``).

``gc.freeze()`` (the CPython API made for forking servers, used so by Instagram's Django fleet)
moves every object alive now into a permanent generation that collections skip; objects made
afterwards (requests, batches) are collected as before. Freeze once a server is up and again after
each model load; before a model is unloaded, ``thaw`` so that its cyclic garbage can be found.
"""

from __future__ import annotations

import gc

__all__ = ["freeze_loaded_objects", "thaw"]


def freeze_loaded_objects() -> int:
    """Collect once, then move every surviving object out of the collector's reach; returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Put frozen objects back under the collector (before dropping a model, whose cycles must be found)."""
    gc.unfreeze()
