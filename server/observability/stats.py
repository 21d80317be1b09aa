"""Per-model inference statistics in Triton's shape (ModelStatistics needs real counts).

Written and read on the event loop only (requests, batches and the ModelStatistics RPC all
run there), so the counters take no lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Duration", "ModelStats"]


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.ns += int(seconds * 1e9)


@dataclass
class ModelStats:
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    inference_count: int = 0
    """Items (rows) inferred."""
    execution_count: int = 0
    """Batches executed."""
    last_inference_ms: int = 0

    def record_success(self, total_s: float, queue_s: float, input_s: float, infer_s: float,
                       output_s: float, rows: int) -> None:
        # NOTE: once per request on the event loop: the adds are written out, not Duration.add calls.
        success, queue, cin, cinfer, cout = (self.success, self.queue, self.compute_input, self.compute_infer,
                                             self.compute_output)
        success.count += 1
        success.ns += int(total_s * 1e9)
        queue.count += 1
        queue.ns += int(queue_s * 1e9)
        cin.count += 1
        cin.ns += int(input_s * 1e9)
        cinfer.count += 1
        cinfer.ns += int(infer_s * 1e9)
        cout.count += 1
        cout.ns += int(output_s * 1e9)
        self.inference_count += rows
        self.last_inference_ms = int(time.time() * 1000)

    def record_failure(self, total_s: float) -> None:
        self.fail.add(total_s)
        self.last_inference_ms = int(time.time() * 1000)

    def record_batch(self) -> None:
        self.execution_count += 1
