"""The shared-memory arena of --workers: first-fit blocks that merge back, a bound that refuses, real mappings."""

from __future__ import annotations

import numpy as np
import pytest

from sixfold.server.workers.arena import ALIGN, Arena, ArenaFile


def test_blocks_are_aligned_bounded_and_merge_back_into_one_run():
    arena = Arena(10 * ALIGN)
    a, b, c = arena.alloc(1), arena.alloc(ALIGN + 1), arena.alloc(3 * ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)  # each rounded up to whole cache lines, first fit
    assert arena.held == 6 * ALIGN
    assert arena.alloc(5 * ALIGN) is None  # only 4 lines are left: a refusal, not growth
    arena.free(b)
    assert arena.alloc(2 * ALIGN) == ALIGN  # the hole is reused
    arena.free(ALIGN)
    arena.free(a)
    arena.free(c)
    assert arena.held == 0
    assert arena.alloc(10 * ALIGN) == 0  # every run merged back: the whole arena in one block
    with pytest.raises(KeyError):
        arena.free(ALIGN)  # not a block's offset


def test_what_one_mapping_writes_the_other_reads_in_place(tmp_path):
    path = tmp_path / "arena.in"
    writer = ArenaFile(path, 1 << 16, create=True)
    reader = ArenaFile(path, 1 << 16, create=False)  # as the engine maps a front end's arena
    values = np.arange(12, dtype=np.int64).reshape(3, 4)
    writer.write(128, values)
    view = reader.view(128, values.dtype, values.shape)
    np.testing.assert_array_equal(view, values)
    assert not view.flags.writeable  # the engine reads a request's inputs, never writes them
    writer.write(128, values * 2)
    np.testing.assert_array_equal(view, values * 2)  # a view, not a copy
    with pytest.raises(ValueError, match="expected"):
        ArenaFile(path, 1 << 15, create=False)  # a size the creator did not make
    with pytest.raises(FileExistsError):
        ArenaFile(path, 1 << 16, create=True)  # never two front ends on one file
    writer.unlink()
    assert not path.exists()
    np.testing.assert_array_equal(view, values * 2)  # the mapping outlives the name
