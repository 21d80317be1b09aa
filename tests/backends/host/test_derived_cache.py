"""Derived tables (fused weights, int8/fp16 rows) live in a cache folder keyed by contents, never beside the tables.

Read-only table folders serve; a new version copied over a served one with its modification times kept
(``cp -p``) is never scored with the old rows; a full disk is an OSError naming the file and the bytes,
and a stage whose cache cannot be written serves the tables as they are.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from sixfold.backends.host import derived_cache
from sixfold.backends.host.host_embedding import HostEmbeddingStage
from tests.backends.host.test_host_embedding import make_request, make_tables, reference, save_tables


def _mount(args: list[str], where: Path) -> None:
    done = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True, timeout=10)
    if done.returncode:
        pytest.skip(f"mounting is not allowed here: {done.stderr.strip() or done.returncode}")


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a cache folder whose disk fills up."""
    where = tmp_path / "small"
    where.mkdir()
    _mount(["-t", "tmpfs", "-o", "size=2m", "tmpfs"], where)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True, timeout=10)  # lazy: a test's maps may remain


def _read_only(folder: Path) -> None:
    """Mount ``folder`` over itself read-only (root can write through chmod, not through this)."""
    _mount(["--bind", str(folder)], folder)
    done = subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], capture_output=True, text=True, timeout=10)
    if done.returncode:
        subprocess.run(["umount", str(folder)], timeout=10)
        pytest.skip(f"read-only remounts are not allowed here: {done.stderr.strip()}")


