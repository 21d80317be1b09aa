"""``sixfold-loadgen --deadline-ms``: each request carries a gRPC deadline (served behaviour:
tests/server/scheduling/test_deadline_sla.py)."""

from __future__ import annotations

import pytest

from sixfold.loadgen import LoadConfig
from sixfold.loadgen.cli import _config as config_of, build_parser

ARGV = ["--url", "127.0.0.1:1", "--model", "rm2", "--qps", "5", "--duration", "1", "--report", "r.json"]


def test_the_flag_reaches_the_config_in_seconds() -> None:
    assert config_of(build_parser().parse_args([*ARGV, "--deadline-ms", "250"])).deadline_s == 0.25
    assert config_of(build_parser().parse_args(ARGV)).deadline_s is None


def test_a_bad_deadline_or_one_over_rest_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--deadline-ms\) must be a finite number > 0, got -1"):
        LoadConfig(url="127.0.0.1:1", model="rm2", qps=5, duration_s=1, deadline_s=-1.0)
    with pytest.raises(ValueError, match=r"--deadline-ms\) is sent as a gRPC deadline: use protocol grpc"):
        LoadConfig(url="127.0.0.1:1", model="rm2", qps=5, duration_s=1, deadline_s=0.25, protocol="http")
