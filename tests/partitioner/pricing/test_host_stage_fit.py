"""The host stage's cost per bag and per looked-up id, measured here: the fit, its file, who prices with it."""

from __future__ import annotations

import pytest

from sixfold.partitioner.pricing.host_stage_fit import (HostStageFit, fit_host_stage, load_host_stage,
                                                        measured_lone_host, save_host_stage)
from sixfold.partitioner.pricing.served_latency import ServedLatency, ServingPath

TRUE = HostStageFit(fixed_s=2e-4, per_id_s=7e-9, per_bag_s=1e-7)
MODELS = ((26.0, 26.0), (3840.0, 32.0))  # (ids, bags) an item: dlrm-mlperf-like, rm2-like


def test_two_models_fit_the_fixed_per_bag_and_per_id_terms_exactly() -> None:
    points = [(n, ids, bags) for ids, bags in MODELS for n in (1.0, 16.0, 100.0, 700.0)]
    fit = fit_host_stage(*zip(*points), [TRUE.seconds(*p) for p in points], "test")
    assert (fit.fixed_s, fit.per_id_s, fit.per_bag_s) == pytest.approx((2e-4, 7e-9, 1e-7), rel=1e-6)
    assert TRUE.seconds(700, 3840, 32) == pytest.approx(2e-4 + 700 * (3840 * 7e-9 + 32 * 1e-7))
    # one model: its bags count as ids (one slope)
    one = fit_host_stage([1.0, 700.0], [26.0, 26.0], [26.0, 26.0],
                         [TRUE.seconds(1, 26, 26), TRUE.seconds(700, 26, 26)], "t")
    assert one.per_bag_s == 0 and one.per_id_s == pytest.approx(7e-9 + 1e-7)
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_host_stage([16.0], [26.0], [26.0], [1e-3], "t")


def test_the_fit_is_saved_read_back_and_a_damaged_file_is_none(tmp_path) -> None:
    path = tmp_path / "host-stage.json"
    assert load_host_stage(path) is None
    save_host_stage(HostStageFit(1e-4, 2e-9, 5e-8, "here"), path)
    assert load_host_stage(path) == HostStageFit(1e-4, 2e-9, 5e-8, "here")
    path.write_text("[]")
    assert load_host_stage(path) is None


def test_the_lone_query_host_term_is_the_fit_at_the_models_ids_and_bags() -> None:
    lone = ServedLatency(host=((1, 1e-5), (1024, 1e-3)), dense=((1, 1e-4), (1024, 2e-3)),
                         serving=ServingPath(1e-3, 0.0, "test"))
    priced = measured_lone_host(lone, TRUE, 3840.0, 32.0)
    assert priced.terms(700)["host"] == pytest.approx(TRUE.seconds(700, 3840, 32), rel=1e-9)
    assert priced.terms(700)["dense"] == lone.terms(700)["dense"]
    assert "measured here per id" in priced.describe(700)
    assert ServedLatency.from_dict(priced.to_dict()) == priced
    with pytest.raises(ValueError, match="ids_per_item"):
        measured_lone_host(lone, TRUE, 0.0, 32.0)


def test_the_simulator_prices_the_host_stage_with_the_fit() -> None:
    from sixfold import models
    from sixfold.simulate.platform import MeasuredStage, build_platform

    config = models.get_config("tiny")
    platform = build_platform("tiny", cards=1, host_spec="host-cpu", host_stage_fit=TRUE)
    assert isinstance(platform.host, MeasuredStage)
    assert platform.host.seconds(100) == pytest.approx(TRUE.seconds(100, sum(config.pooling), len(config.pooling)))
