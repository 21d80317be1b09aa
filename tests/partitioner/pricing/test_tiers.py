"""The tier price (sixfold.partitioner.pricing.tiers): hit rate and reads of a row cache for power-law ids."""

from __future__ import annotations

import numpy as np

from sixfold.models.requests import RequestGenerator
from sixfold.partitioner.pricing.tiers import DiskSpec, distinct_misses, price_tiers, zipf_hit_rate

ROWS, POOLING = [20_000, 5_000], [10, 30]


def test_hit_rate_matches_a_sampled_top_k_cache():
    gen = RequestGenerator(tuple(ROWS), 1, tuple(POOLING), zipf=1.05, seed=0)
    lengths = gen.lengths(3000)
    ids = gen.ids(lengths)
    table = np.repeat(np.tile(np.arange(2), 3000), lengths.reshape(-1))
    rows = ids + np.where(table == 1, ROWS[0], 0)
    counts = np.bincount(rows, minlength=sum(ROWS))
    slots = 2_500
    top = np.sort(counts)[::-1][:slots].sum() / counts.sum()  # the best any cache of 2500 rows could do
    assert abs(zipf_hit_rate(ROWS, POOLING, 1.05, slots) - top) < 0.03
    assert zipf_hit_rate(ROWS, POOLING, 1.05, sum(ROWS)) == 1.0


def test_more_memory_fewer_reads_and_a_faster_host_stage():
    disk = DiskSpec("test", read_latency_s=1e-4, iops=100_000)
    table_bytes = sum(ROWS) * 256
    budgets = [int(table_bytes * s) for s in (0.05, 0.1, 0.25, 1.0)]
    est = price_tiers(ROWS, POOLING, 256, 1.05, budgets, 64, disk, resident_seconds=1e-3)
    assert [e.hit_rate for e in est] == sorted(e.hit_rate for e in est)
    assert [e.reads_per_batch for e in est] == sorted((e.reads_per_batch for e in est), reverse=True)
    assert all(e.host_seconds >= 1e-3 for e in est)
    assert distinct_misses(ROWS, POOLING, 1.05, 100, 64) <= 64 * sum(POOLING)


def test_partition_cli_prints_the_tier_table(capsys):
    from sixfold.partitioner.cli import main

    assert main(["--model", "rm1", "--max-rows", "300", "--cards", "1", "--plan-only", "--table-memory", "50%",
                 "--table-memory", "1GiB", "--zipf", "1.2"]) == 0
    out = capsys.readouterr().out
    assert "table tiers" in out and "Zipf 1.2" in out and "50%" in out and "100.0%" in out
