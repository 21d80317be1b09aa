"""KServe v2 serving over gRPC and REST: a request goes transport -> protocol -> core -> model ->
scheduling -> execution, and back.

Sub-packages, each importing only those listed after it (``errors`` is below them all):

    cli, app       ``sixfold-serve`` and the server process it runs
    frontend       a ``--workers`` front end: a server process whose inference goes to the engine
    transport/     the gRPC servicer and the REST app over one InferenceCore
    loading/       model names and repositories -> served models; explicit model control
    core           models by name and version, readiness, inference (no transport code)
    deltas/        live table deltas on a served model; ``sixfold-delta``
    model/         a served model: signature checks, warm-up, its batcher and runtime
    execution/     one batch through a plan: host stage, dense stage on a card, card health
    scheduling/    admission, the dynamic batcher, the card gate, the router
    protocol/      KServe v2 tensors <-> numpy (gRPC, REST, shared memory)
    workers/       ``--workers N``: the supervisor, one engine under N front ends, one metrics page
    observability/ Prometheus metrics, Triton-shaped statistics, logs
    memory/        the process's allocator and garbage-collector settings
"""
