"""A lone query's priced latency: the plan's stages at the query's size plus the serving path, term by term."""

from __future__ import annotations

import dataclasses

import pytest

from sixfold.backends.spec_catalog import load_spec
from sixfold.partitioner.compile import partition_builtin
from sixfold.partitioner.plan import PartitionPlan
from sixfold.partitioner.pricing.served_latency import (PRICE_ROWS, ServedLatency, ServingPath, fit_serving_path,
                                                        load_serving_path, price_lone_query, save_serving_path)


def test_the_terms_add_the_stages_at_the_query_size_and_the_serving_path() -> None:
    path = ServingPath(1e-3, 2e-6, "test", per_id_s=1e-9)
    lone = price_lone_query(lambda r: 1e-4 + 1e-6 * r, lambda r: 2e-4 + 5e-5 * r, path, ids_per_item=100)
    terms = lone.terms(300)  # between priced sizes (256, 512): interpolated, exact for lines
    assert terms["host"] == pytest.approx(1e-4 + 3e-4)
    assert terms["dense"] == pytest.approx(2e-4 + 1.5e-2)
    assert terms["serving"] == pytest.approx(1e-3 + 300 * (2e-6 + 100e-9))
    assert terms["window"] == 0.0
    assert lone.seconds(300) == pytest.approx(sum(terms.values()))
    beyond = lone.terms(2 * PRICE_ROWS[-1])  # the last segment's slope past the largest priced size
    assert beyond["dense"] == pytest.approx(2e-4 + 5e-5 * 2 * PRICE_ROWS[-1])


def test_a_batching_window_is_paid_below_no_wait_rows_only() -> None:
    lone = price_lone_query(lambda r: 0.0, lambda r: 0.0, ServingPath(0.0, 0.0), window_s=2e-3)
    lone = dataclasses.replace(lone, no_wait_rows=64)
    assert lone.terms(16)["window"] == 2e-3 and lone.terms(64)["window"] == 0.0
    with pytest.raises(ValueError, match="window_s"):
        price_lone_query(lambda r: 0.0, lambda r: 0.0, ServingPath(0.0, 0.0), window_s=-1)


def test_it_survives_the_plan_json_round_trip_and_describes_itself() -> None:
    lone = price_lone_query(lambda r: 1e-5 * r, lambda r: 4e-5 * r, ServingPath(1e-3, 0.0, "calibrated here"),
                            ids_per_item=26, window_s=1e-3)
    again = ServedLatency.from_dict(lone.to_dict())
    assert again == lone
    line = again.describe(256)
    assert "256-item" in line and "serving path" in line and "calibrated here" in line and "window" in line


def test_a_fit_recovers_the_terms_and_refuses_one_size() -> None:
    rows = [1, 16, 100, 270, 700] * 2
    ratios = [26.0] * 5 + [3840.0] * 5
    seconds = [1e-3 + 2e-6 * r + 0.5e-9 * r * k for r, k in zip(rows, ratios)]
    fit = fit_serving_path(rows, seconds, "test", ratios)
    assert fit.fixed_s == pytest.approx(1e-3, rel=1e-6) and fit.per_item_s == pytest.approx(2e-6, rel=1e-6)
    assert fit.per_id_s == pytest.approx(0.5e-9, rel=1e-6)
    with pytest.raises(ValueError, match="distinct sizes"):
        fit_serving_path([100, 100], [1e-3, 1e-3], "test")


def test_the_calibration_file_round_trips_and_a_damaged_one_falls_back(tmp_path) -> None:
    path = tmp_path / "serving-path.json"
    saved = ServingPath(1.5e-3, 3e-6, "calibrated", 1e-9)
    save_serving_path(saved, path)
    assert load_serving_path(path) == saved
    path.write_text("{not json")
    assert load_serving_path(path).source.startswith("default")


def test_the_plan_carries_the_lone_query_terms_and_they_match_its_batch_estimate() -> None:
    _, partitioned = partition_builtin("tiny", cards=2, card_spec=load_spec("m2-card"), host_spec="host-cpu")
    plan = partitioned.plan
    lone = ServedLatency.from_dict(plan.estimates.served)
    est = plan.estimates
    terms = lone.terms(est.batch_rows)
    stages_ms = (terms["host"] + terms["dense"]) * 1e3
    assert stages_ms == pytest.approx(est.latency_ms, rel=1e-6)  # the batch estimate is the stages' sum
    assert lone.seconds(est.batch_rows) > terms["host"] + terms["dense"]  # and the served path adds to it
    assert PartitionPlan.from_dict(plan.to_dict()).estimates.served == plan.estimates.served
    old = plan.to_dict()
    del old["estimates"]["served"]  # a plan written before the terms existed still loads
    assert PartitionPlan.from_dict(old).estimates.served is None


def test_the_serving_path_fit_keeps_a_small_querys_fixed_term_close() -> None:
    # measured paths that are not a line: 0.7 ms at 1 item, a bump at 100; an unweighted fit gives the 1-item
    # query 0.85 ms (21% high: the large sizes set the intercept), the relative fit stays within 10%
    rows, seconds = [1, 16, 100, 270, 700], [0.7e-3, 0.75e-3, 1.5e-3, 1.7e-3, 3.0e-3]
    fit = fit_serving_path(rows, seconds, "test", [26.0] * 5)
    assert fit.seconds(1, 26.0) == pytest.approx(0.7e-3, rel=0.1)
