"""``--ids-dtype int32``: the ids go on the wire as INT32 (half the bytes), every transport, and an id
that does not fit int32 is refused before the clock starts."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from sixfold import models
from sixfold.loadgen import LoadConfig, LoadgenError
from sixfold.loadgen.connect import make_transport
from sixfold.loadgen.transport import RawGrpcTransport, wire_tensors


def _query(items: int = 5) -> dict[str, np.ndarray]:
    return models.RequestGenerator.for_config(models.get_config("rm2", max_rows=1000), seed=3).make(items)


async def test_raw_requests_carry_int32_ids_in_half_the_bytes():
    query = _query()
    transports = [RawGrpcTransport("127.0.0.1:1", "rm2"), RawGrpcTransport("127.0.0.1:1", "rm2", ids_dtype="int32")]
    wide, narrow = (service_pb2.ModelInferRequest.FromString(t.prepare(query)) for t in transports)
    for transport in transports:
        await transport.close()
    assert [t.datatype for t in wide.inputs] == ["FP32", "INT32", "INT64"]
    assert [t.datatype for t in narrow.inputs] == ["FP32", "INT32", "INT32"]
    assert len(narrow.raw_input_contents[2]) * 2 == len(wide.raw_input_contents[2])
    np.testing.assert_array_equal(np.frombuffer(narrow.raw_input_contents[2], np.int32), query["sparse_indices"])
    assert narrow.raw_input_contents[:2] == wide.raw_input_contents[:2]  # the other inputs as they were


def test_ids_beyond_int32_are_refused_and_int64_leaves_the_request_alone():
    query = _query()
    assert wire_tensors(query, "int64") is query
    huge = {**query, "sparse_indices": query["sparse_indices"] + 2**31}
    with pytest.raises(LoadgenError, match="does not fit int32"):
        wire_tensors(huge, "int32")


def test_bad_ids_dtype_is_refused_by_config_and_transport():
    with pytest.raises(ValueError, match="bad ids_dtype 'int16'"):
        LoadConfig(url="127.0.0.1:1", model="m", qps=1.0, duration_s=1.0, ids_dtype="int16")
    with pytest.raises(ValueError, match="bad ids_dtype 'int8'"):
        make_transport("raw", "127.0.0.1:1", None, "m", ids_dtype="int8")


def test_the_cli_flag_reaches_the_config():
    from sixfold.loadgen.cli import _config, build_parser

    args = build_parser().parse_args(["--url", "127.0.0.1:1", "--model", "rm2", "--qps", "5", "--duration", "1",
                                      "--report", "r.json", "--ids-dtype", "int32"])
    assert _config(args).ids_dtype == "int32"
    assert _config(build_parser().parse_args(["--url", "127.0.0.1:1", "--model", "rm2", "--qps", "5",
                                              "--duration", "1", "--report", "r.json"])).ids_dtype == "int64"
