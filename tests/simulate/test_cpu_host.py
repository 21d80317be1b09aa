"""sixfold-simulate --cpu-host: the cpu layout sixfold-serve picks with no accelerator, priced in virtual time."""

from __future__ import annotations

import json

from sixfold.backends.host.usable_cores import usable_cores
from sixfold.simulate.cli import main

QUICK = ("--duration", "0.05", "--warmup", "0.01", "--quiet")


def test_run_prices_one_lane_per_usable_core(tmp_path) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "tiny", "--cpu-host", "--qps", "50", *QUICK, "--json", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["platform"].startswith(f"tiny on {usable_cores().count} x host-core-"), result["platform"]
    assert not result["runs"][0]["errors"]  # by kind: none refused or failed


def test_a_lane_count_given_is_kept(tmp_path) -> None:
    out = tmp_path / "run.json"
    assert main(["run", "--model", "tiny", "--cpu-host", "--cards", "1", "--qps", "50", *QUICK, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"][0]["platform"].startswith("tiny on 1 x host-core-")


def test_capacity_searches_up_to_the_usable_cores(tmp_path) -> None:
    out = tmp_path / "capacity.json"
    assert main(["capacity", "--model", "tiny", "--cpu-host", "--qps", "20", "--p99-ms", "60", *QUICK,
                 "--json", str(out)]) == 0
    (answer,) = json.loads(out.read_text())["results"]
    assert answer["card_spec"].endswith(".json") and "host-core-" in answer["card_spec"]
    assert answer["tried"] and max(int(c) for c in answer["tried"]) <= usable_cores().count


def test_a_card_spec_with_cpu_host_is_refused_naming_both(capsys) -> None:
    assert main(["run", "--model", "tiny", "--cpu-host", "--card-spec", "m2-card", "--qps", "50", *QUICK]) == 2
    err = capsys.readouterr().err
    assert "--cpu-host" in err and "--card-spec m2-card" in err
