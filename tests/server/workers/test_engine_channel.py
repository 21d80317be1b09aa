"""The engine channel of ``--workers N`` on its own: a real EngineChannel and EngineClient over a real Unix
socket in a run folder, the real ``tiny`` model behind them (issue 35: the front end -> engine hop)."""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np
import pytest

from sixfold import models
from sixfold.server.workers.engine_channel import (INLINE_OUTPUT_BYTES, EngineChannel, EngineClient, FrameReader,
                                                   frame)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tiny():
    return _load_tiny()


def _load_tiny():
    from sixfold.server.loading.loader import load_builtin
    from sixfold.server.observability.metrics import ServerMetrics
    from sixfold.server.scheduling.batcher import BatchingConfig

    return load_builtin("tiny", max_rows=None, seed=0, cards=2, backend="simcard", card_spec="m2-card",
                        metrics=ServerMetrics(), batching=BatchingConfig())


async def _wait_for(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


async def test_small_outputs_ride_in_the_answer_and_large_ones_use_the_arena_and_are_freed(tiny, tmp_path):
    from sixfold.server.core import InferenceCore

    channel = EngineChannel(InferenceCore([tiny]), tmp_path)
    await channel.start()
    client = EngineClient(tmp_path, 0, 4 << 20, 4 << 20)
    try:
        await client.connect()
        gen = models.RequestGenerator.for_config(models.get_config("tiny"), seed=7)
        assert await _wait_for(lambda: any(link.out_arena is not None for link in channel.links), 10)
        (link,) = channel.links
        for items in (1, 3, INLINE_OUTPUT_BYTES // 4 + 1, 3000):  # scores are FP32 [items, 1]
            request = gen.make(items)
            name, version, outputs = await client.infer("tiny", "", request, ["scores"], None, 0)
            expected = await tiny.infer(request, ["scores"])
            assert (name, version) == (tiny.name, tiny.version)
            np.testing.assert_array_equal(outputs["scores"], expected["scores"])
            assert outputs["scores"].shape == (items, 1)
            if items * 4 <= INLINE_OUTPUT_BYTES:  # in the answer: no block was taken, none is owed back
                assert link.out_arena.held == 0
            else:  # through the arena: the block is freed once the front end has read it
                assert await _wait_for(lambda: link.out_arena.held == 0, 10), link.out_arena.held
            assert client.arena.held == 0 and client.pending() == 0
        many = [gen.make(1) for _ in range(64)]  # concurrent answers share frames: each finds its own request
        answers = await asyncio.gather(*(client.infer("tiny", "", r, [], None, 0) for r in many))
        for request, (_, _, outputs) in zip(many, answers):
            np.testing.assert_array_equal(outputs["scores"], (await tiny.infer(request, []))["scores"])
        with pytest.raises(Exception, match="nope"):  # an error still travels as the engine raised it
            await client.infer("nope", "", many[0], [], None, 0)
    finally:
        await client.close()
        await channel.close()


async def test_frame_reader_takes_every_whole_frame_and_waits_for_split_ones():
    left, right = socket.socketpair()
    reader, own_writer = await asyncio.open_connection(sock=left)  # kept: a dropped StreamWriter closes its socket
    _, writer = await asyncio.open_connection(sock=right)
    frames = FrameReader(reader)

    async def send(data: bytes) -> None:
        writer.write(data)
        await writer.drain()

    try:
        big = bytes(range(256)) * 1024  # a payload larger than one read
        await send(frame({"n": 1}) + frame({"n": 2}, b"xy") + frame({"n": 3}))
        assert await asyncio.wait_for(frames.frames(), 10) == [({"n": 1}, b""), ({"n": 2}, b"xy"), ({"n": 3}, b"")]
        whole = frame({"n": 4}, big) + frame({"n": 5})
        pending = asyncio.ensure_future(frames.frames())
        await send(whole[:5])  # not even a whole prefix yet
        await asyncio.sleep(0.05)
        assert not pending.done()
        await send(whole[5:100])
        await asyncio.sleep(0.05)
        assert not pending.done()
        sending = asyncio.ensure_future(send(whole[100:]))  # more than the socket holds: read while it is sent
        got = await asyncio.wait_for(pending, 10)
        if len(got) == 1:  # the last frame may come in a later read
            got += await asyncio.wait_for(frames.frames(), 10)
        await asyncio.wait_for(sending, 10)
        assert got == [({"n": 4}, big), ({"n": 5}, b"")]
        await send(frame({"n": 6})[:7])
        writer.close()
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(frames.frames(), 10)
    finally:
        writer.close()
        own_writer.close()


async def test_frame_reader_refuses_a_header_past_its_bound():
    left, right = socket.socketpair()
    reader, own_writer = await asyncio.open_connection(sock=left)
    try:
        right.sendall((1 << 30).to_bytes(4, "little") + (0).to_bytes(4, "little"))  # 8 bytes: never blocks
        with pytest.raises(ValueError, match="frame header of"):
            await asyncio.wait_for(FrameReader(reader).frames(), 10)
    finally:
        right.close()
        own_writer.close()


async def test_numpy_numbers_in_a_request_reach_the_engine_as_plain_numbers(tmp_path):
    """The header is marshalled, and marshal would write a numpy float64 as bytes: the client makes them plain."""
    from sixfold.server.core import InferenceCore

    tiny = _load_tiny()  # its own batcher, on this test's event loop
    channel = EngineChannel(InferenceCore([tiny]), tmp_path)
    await channel.start()
    client = EngineClient(tmp_path, 0, 4 << 20, 4 << 20)
    try:
        await client.connect()
        request = models.RequestGenerator.for_config(models.get_config("tiny"), seed=3).make(2)
        _, _, outputs = await client.infer("tiny", "", request, ["scores"], np.float64(5.0), np.int64(0))
        np.testing.assert_array_equal(outputs["scores"], (await tiny.infer(request, ["scores"]))["scores"])
    finally:
        await client.close()
        await channel.close()
