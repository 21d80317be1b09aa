"""docs/bring-your-own-model.md, walked through: every marked block of the page, in order, with a model
the project never shipped (torch.export dynamic and static, and ONNX), partitioned by sixfold-partition,
served by a real sixfold-serve over gRPC, and the page's own assertions that the scores are the model's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from sixfold.partitioner.cli import main as partition_main
from tests.conftest import ServeProcess, free_port

DOC = Path(__file__).resolve().parents[2] / "docs" / "bring-your-own-model.md"
STEPS = ("model", "export-dynamic", "export-static", "export-onnx", "partition", "serve", "query", "bad-id")


def _blocks() -> dict[str, tuple[str, str]]:
    found = re.findall(r"<!-- walkthrough: ([\w-]+) -->\n```(\w+)\n(.*?)```", DOC.read_text(), re.S)
    return {name: (lang, code) for name, lang, code in found}


def test_the_page_marks_every_step() -> None:
    assert list(_blocks()) == list(STEPS)


def test_bring_your_own_model_walkthrough(tmp_path, monkeypatch, capsys) -> None:
    blocks = _blocks()
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    for step in ("model", "export-dynamic", "export-static", "export-onnx"):
        exec(compile(blocks[step][1], f"{DOC.name}:{step}", "exec"), scope)  # noqa: S102 - the page's own code

    for line in blocks["partition"][1].strip().splitlines():
        argv = shlex.split(line)
        assert argv[0] == ".venv/bin/sixfold-partition"
        if "--accuracy-report" in argv:
            argv += ["--accuracy-items", "512"]  # the page's default scores 4096; fewer keep the test quick
        assert partition_main(argv[1:]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "int8 tables + fp32 dense" in out  # the accuracy report of the ONNX model's int8 tables
    for name in ("ctr", "ctr_static", "ctr_onnx"):
        assert (tmp_path / "repo" / name / "1" / "plan.json").is_file()

    serve = shlex.split(blocks["serve"][1].strip())
    assert serve[0] == ".venv/bin/sixfold-serve"
    # NOTE: free ports instead of the page's 8001, so tests can run side by side (argparse: the last wins).
    process = ServeProcess(*serve[1:], "--grpc-port", "0", "--metrics-port", str(free_port()), cwd=tmp_path)
    try:
        assert process.url, "".join(process.lines)
        for step in ("query", "bad-id"):
            code = blocks[step][1].replace('"127.0.0.1:8001"', repr(process.url))
            exec(compile(code, f"{DOC.name}:{step}", "exec"), scope)  # noqa: S102 - asserts inside
        assert "input 'sparse_indices': id 50 at position 0 is out of range for table 0 (rows 0..49)" in \
            capsys.readouterr().out
    finally:
        process.stop()


@pytest.mark.parametrize("step", ["export-dynamic", "export-onnx"])
def test_the_page_names_the_canonical_inputs(step) -> None:
    code = _blocks()[step][1]
    for name in ("dense_features", "sparse_lengths", "sparse_indices"):
        assert name in code
