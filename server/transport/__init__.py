"""The front ends over one InferenceCore: the gRPC servicer and the KServe v2 REST app."""
