"""The ModelInfer deserializer: raw tensors as views of the message, everything else as protobuf parses it."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from sixfold import models
from sixfold.server.protocol.codec import decode_inputs
from sixfold.server.protocol.infer_request import InferRequestView, parse_model_infer
from tests.conftest import triton_inputs

from tests.server.conftest import MAX_ROWS


def _wire(request: dict[str, np.ndarray], **fields) -> bytes:
    message = service_pb2.ModelInferRequest(model_name="rm2", model_version="1", id="q7", **fields)
    message.parameters["priority"].uint64_param = 2
    message.outputs.add(name="scores")
    for name, array in request.items():
        message.inputs.add(name=name, datatype={"float32": "FP32", "int32": "INT32", "int64": "INT64"}[str(array.dtype)],
                           shape=array.shape)
        message.raw_input_contents.append(array.tobytes())
    return message.SerializeToString()


@pytest.fixture(scope="module")
def request_arrays():
    return models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=5).make(40)


def test_raw_tensors_are_views_of_the_message_and_the_rest_is_protobufs(request_arrays) -> None:
    data = _wire(request_arrays)
    parsed = parse_model_infer(data)
    reference = service_pb2.ModelInferRequest.FromString(data)
    assert isinstance(parsed, InferRequestView)
    assert (parsed.model_name, parsed.model_version, parsed.id) == ("rm2", "1", "q7")
    assert list(parsed.inputs) == list(reference.inputs) and list(parsed.outputs) == list(reference.outputs)
    assert parsed.parameters["priority"].uint64_param == 2
    assert [bytes(v) for v in parsed.raw_input_contents] == list(reference.raw_input_contents)
    arrays = decode_inputs(parsed)
    for name, array in decode_inputs(reference).items():
        np.testing.assert_array_equal(arrays[name], array)
        assert arrays[name].dtype == array.dtype
    ids = arrays["sparse_indices"]
    assert np.shares_memory(ids, np.frombuffer(data, np.uint8))  # no copy: a view of what was received
    assert not ids.flags.writeable


def test_typed_contents_and_empty_messages_take_protobufs_own_parser() -> None:
    typed = service_pb2.ModelInferRequest(model_name="m")
    typed.inputs.add(name="x", datatype="FP32", shape=[2]).contents.fp32_contents.extend([1.0, 2.0])
    parsed = parse_model_infer(typed.SerializeToString())
    assert isinstance(parsed, service_pb2.ModelInferRequest) and parsed == typed
    assert parse_model_infer(b"") == service_pb2.ModelInferRequest()


def test_a_small_message_is_protobufs_to_parse_and_decodes_the_same() -> None:
    """Below the walk's threshold protobuf's parse (and copy) is cheaper than the walk in Python."""
    small = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=MAX_ROWS), seed=5).make(1)
    data = _wire(small)
    assert len(data) < 128 << 10
    parsed = parse_model_infer(data)
    assert isinstance(parsed, service_pb2.ModelInferRequest) and parsed == service_pb2.ModelInferRequest.FromString(data)
    for name, array in decode_inputs(parsed).items():
        np.testing.assert_array_equal(array, small[name])


def test_a_malformed_message_fails_as_protobuf_fails_it(request_arrays) -> None:
    data = _wire(request_arrays)
    for broken in (data[:-3], data[:4], b"\xff" * 12):  # truncated twice, a varint that never ends
        with pytest.raises(DecodeError):
            service_pb2.ModelInferRequest.FromString(broken)
        with pytest.raises(DecodeError):
            parse_model_infer(broken)
    # Another wire type for a known field is an unknown field to protobuf, not an error: the same here.
    odd = b"\x08\x01" + data
    assert parse_model_infer(odd) == service_pb2.ModelInferRequest.FromString(odd)


def test_over_grpc_the_server_answers_like_the_model_and_refuses_garbage(served_rm2, request_arrays) -> None:
    with tc.InferenceServerClient(served_rm2.url) as client:
        scores = client.infer("rm2", triton_inputs(tc, request_arrays)).as_numpy("scores")
        np.testing.assert_allclose(scores, served_rm2.expected(request_arrays), rtol=1e-5, atol=1e-4)
        with grpc.insecure_channel(served_rm2.url) as channel:  # bytes that are no ModelInferRequest
            call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                       request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                call(b"\x0a\xff\xff\xff\xff\x0f" + b"x" * 10, timeout=10)
            assert err.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INVALID_ARGUMENT)
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            reply = stub.ModelInfer(service_pb2.ModelInferRequest.FromString(_wire(request_arrays)), timeout=30)
        assert reply.id == "q7" and reply.model_version == "1"
        again = client.infer("rm2", triton_inputs(tc, request_arrays)).as_numpy("scores")  # still serving
        np.testing.assert_array_equal(again, scores)
