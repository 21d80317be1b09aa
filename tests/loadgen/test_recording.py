"""Recordings: compact (recipe or compressed ids), bit-identical on replay, self-describing, refused whole when bad."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sixfold.loadgen import LoadConfig, load_recording, run_load_async, save_recording
from sixfold.loadgen.cli import main
from sixfold.loadgen.errors import LoadgenError
from sixfold.loadgen.record import RunRecord
from sixfold.loadgen.recording import RECORDING_SCHEMA_V1
from sixfold.loadgen.runner import plan_run
from sixfold.loadgen.target import ModelShape
from sixfold.models.signature import DENSE, INDICES, LENGTHS

# Big enough that storing the pool shows: 10 tables x pooling 20 x 200 items = 40k ids (320 KB) per query.
SHAPE = ModelShape(dense_dim=16, table_rows=(500_000,) * 10, pooling=(20,) * 10, zipf=1.05)


def planned(**kw):
    config = LoadConfig(**{**dict(url="127.0.0.1:1", model="m", qps=20.0, duration_s=4.0, query_size="fixed:200",
                                  pool=6), **kw})
    schedule = plan_run(config, SHAPE, lambda q: None, keep_tensors=True)
    record = RunRecord(schedule.offsets, schedule.items)
    for i in range(len(record)):
        record.mark_sent(i, float(schedule.offsets[i]) + 0.001)
        record.mark_ok(i, float(schedule.offsets[i]) + 0.01)
    return config, schedule, record


def same(a, b) -> bool:
    return all(x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x)
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("drift", [0.0, 0.25])
def test_generated_pool_is_stored_as_its_recipe_and_rebuilt_bit_for_bit(tmp_path, drift):
    config, schedule, record = planned(id_drift=drift)
    raw = sum(v.nbytes for q in schedule.pool.tensors for v in q.values())
    assert raw > 2_000_000
    path = save_recording(tmp_path / "r.npz", record, schedule.query, schedule.pool.tensors,
                          {"config": config.to_dict()}, recipe=schedule.pool.recipe, shape=SHAPE.to_dict())
    assert path.stat().st_size < 20_000  # the recipe, not the 2+ MB (x4 slices with drift) of tensors
    loaded = load_recording(path)
    assert loaded.recipe is not None and len(loaded.tensors) == len(schedule.pool.tensors)
    assert same(loaded.tensors, schedule.pool.tensors)
    assert np.array_equal(loaded.query, schedule.query) and np.array_equal(loaded.items, schedule.items)
    assert loaded.shape["table_rows"] == list(SHAPE.table_rows) and loaded.shape["dense_dim"] == 16


def test_a_pool_without_a_recipe_is_stored_compressed_and_read_back_exactly(tmp_path):
    config, schedule, record = planned()
    path = save_recording(tmp_path / "r.npz", record, schedule.query, schedule.pool.tensors,
                          {"config": config.to_dict()}, shape=SHAPE.to_dict())
    raw = sum(v.nbytes for q in schedule.pool.tensors for v in q.values())
    assert path.stat().st_size < raw / 2.5  # ids: narrowest dtype, byte planes, deflate
    loaded = load_recording(path)
    assert loaded.recipe is None and loaded.meta["pool"]["source"] == "stored"
    assert same(loaded.tensors, schedule.pool.tensors)


def test_format_1_recordings_still_load(tmp_path):
    config, schedule, record = planned(pool=2, duration_s=1.0)
    tensors = schedule.pool.tensors
    path = tmp_path / "v1.npz"
    n = len(record)
    np.savez(path, meta=np.array(json.dumps({"schema": RECORDING_SCHEMA_V1, "config": config.to_dict(),
                                             "target": SHAPE.to_dict()})),
             due=record.due, sent=record.sent, done=record.done, latency=record.done - record.due,
             status=record.status, items=record.items, query=schedule.query,
             error_index=np.zeros(0, np.int64), error_reason=np.zeros(0, str),
             pool_items=np.asarray([t[DENSE].shape[0] for t in tensors]),
             pool_ids=np.asarray([t[INDICES].size for t in tensors]),
             **{k: np.concatenate([t[k] for t in tensors]) for k in (DENSE, LENGTHS, INDICES)})
    loaded = load_recording(path)
    assert len(loaded) == n and same(loaded.tensors, tensors)
    assert loaded.shape["table_rows"] == list(SHAPE.table_rows)  # from format 1's target


@pytest.mark.parametrize("damage", ["truncate", "flip", "recipe", "garbage", "inconsistent"])
def test_a_bad_recording_is_refused_whole_naming_the_file(tmp_path, damage):
    config, schedule, record = planned(pool=2, duration_s=1.0)
    stored = damage == "inconsistent"
    path = save_recording(tmp_path / "r.npz", record, schedule.query, schedule.pool.tensors,
                          {"config": config.to_dict()}, recipe=None if stored else schedule.pool.recipe,
                          shape=SHAPE.to_dict())
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) * 2 // 3]))
    elif damage == "flip":  # one byte inside the largest member's data (a byte of the zip's own bookkeeping,
        # such as an unused header field, may be harmless; where the middle byte lands moves with the contents)
        import zipfile

        with zipfile.ZipFile(path) as archive:
            member = max(archive.infolist(), key=lambda i: i.compress_size)
        off = member.header_offset
        start = off + 30 + int.from_bytes(data[off + 26:off + 28], "little") + \
            int.from_bytes(data[off + 28:off + 30], "little")
        data[start + member.compress_size // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "garbage":
        path.write_bytes(b"not a recording at all")
    else:
        with np.load(path) as npz:
            arrays = {k: npz[k] for k in npz.files}
        meta = json.loads(str(arrays["meta"]))
        if damage == "recipe":
            meta["pool"]["recipe"]["rng_state"]["state"]["state"] += 1  # rebuilds other ids than were sent
        else:
            arrays["pool_ids"] = arrays["pool_ids"] + 1
        arrays["meta"] = np.array(json.dumps(meta))
        np.savez_compressed(path, **arrays)
    with pytest.raises(ValueError, match="r.npz"):
        recording = load_recording(path)
        recording.tensors  # a recipe is checked when the queries are rebuilt, before anything is sent


def config_for(server, **kw) -> LoadConfig:
    base = dict(url=server.url, model="fake-rm", qps=60.0, duration_s=0.6, query_size="uniform:1-5",
                wait_ready_s=5.0, drain_timeout_s=2.0, pool=4)
    return LoadConfig(**{**base, **kw})


async def test_replay_needs_no_table_rows_and_sends_the_same_bits(fake_server, tmp_path):
    server = fake_server(sixfold_params=False, keep_ids=True)  # like Triton: no sixfold.table_rows
    path = tmp_path / "run.npz"
    with pytest.raises(LoadgenError, match="--table-rows"):
        await run_load_async(config_for(server))
    first = await run_load_async(config_for(server, table_rows=(100, 200, 300), pooling=(2, 3, 1), id_drift=0.5,
                                            record_path=str(path)))
    assert first.requests["errors"] == 0
    sent = list(server.seen.ids)
    server.seen.ids.clear()
    replayed = await run_load_async(config_for(server, qps=0.0, replay_path=str(path)))  # no --table-rows
    assert replayed.requests == first.requests and replayed.target["sources"]["table_rows"] == "recording"
    # NOTE: the same queries, bit for bit; not in the same order: two overdue sends on a busy machine may
    # reach the server either way round
    assert sorted(a.tobytes() for a in server.seen.ids) == sorted(a.tobytes() for a in sent)


async def test_replay_against_a_smaller_model_is_refused(fake_server, tmp_path):
    big = fake_server(table_rows=(1000, 2000, 3000))
    path = tmp_path / "run.npz"
    await run_load_async(config_for(big, record_path=str(path)))
    small = fake_server()  # 100, 200, 300 rows
    with pytest.raises(LoadgenError, match=r"run.npz.*1000 rows in table 0.*has 100"):
        await run_load_async(config_for(small, qps=0.0, replay_path=str(path)))
    other = fake_server(dense_dim=5)
    with pytest.raises(LoadgenError, match="4 dense features"):
        await run_load_async(config_for(other, qps=0.0, replay_path=str(path)))


def test_cli_replay_of_a_truncated_recording_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "cut.npz"
    path.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    assert main(["--url", "127.0.0.1:1", "--model", "m", "--replay", str(path), "--report",
                 str(tmp_path / "r.json")]) == 2
    assert "cut.npz" in capsys.readouterr().err
