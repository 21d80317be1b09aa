"""Traffic models: bursty/diurnal/trace arrivals, query-size distributions, per-table zipf, id drift."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.loadgen import BurstyArrivals, ConstantArrivals, DiurnalArrivals, TraceArrivals, build_schedule, parse_arrival
from sixfold.loadgen.schedule import shift_ids
from sixfold.models.requests import (EmpiricalQuerySizes, LognormalQuerySizes, RequestGenerator, UniformQuerySizes,
                             parse_query_sizes)


def dispersion(offsets: np.ndarray, window_s: float, bin_s: float = 0.5) -> float:
    """Variance / mean of counts per bin: 1 for Poisson, larger for bursty traffic."""
    counts = np.histogram(offsets, bins=int(window_s / bin_s), range=(0, window_s))[0]
    return counts.var() / counts.mean()


@pytest.mark.parametrize("spec", ["bursty", "bursty:on=1,off=1,factor=5,markov=1", "diurnal:amplitude=0.8,period=10"])
def test_time_varying_arrivals_keep_the_mean_rate_and_are_burstier_than_poisson(spec):
    offsets = parse_arrival(spec).offsets(200.0, 200.0, np.random.default_rng(2))
    assert offsets.size == pytest.approx(40_000, rel=0.04)
    assert np.all(np.diff(offsets) >= 0) and offsets[0] >= 0 and offsets[-1] < 200.0
    assert dispersion(offsets, 200.0) > 5.0
    poisson = parse_arrival("poisson").offsets(200.0, 200.0, np.random.default_rng(2))
    assert dispersion(poisson, 200.0) == pytest.approx(1.0, abs=0.2)


def test_bursty_on_and_off_rates():
    process = BurstyArrivals(on_s=2.0, off_s=3.0, factor=4.0)
    high, low = process.rates(100.0)
    assert (2 * high + 3 * low) / 5 == pytest.approx(100.0) and high == pytest.approx(4 * low)
    offsets = process.offsets(100.0, 100.0, np.random.default_rng(0))
    phase = offsets % 5.0
    on_rate = np.count_nonzero(phase < 2.0) / (20 * 2.0)
    off_rate = np.count_nonzero(phase >= 2.0) / (20 * 3.0)
    assert on_rate == pytest.approx(high, rel=0.05) and off_rate == pytest.approx(low, rel=0.08)


def test_diurnal_follows_the_sine():
    process = DiurnalArrivals(amplitude=0.5, period_s=20.0)
    offsets = process.offsets(400.0, 200.0, np.random.default_rng(1))
    phase = offsets % 20.0
    peak = np.count_nonzero((phase > 4) & (phase < 6)) / (10 * 2.0)    # sin = 1 at t = 5
    trough = np.count_nonzero((phase > 14) & (phase < 16)) / (10 * 2.0)  # sin = -1 at t = 15
    assert peak == pytest.approx(600.0, rel=0.06) and trough == pytest.approx(200.0, rel=0.1)


def test_trace_replays_scales_and_loops(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("timestamp,user\n# a comment\n1000.0,a\n1000.1,b\n1000.4,c\n1000.5,d\n")
    trace = parse_arrival(f"trace:{path}")
    assert isinstance(trace, TraceArrivals)
    assert np.allclose(trace.offsets(1.0, 0.55, np.random.default_rng(0)), [0.0, 0.1, 0.4, 0.5])
    fast = parse_arrival(f"trace:{path},scale=0.5")
    assert np.allclose(fast.offsets(1.0, 0.3, np.random.default_rng(0)), [0.0, 0.05, 0.2, 0.25])
    assert fast.mean_qps() == pytest.approx(12.0)
    looped = trace.offsets(1.0, 1.5, np.random.default_rng(0))
    assert looped.size == 10 and looped[4] == pytest.approx(0.5 + 0.5 / 3)  # one mean gap after the end


@pytest.mark.parametrize("spec, message", [
    ("bursty:on=0", "on > 0"), ("bursty:spike=3", "'spike=3' is not one of on=NUMBER"),
    ("diurnal:amplitude=2", "amplitude <= 1"), ("trace:", "trace:PATH"), ("trace:/nonexistent", "cannot read"),
    ("weibull", "bursty[:on=S,off=S,factor=F"),
])
def test_bad_arrival_specs_list_the_valid_forms(spec, message):
    with pytest.raises(ValueError, match="bad arrival spec|bad trace") as info:
        parse_arrival(spec)
    assert message in str(info.value)


def test_uniform_lognormal_and_file_query_sizes(tmp_path):
    rng = np.random.default_rng(0)
    uniform = parse_query_sizes("uniform:10-20")
    assert isinstance(uniform, UniformQuerySizes)
    drawn = uniform.sample(rng, 20_000)
    assert drawn.min() == 10 and drawn.max() == 20 and drawn.mean() == pytest.approx(15, abs=0.1)
    lognormal = parse_query_sizes("lognormal:200,0.8")
    assert isinstance(lognormal, LognormalQuerySizes)
    drawn = lognormal.sample(rng, 50_000)
    assert drawn.mean() == pytest.approx(200, rel=0.03) and drawn.min() >= 1
    assert np.median(drawn) == pytest.approx(200 * np.exp(-0.32), rel=0.05)  # exp(mu), mu = ln 200 - s^2/2
    assert np.percentile(drawn, 99) > 3 * np.median(drawn)  # heavy tail
    path = tmp_path / "sizes.txt"
    path.write_text("# items per query\n5, 5, 7\n100\n")
    empirical = parse_query_sizes(f"file:{path}")
    assert isinstance(empirical, EmpiricalQuerySizes)
    drawn = empirical.sample(rng, 40_000)
    assert set(np.unique(drawn)) == {5, 7, 100}
    assert np.mean(drawn == 5) == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("spec", ["lognormal", "uniform:9-3", "uniform:0-3", "lognormal:0,1", "file:", "fixed:0"])
def test_bad_query_size_specs_list_the_forms(spec):
    with pytest.raises(ValueError, match="uniform:A-B.*lognormal:MEAN,SIGMA.*file:PATH"):
        parse_query_sizes(spec)


def test_per_table_zipf_skews_each_table_its_own_way():
    generator = RequestGenerator((10_000, 10_000), 2, (50, 50), zipf=(1.4, 0.2), seed=0)
    request = generator.make(200)
    table = np.tile(np.arange(2), 200).repeat(request["sparse_lengths"].reshape(-1))
    top_share = []
    for t in range(2):
        _, counts = np.unique(request["sparse_indices"][table == t], return_counts=True)
        top_share.append(np.sort(counts)[-10:].sum() / counts.sum())
    assert top_share[0] > 0.4 and top_share[1] < 0.05
    with pytest.raises(ValueError, match="3 zipf exponents for 2 tables"):
        RequestGenerator((10, 10), 2, (1, 1), zipf=(1.0, 1.0, 1.0))


def test_id_drift_rotates_the_hot_set_per_time_slice():
    rows = (1000, 500)
    generator = RequestGenerator(rows, 2, (4, 4), zipf=1.3, seed=0)
    schedule = build_schedule(ConstantArrivals(), 100.0, 4.0, parse_query_sizes("fixed:50"), generator,
                              lambda q: q, pool=2, rng=np.random.default_rng(0), drift=0.1)
    assert len(schedule.pool) == 2 * 4  # 4 one-second slices
    first = schedule.pool.payloads[schedule.query[0]]
    assert schedule.query[0] < 2 <= 6 <= schedule.query[-1]
    # Same base query, ids moved by 3 s x 0.1 of each table; in range; lengths unchanged.
    base = schedule.query[-1] - 6
    moved = schedule.pool.payloads[schedule.query[-1]]
    again = shift_ids(schedule.pool.payloads[base], np.asarray(rows), np.asarray([300, 150]))
    assert np.array_equal(moved["sparse_indices"], again["sparse_indices"])
    assert np.array_equal(moved["sparse_lengths"], schedule.pool.payloads[base]["sparse_lengths"])
    assert not np.array_equal(first["sparse_indices"][:20], moved["sparse_indices"][:20])
    table = np.tile(np.arange(2), 50).repeat(moved["sparse_lengths"].reshape(-1))
    assert np.all(moved["sparse_indices"] < np.asarray(rows)[table])
