"""Tables written to disk in chunks (sixfold.partitioner.tables.build): streamed builds and imported user weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sixfold.backends.host.host_embedding import HostEmbeddingStage
from sixfold.partitioner.tables import build as table_build
from sixfold.partitioner.tables.checksums import verify_tables
from sixfold.partitioner.plan import PartitionPlan


def test_streamed_build_writes_tables_in_chunks_with_checksums(tmp_path, monkeypatch):
    monkeypatch.setattr(table_build, "_CHUNK_ROWS", 128)  # several chunks per table
    path = table_build.build_streamed("rm1", tmp_path / "rm1" / "1", max_rows=700, cards=2, progress=False,
                                      precision="int8")
    plan = PartitionPlan.load(path)
    assert plan.tables["rows"] == [700] * 8
    tables = tmp_path / "rm1" / "1" / "tables"
    verify_tables(tables, plan.tables["checksums"])
    assert "int8/table_007.npy" in plan.tables["checksums"]
    first = np.load(tables / "table_000.npy")
    bound = (1 / 700) ** 0.5
    assert first.shape == (700, 32) and first.dtype == np.float32
    assert -bound <= first.min() and first.max() <= bound and first.std() > bound / 3
    assert not np.array_equal(first, np.load(tables / "table_001.npy"))  # a stream per table
    # the quantized copies are what the host stage would have made from the fp32 rows
    stage = HostEmbeddingStage(tables, "int8", table_memory=0.5, item_ids=8 * 80)
    lengths = np.ones((3, 8), np.int32)
    ids = np.arange(24, dtype=np.int64)
    np.testing.assert_array_equal(stage.run_numpy(lengths, ids),
                                  HostEmbeddingStage(tables, "int8", cache=False).run_numpy(lengths, ids))
    # given plan.json's checksums (as the loader does, after checking them), the copies are read as they are
    served = HostEmbeddingStage(tables, "int8", table_memory=0.5, item_ids=8 * 80,
                                fingerprints=plan.tables["checksums"])
    assert [t.path for t in served.stores[0].tables] == [tables / "int8" / f"table_{t:03d}.npy" for t in range(8)]
    np.testing.assert_array_equal(served.run_numpy(lengths, ids), stage.run_numpy(lengths, ids))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rm1"] and sorted(p.name for p in (tmp_path / "rm1").iterdir()) == ["1"]


@pytest.mark.parametrize("form", ["state_dict", "npy"])
def test_import_user_tables(tmp_path, monkeypatch, form):
    monkeypatch.setattr(table_build, "_CHUNK_ROWS", 100)
    bags = torch.nn.ModuleList([torch.nn.EmbeddingBag(r, 8, mode="sum") for r in (300, 50, 1000)])
    if form == "state_dict":
        source = tmp_path / "weights.pt"
        torch.save({"emb.10.weight": bags[2].weight.detach(), **{f"emb.{i}.weight": bags[i].weight.detach()
                                                                 for i in (0, 1)}, "mlp.bias": torch.zeros(3)},
                   source)
    else:
        source = tmp_path / "npy"
        source.mkdir()
        for i, name in ((0, "t2.npy"), (1, "t9.npy"), (2, "t10.npy")):
            np.save(source / name, bags[i].weight.detach().numpy())
    done = table_build.import_tables(source, tmp_path / "v1", progress=False)
    assert [shape for _, shape in done] == [(300, 8), (50, 8), (1000, 8)]  # natural order: 0, 1, 10 / 2, 9, 10
    for t in range(3):
        np.testing.assert_array_equal(np.load(tmp_path / "v1" / "tables" / f"table_{t:03d}.npy"),
                                      bags[t].weight.detach().numpy())


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_packed_only_tables_serve_like_quantized_fp32(tmp_path, precision):
    """int8/int4 rows written packed (no fp32 on disk) give the sums the fp32 source would, resident or tiered."""
    full = tmp_path / "full"
    packed = tmp_path / "packed"
    for t in range(3):
        chunks = list(table_build._uniform_chunks(400, 16, 0, t))
        table_build.write_table(full / f"table_{t:03d}.npy", 400, 16, iter(chunks))
        table_build.write_table(packed / f"table_{t:03d}.npy", 400, 16, iter(chunks), precision=precision,
                                packed_only=True)
    assert np.load(packed / "table_000.npy", mmap_mode="r").dtype == np.uint8
    lengths = np.full((5, 3), 4, np.int32)
    ids = np.random.default_rng(0).integers(0, 400, 60)
    want = HostEmbeddingStage(full, precision, cache=False).run_numpy(lengths, ids)
    for stage in (HostEmbeddingStage(packed, precision), HostEmbeddingStage(packed, precision, layout="per-table"),
                  HostEmbeddingStage(packed, precision, table_memory=0.7, item_ids=12)):
        assert stage.dim == 16
        np.testing.assert_array_equal(stage.run_numpy(lengths, ids), want)


def _mount_small(where, size: str = "2m") -> None:
    import subprocess
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                          text=True, timeout=10)
    if done.returncode:
        pytest.skip(f"mounting is not allowed here: {done.stderr.strip() or done.returncode}")


def test_a_build_into_a_full_disk_leaves_nothing_and_names_the_file(tmp_path):
    import errno
    import subprocess

    disk = tmp_path / "disk"
    _mount_small(disk)
    try:
        leftover = disk / "repo" / "rm1" / ".2.tmp999999"  # a crashed build's temporary (no such process)
        leftover.mkdir(parents=True)
        with pytest.raises(OSError) as full:
            table_build.build_streamed("rm1", disk / "repo" / "rm1" / "1", max_rows=4000, cards=2, progress=False,
                                       precision="fp16")  # 8 x 4000 x 32 x 6 B = 6 MiB: does not
        assert full.value.errno == errno.ENOSPC
        message = str(full.value)
        assert "repo/rm1/1: not written" in message and "table_" in message and "bytes needed" in message
        assert sorted(p.name for p in (disk / "repo" / "rm1").iterdir()) == []  # no half-built version, no leftover
        path = table_build.build_streamed("rm1", disk / "repo" / "rm1" / "1", max_rows=500, cards=2, progress=False)
        verify_tables(path.parent / "tables", PartitionPlan.load(path).tables["checksums"])
    finally:
        subprocess.run(["umount", "-l", str(disk)], timeout=10)
