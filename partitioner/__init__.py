"""Model -> plan: what runs where, and why. ``compile`` is the entry point; ``plan`` the result.

A model goes frontends/ (torch.export or ONNX) -> cut/ (host lookups vs dense ops, pipeline
stages) -> pricing/ (FLOPs, bytes, tiers, the plan's bounds) -> placement/ (replicate, pipeline,
table shards) -> precision/ (tables and dense part) -> tables/ and ``artifacts`` (the model
repository's version folder); report/ says what was decided. ``partitioned`` holds the result type
every stage hands on, so no stage imports the entry point.
"""
