"""int8 dense, served: a request's scores are the same bits whatever it is batched with (issue 32.6)."""

from __future__ import annotations

import threading

import numpy as np
import tritonclient.grpc as tc

from sixfold import models
from tests.conftest import ServeProcess, triton_inputs


def test_the_same_request_gets_bit_identical_int8_scores_alone_and_beside_loud_batch_mates() -> None:
    # NOTE: a 300 ms window and no early dispatch, so the concurrent requests below share one batch; the
    # cards always run it (no host-dense fallback)
    serve = ServeProcess("--model", "rm2", "--max-rows", "500", "--cards", "1", "--dense-precision", "int8",
                         "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1",
                         "--host-dense-max-rows", "0", "--max-queue-delay-us", "300000", "--no-all-in-dispatch")
    try:
        assert serve.url, serve.output
        gen = models.RequestGenerator.for_config(models.get_config("rm2", max_rows=500), seed=11)
        quiet = gen.make(3)
        loud = gen.make(40)
        loud["dense_features"] = loud["dense_features"] * 80.0  # other items' values far larger
        with tc.InferenceServerClient(serve.url) as client:
            alone = client.infer("rm2", triton_inputs(tc, quiet)).as_numpy("scores")
            before = client.get_inference_statistics("rm2").model_stats[0]
            got: dict[str, np.ndarray] = {}

            def send(name: str, request: dict) -> None:
                got[name] = client.infer("rm2", triton_inputs(tc, request)).as_numpy("scores")

            threads = [threading.Thread(target=send, args=(n, r)) for n, r in (("quiet", quiet), ("loud", loud))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            after = client.get_inference_statistics("rm2").model_stats[0]
        assert after.inference_count - before.inference_count == 43
        assert after.execution_count - before.execution_count == 1, "the two requests were not batched together"
        np.testing.assert_array_equal(got["quiet"], alone)  # bit for bit
        assert np.isfinite(got["loud"]).all()
    finally:
        serve.kill()
