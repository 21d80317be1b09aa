"""A served model: its signature checks, its batcher and runtime, warm-up before it takes traffic."""
