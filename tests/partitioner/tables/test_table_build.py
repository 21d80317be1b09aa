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


def _version_with_tables(folder, source, rows, dim=8, seed=0):
    """A version folder of tables imported from .npy files written to ``source``."""
    source.mkdir()
    rng = np.random.default_rng(seed)
    for t, r in enumerate(rows):
        np.save(source / f"t{t}.npy", rng.random((r, dim), dtype=np.float32))
    table_build.import_tables(source, folder, progress=False)
    return source


def _snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_an_import_that_fails_on_a_damaged_file_names_it_and_leaves_the_version_as_it_was(tmp_path):
    """The third of three source files is cut short: the error names it; the version's tables and plan.json
    are byte for byte what they were, and no temporary is left beside the folder."""
    version = tmp_path / "repo" / "mine" / "1"
    table_build.build_streamed("rm1", version, max_rows=300, cards=2, progress=False)
    before = _snapshot(version)
    source = tmp_path / "new"
    source.mkdir()
    rng = np.random.default_rng(1)
    for name in ("a1.npy", "a2.npy", "a3.npy"):
        np.save(source / name, rng.random((300, 32), dtype=np.float32))
    damaged = source / "a3.npy"
    damaged.write_bytes(damaged.read_bytes()[:20_000])
    with pytest.raises(ValueError, match="a3.npy"):
        table_build.import_tables(source, version, progress=False)
    assert _snapshot(version) == before
    assert sorted(p.name for p in version.parent.iterdir()) == ["1"]


def test_an_import_into_a_full_disk_leaves_nothing_half_built_and_cleans_a_crash_leftover(tmp_path):
    """A real 2 MiB file system: the import into an existing version fails with ENOSPC naming the table and
    the bytes, mid-way (after its first tables); the version is as it was, the temporary and a crashed
    import's leftover are gone; a smaller import then succeeds and replaces the tables whole."""
    import errno
    import subprocess

    disk = tmp_path / "disk"
    _mount_small(disk)
    try:
        version = disk / "repo" / "mine" / "1"
        _version_with_tables(version, tmp_path / "old", rows=(100, 100))
        before = _snapshot(version)
        leftover = version.parent / ".1.tmp999999"  # a crashed import's temporary (no such process)
        leftover.mkdir()
        (leftover / "tables").mkdir()
        source = tmp_path / "big"
        source.mkdir()
        for t in range(4):  # 4 x 600 KB: the third does not fit
            np.save(source / f"t{t}.npy", np.full((5000, 32), t, np.float32))
        with pytest.raises(OSError) as full:
            table_build.import_tables(source, version, progress=False)
        assert full.value.errno == errno.ENOSPC
        message = str(full.value)
        assert "mine/1: not written" in message and "table_00" in message and "bytes needed" in message, message
        assert _snapshot(version) == before
        assert sorted(p.name for p in version.parent.iterdir()) == ["1"]
        small = tmp_path / "small"
        small.mkdir()
        np.save(small / "t0.npy", np.full((40, 8), 7, np.float32))
        assert table_build.import_tables(small, version, progress=False) == [("t0.npy", (40, 8))]
        assert sorted(p.name for p in (version / "tables").iterdir()) == ["table_000.npy"]
        np.testing.assert_array_equal(np.load(version / "tables" / "table_000.npy"), np.full((40, 8), 7, np.float32))
    finally:
        subprocess.run(["umount", "-l", str(disk)], timeout=10)
