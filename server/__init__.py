"""Async gRPC front end (KServe v2 / Triton protocol), batcher, router and runtime."""
