"""--cards and --card-spec with --model-repository (issue 32.3): the plan's cards, or a refusal naming the flag.

Before, both were ignored without a word: a version partitioned onto 2 m2-cards was served on
those whatever the flags said. Real pieces: a version written by sixfold-partition --out, read
back from its folder, and sixfold-serve started on it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sixfold.partitioner.artifacts import write_artifacts
from sixfold.partitioner.compile import partition_builtin
from sixfold.server.loading.card_flags import check_card_flags
from sixfold.server.loading.repository import ModelRepository

SERVE = Path(sys.executable).parent / "sixfold-serve"


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_artifacts(partition_builtin("tiny", seed=0, cards=2)[1], root / "tiny" / "1")
    return root


def test_flags_that_agree_with_the_plan_pass_and_others_are_refused_naming_flag_model_and_cards(repository) -> None:
    plan = ModelRepository(repository).read("tiny", "1").plan
    check_card_flags(plan, "tiny", "1")
    check_card_flags(plan, "tiny", "1", cards=2, card_spec="m2-card")
    with pytest.raises(ValueError, match=r"^--cards 3: model 'tiny' version 1 was partitioned onto 2 x m2-card; "
                                         r"drop the flag .* sixfold-partition \.\.\. --cards 3 --out REPO/tiny/VERSION"):
        check_card_flags(plan, "tiny", "1", cards=3)
    with pytest.raises(ValueError, match=r"^--card-spec gpu-l4: model 'tiny' version 1 was partitioned onto "
                                         r"2 x m2-card; .*--cards 2 --card-spec gpu-l4 --out"):
        check_card_flags(plan, "tiny", "1", card_spec="gpu-l4")


def test_sixfold_serve_refuses_a_card_count_the_repository_plan_does_not_have(repository) -> None:
    result = subprocess.run([str(SERVE), "--model-repository", str(repository), "--cards", "3", "--grpc-port", "0",
                             "--metrics-port", "-1", "--http-port", "-1"],
                            capture_output=True, text=True, timeout=120)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--cards 3: model 'tiny' version 1 was partitioned onto 2 x m2-card" in lines[-1], lines
    assert "READY" not in result.stdout