def test_read_only_tables_serve_from_the_cache_and_without_one(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    tables = make_tables(rows=(300, 70, 1, 130), dim=16)
    src = save_tables(tables, tmp_path / "tables")
    (tmp_path / "ro-cache").mkdir()
    _read_only(src)
    _read_only(tmp_path / "ro-cache")
    try:
        with pytest.raises(OSError) as refused:
            (src / "probe").write_bytes(b"x")
        assert refused.value.errno == errno.EROFS
        lengths, indices = make_request((300, 70, 1, 130), n=9, seed=3)
        want = HostEmbeddingStage(tables).run_numpy(lengths, indices)
        cached = HostEmbeddingStage(src, cache_dir=tmp_path / "cache")
        assert cached.uncached is None and len(cached.groups) == 1
        assert cached.cache_paths[0].parent == tmp_path / "cache" / "tables"
        np.testing.assert_array_equal(cached.run_numpy(lengths, indices), want)
        # No writable cache: fused fp32 is served per table from the files themselves, the reason kept.
        bare = HostEmbeddingStage(src, cache_dir=tmp_path / "ro-cache" / "sixfold")
        assert "ro-cache" in (bare.uncached or "") and "Read-only" in (bare.uncached or "")
        assert len(bare.groups) == 4 and not bare.cache_paths
        assert "no fp32 cache" in caplog.text and "serving them per table" in caplog.text  # the log says why
        np.testing.assert_allclose(bare.run_numpy(lengths, indices), want, rtol=1e-6, atol=1e-6)
        int8 = HostEmbeddingStage(src, "int8", cache_dir=tmp_path / "ro-cache")  # converted in memory
        err = np.abs(int8.run_numpy(lengths, indices) - reference(tables, lengths, indices))
        assert int8.uncached and err.max() < 0.1
        with pytest.raises(ValueError, match="tiered int8 rows are read from a converted file in the cache folder"):
            HostEmbeddingStage(src, "int8", cache_dir=tmp_path / "ro-cache", table_memory=0.5)
        tiered = HostEmbeddingStage(src, cache_dir=tmp_path / "ro-cache", table_memory=0.5)  # fp32 needs no cache
        np.testing.assert_array_equal(tiered.run_numpy(lengths, indices), want)
        tiered.close()
    finally:
        subprocess.run(["umount", "-l", str(src)], timeout=10)
        subprocess.run(["umount", "-l", str(tmp_path / "ro-cache")], timeout=10)
    assert sorted(p.name for p in src.iterdir()) == [f"table_{t:03d}.npy" for t in range(4)]


def test_a_version_copied_over_with_cp_p_is_scored_with_its_own_rows(tmp_path: Path) -> None:
    rows = (200, 50, 3, 80)
    old, new = make_tables(rows, seed=1), make_tables(rows, seed=2)
    staged = save_tables(new, tmp_path / "next" / "tables")  # built first: older modification times
    served = save_tables(old, tmp_path / "version" / "tables")
    lengths, indices = make_request(rows, n=7, seed=4)
    for precision in ("fp32", "int8"):
        before = HostEmbeddingStage(served, precision, cache_dir=tmp_path / "cache")
        np.testing.assert_array_equal(before.run_numpy(lengths, indices),
                                      HostEmbeddingStage(old, precision).run_numpy(lengths, indices))
    subprocess.run(["cp", "-p", *sorted(map(str, staged.iterdir())), str(served)], check=True, timeout=30)
    assert (served / "table_000.npy").stat().st_mtime < before.cache_paths[0].stat().st_mtime
    for precision in ("fp32", "int8"):
        after = HostEmbeddingStage(served, precision, cache_dir=tmp_path / "cache")
        np.testing.assert_array_equal(after.run_numpy(lengths, indices),
                                      HostEmbeddingStage(new, precision).run_numpy(lengths, indices))
    # The plan's checksums are the key when given: the same contents find the same file.
    fingerprints = {p.name: derived_cache.source_checksum(p) for p in served.iterdir()}
    again = HostEmbeddingStage(served, "int8", cache_dir=tmp_path / "cache", fingerprints=fingerprints)
    assert again.cache_paths == after.cache_paths


def test_a_full_disk_is_an_error_naming_the_file_and_the_bytes(small_fs: Path) -> None:
    path = small_fs / "big.npy"
    rows = np.ones((1024, 1024), np.float32)  # 4 MiB into 2 MiB
    with pytest.raises(OSError) as full:
        derived_cache.write_npy(path, np.float32, rows.shape, [rows[:512], rows[512:]])
    assert full.value.errno == errno.ENOSPC
    assert str(path) in str(full.value) and "4194432 bytes needed" in str(full.value)
    assert list(small_fs.iterdir()) == []  # nothing half-written left behind
    derived_cache.write_npy(path, np.float32, (256, 1024), [rows[:256]])  # what fits is written whole
    np.testing.assert_array_equal(np.load(path), rows[:256])


def test_a_stage_whose_cache_disk_is_full_serves_the_tables_as_they_are(tmp_path: Path, small_fs: Path) -> None:
    tables = make_tables(rows=(4000, 4000, 2000), dim=64)  # 2.5 MiB of fp32 rows
    src = save_tables(tables, tmp_path / "tables")
    stage = HostEmbeddingStage(src, cache_dir=small_fs)
    assert "No space left" in (stage.uncached or "") and str(small_fs) in (stage.uncached or "")
    assert len(stage.groups) == 3 and [p.name for p in (small_fs / "tables").iterdir()] == []
    lengths, indices = make_request(stage.table_rows, n=6, seed=5)
    np.testing.assert_allclose(stage.run_numpy(lengths, indices), HostEmbeddingStage(tables).run_numpy(lengths, indices),
                               rtol=1e-6, atol=1e-6)


def test_temporaries_of_stopped_processes_are_removed(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait(timeout=10)
    (tmp_path / f".fp32-x.npy.tmp{gone.pid}").write_bytes(b"half")
    (tmp_path / f".delta.tmp{gone.pid}").mkdir()
    mine = tmp_path / ".fp32-y.npy.tmp1"  # pid 1 runs: not a leftover
    mine.write_bytes(b"busy")
    derived_cache.prepare_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [mine.name]
    shutil.rmtree(tmp_path)


def _age(path: Path, seconds_ago: float) -> None:
    """Set ``path``'s access and modification times to ``seconds_ago`` (its last use, as the cache sees it)."""
    then = time.time() - seconds_ago
    os.utime(path, (then, then))


def test_the_cache_is_capped_least_recently_used_first_never_a_mapped_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three table sets' fused entries against a cap of two and a half: writing the third removes the least
    recently used entry no stage maps (the older, mapped one stays and still scores); once that stage is gone,
    it goes next."""
    import gc

    rows = (400, 90, 7, 150)
    sets = {name: make_tables(rows, dim=16, seed=seed) for name, seed in (("a", 1), ("b", 2), ("c", 3))}
    sources = {name: save_tables(t, tmp_path / name / "tables") for name, t in sets.items()}
    lengths, indices = make_request(rows, n=8, seed=5)
    cache = tmp_path / "cache"
    entry_bytes = 128 + sum(rows) * 16 * 4
    monkeypatch.setenv(derived_cache.CACHE_MAX_ENV, str(int(2.5 * entry_bytes)))
    a = HostEmbeddingStage(sources["a"], cache_dir=cache)  # kept: its entry stays mapped
    b = HostEmbeddingStage(sources["b"], cache_dir=cache)
    entry = {"a": a.cache_paths[0], "b": b.cache_paths[0]}
    assert entry["a"].stat().st_size == entry_bytes
    del b
    gc.collect()
    _age(entry["a"], 7200)  # a: least recently used, but mapped
    _age(entry["b"], 3600)
    c = HostEmbeddingStage(sources["c"], cache_dir=cache)
    entry["c"] = c.cache_paths[0]
    assert entry["a"].exists() and entry["c"].exists() and not entry["b"].exists()
    np.testing.assert_array_equal(a.run_numpy(lengths, indices), HostEmbeddingStage(sets["a"]).run_numpy(lengths, indices))
    del a
    gc.collect()
    assert entry["a"].stat().st_atime > time.time() - 600  # seen mapped at the last eviction: used then, not 2 h ago
    _age(entry["a"], 7200)
    _age(entry["c"], 1800)
    b = HostEmbeddingStage(sources["b"], cache_dir=cache)  # written again: now a (unmapped, oldest) goes
    assert not entry["a"].exists() and entry["b"].exists() and entry["c"].exists()
    assert sorted(p.name for p in (cache / "tables").iterdir()) == sorted([entry["b"].name, entry["c"].name])
    np.testing.assert_array_equal(b.run_numpy(lengths, indices), HostEmbeddingStage(sets["b"]).run_numpy(lengths, indices))


def test_eviction_spares_entries_another_process_maps_and_recent_ones(tmp_path: Path) -> None:
    """A real second process maps one entry: it is never removed while that process runs; entries used in the
    last RECENT_S are spared too; with no cap given the folder keeps 4x its largest entry."""
    folder = tmp_path / "tables"
    folder.mkdir()
    files = []
    for i in range(8):
        path = folder / f"fp32-1t-{i:040d}.npy"
        np.save(path, np.full((1000, 8), i, np.float32))
        _age(path, 10_000 - i)  # 0 is the least recently used
        files.append(path)
    recent = folder / "fp32-1t-recent.npy"
    np.save(recent, np.zeros((1000, 8), np.float32))  # just written: spared whatever its rank
    holder = subprocess.Popen([sys.executable, "-c", "import sys, numpy as np; m = np.load(sys.argv[1], "
                               "mmap_mode='r'); float(m[0, 0]); print('mapped', flush=True); sys.stdin.read()",
                               str(files[0])], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert derived_cache.files_in_use(files[:2]) == {files[0]}
        size = files[0].stat().st_size
        removed = derived_cache.evict(folder, max_bytes=5 * size)
        assert removed == files[1:5]  # 0 is mapped, "recent" is recent: the next four oldest go
        assert files[0].exists() and recent.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=10)
    _age(files[0], 20_000)
    assert derived_cache.evict(folder, max_bytes=5 * size) == []  # five entries fit five
    assert derived_cache.evict(folder, max_bytes=4 * size) == [files[0]]  # its process is gone: now it goes
    assert derived_cache.evict(folder) == []  # 4 entries: within the default of 4x the largest
    np.save(folder / "fp32-1t-extra.npy", np.zeros((10, 8), np.float32))
    _age(folder / "fp32-1t-extra.npy", 50_000)
    assert derived_cache.evict(folder) == [folder / "fp32-1t-extra.npy"]
    assert derived_cache.evict(folder, max_bytes=0) == []  # 0: no cap


def test_sixfold_serve_cache_max_bytes_evicts_old_entries_at_load(tmp_path: Path) -> None:
    """The flag end to end: a real sixfold-serve loads a repository version (tables built to disk), writes its
    fused entry into --cache-dir and, capped at 1 byte, removes three old small entries (the default cap, 4x the
    largest entry, would keep them) but not its own, which it maps; it serves."""
    import tritonclient.grpc as tc

    from sixfold import models
    from sixfold.partitioner.tables.build import build_streamed
    from tests.conftest import ServeProcess, triton_inputs

    build_streamed("rm1", tmp_path / "repo" / "rm1" / "1", max_rows=300, cards=1, progress=False)
    folder = tmp_path / "cache" / "tables"
    folder.mkdir(parents=True)
    old = [folder / f"fp32-1t-{i:040d}.npy" for i in range(3)]
    for path in old:
        np.save(path, np.zeros((16, 8), np.float32))
        _age(path, 3600)
    assert derived_cache.evict(folder) == []  # the default cap keeps them
    serve = ServeProcess("--model-repository", str(tmp_path / "repo"), "--backend", "simcard", "--grpc-port", "0",
                         "--metrics-port", "0", "--cache-dir", str(tmp_path / "cache"), "--cache-max-bytes", "1")
    try:
        assert serve.url, serve.output
        entries = sorted(p.name for p in folder.iterdir())
        assert len(entries) == 1 and entries[0].startswith("fp32-") and not any(p.exists() for p in old), entries
        assert "over its cap of 1" in serve.output  # its own entry, mapped, stays: the log says so
        request = models.RequestGenerator.for_config(models.get_config("rm1", max_rows=300), seed=1).make(4)
        with tc.InferenceServerClient(serve.url) as client:
            assert client.infer("rm1", triton_inputs(tc, request)).as_numpy("scores").shape == (4, 1)
    finally:
        serve.stop()
