"""Size of a ``sixfold-loadgen --record`` file for a zoo model's traffic, per format.

Plans the run exactly as ``sixfold-loadgen`` does (same seed, pool, sizes, id
drift; the model shape of a zoo config), marks every request answered, and
writes it as format 2 with the pool's recipe (what ``--record`` writes) and
with the pool stored as compressed ids (what a pool that cannot be regenerated
costs). Format 1 (raw tensors, ``numpy.savez``) is the tensors' bytes plus the
per-request arrays, counted rather than written (it reaches gigabytes).

    .venv/bin/python bench/recording_size.py --model rm2 --qps 20 --duration 10 [--id-drift 0.01]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from sixfold import models
from sixfold.loadgen import LoadConfig, RunRecord, save_recording
from sixfold.loadgen.runner import plan_run
from sixfold.loadgen.target import ModelShape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="rm2")
    p.add_argument("--max-rows", type=int, default=None, help="cap table rows (ids' range; default: the zoo's)")
    p.add_argument("--qps", type=float, default=20.0)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--id-drift", type=float, default=0.0)
    p.add_argument("--pool", type=int, default=32)
    p.add_argument("--no-stored", action="store_true", help="skip writing the compressed-ids form")
    args = p.parse_args()
    cfg = models.get_config(args.model, **({"max_rows": args.max_rows} if args.max_rows else {}))
    shape = ModelShape(cfg.dense_dim, tuple(cfg.table_rows), tuple(cfg.pooling), cfg.zipf)
    config = LoadConfig(url="127.0.0.1:1", model=args.model, qps=args.qps, duration_s=args.duration,
                        id_drift=args.id_drift, pool=args.pool, record_path="-")
    t = time.perf_counter()
    schedule = plan_run(config, shape, lambda q: None, keep_tensors=True)
    planned_s = time.perf_counter() - t
    record = RunRecord(schedule.offsets, schedule.items)
    for i, due in enumerate(schedule.offsets):
        record.mark_sent(i, float(due) + 1e-3)
        record.mark_ok(i, float(due) + 2e-2)
    tensors = schedule.pool.tensors
    assert tensors is not None
    v1 = sum(a.nbytes for q in tensors for a in q.values()) + len(record) * (8 * 7 + 1)
    print(f"{args.model}: {len(record)} requests in {args.duration:g} s at {args.qps:g} q/s, "
          f"id drift {args.id_drift:g}: pool of {len(tensors)} queries "
          f"({sum(q['sparse_indices'].size for q in tensors):,} ids; planned in {planned_s:.1f} s)")
    print(f"  format 1 (raw tensors):      {v1 / 1e6:10.1f} MB")
    meta = {"config": config.to_dict()}
    with tempfile.TemporaryDirectory() as tmp:
        path = save_recording(Path(tmp) / "recipe.npz", record, schedule.query, tensors, meta,
                              recipe=schedule.pool.recipe, shape=shape.to_dict())
        print(f"  format 2, recipe (--record): {path.stat().st_size / 1e6:10.3f} MB")
        if not args.no_stored:
            t = time.perf_counter()
            path = save_recording(Path(tmp) / "stored.npz", record, schedule.query, tensors, meta,
                                  shape=shape.to_dict())
            print(f"  format 2, compressed ids:    {path.stat().st_size / 1e6:10.1f} MB "
                  f"(written in {time.perf_counter() - t:.0f} s)")


if __name__ == "__main__":
    main()
