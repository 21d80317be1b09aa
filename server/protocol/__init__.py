"""The KServe v2 wire format: tensors in and out of gRPC messages, REST bodies and shared memory."""
