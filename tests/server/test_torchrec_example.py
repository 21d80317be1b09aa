"""docs/bring-your-own-model.md step 9, run: TorchRec 1.8.0's DLRM over an EmbeddingBagCollection behind the
canonical request, exported with torch.export, partitioned by sixfold-partition, served by a real sixfold-serve
and answered over gRPC like its own forward (1..700 items, empty bags included, 8 clients at once). Skipped,
saying why, where torchrec is not installed (the optional ``torchrec`` extra; CI does not need it)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from tests.server.test_user_model_examples import DOC, blocks, grpc_infer, serve_page

pytest.importorskip("torchrec", reason="torchrec is not installed: pip install -e '.[torchrec]' then "
                    "pip install --no-deps torchrec==1.8.0 (docs/bring-your-own-model.md step 9)")


def test_the_page_marks_each_step() -> None:
    assert tuple(blocks("torchrec")) == ("model", "partition", "query")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    scope, process = serve_page("torchrec", tmp_path_factory.mktemp("torchrec"), ("model",))
    try:
        assert process.url, "".join(process.lines)
        yield scope, process
    finally:
        process.stop()


def test_the_page_query_runs_against_the_server(served) -> None:
    scope, process = served
    exec(compile(blocks("torchrec")["query"], f"{DOC.name}:torchrec:query", "exec"),  # noqa: S102 - asserts inside
         {**scope, "infer": grpc_infer(process.url)})


def test_eight_concurrent_clients_get_the_models_answers(served) -> None:
    scope, process = served
    sizes = (1, 2, 3, 7, 64, 700, 5, 130)

    def client(k: int) -> float:
        infer, worst = grpc_infer(process.url), 0.0
        for j in range(3):
            req = scope["torchrec_request"](sizes[(k + j) % len(sizes)], seed=100 * k + j)
            with torch.inference_mode():
                mine = scope["torchrec_model"](*(torch.from_numpy(req[key]) for key in req)).numpy()
            got = infer("torchrec_dlrm", req)
            assert got.shape == mine.shape, got.shape
            worst = max(worst, float(np.max(np.abs(got - mine))))
        return worst

    with ThreadPoolExecutor(8) as pool:
        worst = max(pool.map(client, range(8), timeout=90))
    assert worst < 1e-5, worst
    log = "".join(process.lines)
    assert "out of rotation" not in log and "cannot split" not in log, log[-2000:]
