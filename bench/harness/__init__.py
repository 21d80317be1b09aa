"""What the bench scripts share, one concept a module, so a script holds only what it measures.

    commands      how to start the project's commands (``sixfold-serve``, ...) with or without an install
    report        what a bench leaves behind: its BENCHMARKS.md section, markdown rows, a JSON file
    bench_server  the bench's own stand-in gRPC servers: print the READY line, serve until signalled
    process       a server in its own process group: free ports, start, wait for the model, stop it all
    peers         the servers compared: sixfold-serve, the FIFO server, Seldon MLServer
    wire          single queries on the wire: input order, answers against a reference, idle latency
    sweep         MLPerf-sized traffic, the latency-bounded rate search (loadgen's find-max-qps) and
                  what its answer means

Modules import what they need lazily where it is heavy (grpc, torch), so ``report`` alone stays cheap.
"""
