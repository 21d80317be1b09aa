"""The backend conformance kit: does a backend give ONNX Runtime's answers, and behave like a card?

    python -m sixfold.backends.conformance NAME [--models rm2,dlrm-mlperf] [--max-batch 64] [--max-rows 200]
                                        [--option k=v ...] [--options-file FILE] [--card-spec m2-card]

It builds the dense partitions of built-in models (small tables), feeds them
real inputs (the host stage's outputs for generated requests) and checks, for
each model:

========================  =========================================================================
``load``                  ``supports()`` takes the ONNX partition; ``load()`` returns an Executable
``memory``                ``memory_bytes()`` is an int > 0
``outputs``               ``infer()`` equals ONNX Runtime (atol 1e-4) for every batch size 1..max
``items``                 the tensor contract: dim 0 of every tensor is items x k (k per tensor); a
                          batch split at item boundaries and rejoined equals the whole
``concurrency``           threads calling ``run()`` on separate executables, and many ``infer()``
                          calls queued at once on each executable, all answer correctly
``bad-input``             a missing input, a wrong width, mismatched rows, float64: an exception
                          (not a hang, not an answer); then a good batch still answers correctly
``does-not-fit``          ``load()`` on a device with a quarter of the weights' memory raises
                          DoesNotFit quoting the sizes
``close``                 ``close()`` works twice; ``infer()`` afterwards raises
``op``                    (op cases) a one-node model of each ONNX op use of the zoo's dense
                          partitions (``ops.dense_ops()``, fp32 and fp16) equals ONNX Runtime
========================  =========================================================================

``--repository DIR`` checks every model version's dense partitions in a model
repository instead (each pipeline stage, at its plan's precision:
``sixfold.backends.conformance.repository``). Each result that compares answers
carries the tolerance it used and the largest error it saw (``CheckResult.atol``,
``CheckResult.max_error``).

Every call into the backend runs under a timeout (``--timeout``, 10 s). The
CLI prints a table and exits 1 on any failure (2 on a usage error). The
Python API, ``run_conformance(name_or_instance, ...)``, returns a
``ConformanceReport``.
"""

from sixfold.backends.conformance.cases import DEFAULT_MODELS, Case, builtin_case, builtin_cases, case_from_artifact
from sixfold.backends.conformance.kit import CHECKS, CheckFailed, rows_per_item, run_conformance, run_conformance_async
from sixfold.backends.conformance.ops import dense_ops, op_cases
from sixfold.backends.conformance.repository import repository_cases
from sixfold.backends.conformance.report import CheckResult, ConformanceReport

__all__ = [
    "run_conformance", "run_conformance_async", "CHECKS", "CheckFailed",
    "ConformanceReport", "CheckResult",
    "Case", "case_from_artifact", "builtin_case", "builtin_cases", "DEFAULT_MODELS",
    "rows_per_item", "dense_ops", "op_cases", "repository_cases",
]
