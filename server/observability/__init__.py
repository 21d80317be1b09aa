"""What the server tells operators: Prometheus metrics, Triton-shaped statistics, logs."""
