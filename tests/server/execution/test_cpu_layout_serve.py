"""sixfold-serve with no accelerator: the cpu layout by default, said in the start-up output; cards when asked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as tc

from sixfold import models
from sixfold.backends.host.usable_cores import usable_cores
from tests.conftest import ServeProcess, triton_inputs

SERVE = Path(sys.executable).parent / "sixfold-serve"


def test_the_cpu_layout_serves_dense_on_the_host_cores_with_exact_scores() -> None:
    serve = ServeProcess("--model", "tiny", "--max-rows", "500", "--backend", "cpu", "--grpc-port", "0",
                         "--metrics-port", "-1")
    try:
        assert serve.url, serve.output
        cores = usable_cores()
        assert "layout cpu: " in serve.output and cores.describe() in serve.output, serve.output
        assert f"tiny (version 1, {cores.count} cpu lanes)" in serve.output
        assert "split a batch across cores" in serve.output  # the measured rule, printed with its times
        model = models.build("tiny", max_rows=500, seed=0)
        request = models.RequestGenerator.for_config(model.config, seed=2).make(40)
        with tc.InferenceServerClient(serve.url) as client:
            scores = client.infer("tiny", triton_inputs(tc, request)).as_numpy("scores")
            parameters = client.get_model_metadata("tiny", as_json=True)
        with torch.inference_mode():
            expected = model(*[torch.from_numpy(request[k]) for k in
                               ("dense_features", "sparse_lengths", "sparse_indices")]).numpy()
        np.testing.assert_allclose(scores, expected, atol=1e-5, rtol=0)
        assert parameters["name"] == "tiny"
    finally:
        serve.kill()


def test_the_default_emulates_cards_and_says_why() -> None:
    serve = ServeProcess("--model", "tiny", "--max-rows", "500", "--grpc-port", "0", "--metrics-port", "-1")
    try:
        assert serve.url, serve.output
        assert "layout simcard: no accelerator backend: emulated cards" in serve.output, serve.output
        assert "tiny (version 1, 6 simcard cards)" in serve.output
    finally:
        serve.kill()


def test_cards_asked_for_are_emulated_as_before() -> None:
    serve = ServeProcess("--model", "tiny", "--max-rows", "500", "--cards", "2", "--grpc-port", "0",
                         "--metrics-port", "-1")
    try:
        assert serve.url, serve.output
        assert "layout simcard: no accelerator backend; --cards given: emulated cards" in serve.output
        assert "tiny (version 1, 2 simcard cards)" in serve.output
    finally:
        serve.kill()


def test_the_cpu_layout_refuses_a_card_spec_naming_both_flags() -> None:
    result = subprocess.run([str(SERVE), "--model", "tiny", "--backend", "cpu", "--card-spec", "m2-card",
                             "--grpc-port", "0", "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "--backend cpu" in result.stderr and "--card-spec m2-card" in result.stderr
