"""--log-format json: every line a process writes is one JSON object, the libraries' own lines included."""

from __future__ import annotations

import json
import subprocess
import sys

from sixfold.server.observability.logs import JsonFormatter, json_line, parse_level
from sixfold.server.workers.process import READY_PREFIX, ready_address

# A process that writes as the server's libraries do: a log record, a Python warning, torch's warning,
# ONNX Runtime's C++ log (a model with an unused initializer), gRPC-core's style, a print, a raw write
# to fd 2, the command's own READY line, and finally an uncaught exception.
_SCRIPT = r"""
import logging, os, sys, warnings
import numpy as np
from sixfold.server.observability.logs import configure_logging, emit

configure_logging("INFO", "json")
logging.getLogger("sixfold.test").info("a record", extra={"event": "e1", "model": "m", "shape": [2, 3]})
warnings.warn("a python warning")
import torch
torch.nn.functional.softmax(torch.ones(2, 2))  # UserWarning: implicit dim
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                          [numpy_helper.from_array(np.zeros(3, np.float32), "unused")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
print("a plain print")
sys.stdout.flush()
os.write(2, b"E1127 08:25:50.859294   27737 add_port.cc:83] Failed to add port\n")
os.write(2, b"a partial line without its newline")
emit("READY grpc=127.0.0.1:9", event="ready", grpc="127.0.0.1:9")
raise RuntimeError("boom")
"""


def test_every_line_of_a_json_process_is_one_json_object() -> None:
    result = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr  # the uncaught exception
    entries = []
    for stream in (result.stdout, result.stderr):
        for line in stream.splitlines():
            entry = json.loads(line)  # raises on any line that is not JSON
            assert isinstance(entry, dict) and {"ts", "level", "logger", "message"} <= set(entry), line
            entries.append(entry)
    by_logger: dict[str, list[dict]] = {}
    for entry in entries:
        by_logger.setdefault(entry["logger"], []).append(entry)
    [record] = by_logger["sixfold.test"]
    assert (record["event"], record["model"], record["shape"]) == ("e1", "m", [2, 3])
    warned = " ".join(e["message"] for e in by_logger["py.warnings"])
    assert "a python warning" in warned and "softmax" in warned
    [ort_line] = by_logger["onnxruntime"]
    assert ort_line["level"] == "warning" and "Removing initializer 'unused'" in ort_line["message"]
    assert "\x1b" not in ort_line["message"]  # its terminal colours are gone
    [grpc_line] = by_logger["grpc"]
    assert grpc_line["level"] == "error" and grpc_line["message"] == "Failed to add port"
    assert [e["message"] for e in by_logger["stdout"]] == ["a plain print"]
    assert [e["message"] for e in by_logger["stderr"]] == ["a partial line without its newline"]
    [ready] = [e for e in entries if e.get("event") == "ready"]
    assert ready_address(json.dumps(ready)) == "127.0.0.1:9"
    [crash] = [e for e in entries if e["level"] == "critical"]
    assert "boom" in crash["message"] and "Traceback" in crash["exception"]


def test_ready_address_reads_the_plain_line_and_the_json_object() -> None:
    assert ready_address(f"{READY_PREFIX}127.0.0.1:8001\n") == "127.0.0.1:8001"
    assert ready_address(json_line(f"{READY_PREFIX}[::1]:8001", event="ready")) == "[::1]:8001"
    assert ready_address(json_line("warming up", event="loading")) == ""
    assert ready_address("{not json READY grpc=x") == "" and ready_address("sixfold-serve: stopped") == ""


def test_json_formatter_keeps_structures_and_levels_are_checked() -> None:
    import logging
    record = logging.LogRecord("sixfold.x", logging.WARNING, __file__, 1, "hello %s", ("there",), None)
    record.plan = {"devices": [{"device": "host"}]}
    record.odd = object()
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "hello there" and entry["level"] == "warning"
    assert entry["plan"] == {"devices": [{"device": "host"}]} and entry["odd"].startswith("<object")
    assert parse_level("warning") == "WARNING"
    try:
        parse_level("verbose")
        raise AssertionError("an unknown level was taken")
    except ValueError as exc:
        assert "debug, info, warning, error, critical" in str(exc)
