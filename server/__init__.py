"""Async gRPC front end (KServe v2 / Triton protocol), batcher, router and runtime."""

__version__ = "0.1.0"
