"""The channel between the front ends and the engine of ``sixfold-serve --workers N``.

One Unix stream socket per front end, in the server's run folder, carries small frames: an
8-byte prefix (header length, payload length), a header, and rarely a payload. The header is a dict of
str, int, float, bool, None and lists in ``marshal``'s format: both ends are the same interpreter (the
front ends are the server's own children, on a socket in its private run folder), and it costs ~3 us a
header to write and read against ~8.5 us for JSON, twice a request. Tensors do
not travel on it: a front end copies a request's inputs into its input arena
(``sixfold.server.workers.arena``) and sends their offsets, dtypes and shapes; the engine views
them in place, runs the same ``InferenceCore`` path one process runs (``core.serving`` then
``ServedModel.infer``, so requests from every front end meet in one batcher), writes the outputs
into the front end's output arena and answers with their offsets. An error travels as its class,
gRPC code, reason and message, and is raised again in the front end, so the client sees what
one process would have said.

Frames, front end -> engine: ``hello`` (the two arena files), ``infer``, ``free`` (output blocks
the front end has read). Engine -> front end: one answer per ``infer``, in any order, by id.
An output of at most ``INLINE_OUTPUT_BYTES`` travels in its answer's frame instead of the output
arena: a block would cost an allocation, a copy out and a ``free`` frame back (a write, and a wake-up
of the engine) for a few bytes. A side reads every frame the socket holds at once (``FrameReader``).
A block of the input arena is freed by the front end only once the engine answered its request
(even when the client gave up first), so the engine never reads a block being rewritten.
"""

from __future__ import annotations

import asyncio
import marshal
import logging
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from sixfold.server import errors
from sixfold.server.errors import InternalError, Overloaded, ServingError, Unavailable
from sixfold.server.workers.arena import Arena, ArenaFile

__all__ = ["ENGINE_SOCKET", "ENGINE_GRPC_SOCKET", "INLINE_OUTPUT_BYTES", "EngineChannel", "EngineClient", "FrameReader",
           "error_fields", "error_from"]

log = logging.getLogger(__name__)

ENGINE_SOCKET = "engine.sock"
"""The channel's socket, in the run folder."""
ENGINE_GRPC_SOCKET = "engine-grpc.sock"
"""The engine's own gRPC service on a Unix socket: the front ends forward every RPC but inference to it."""
_PREFIX = struct.Struct("<II")
_MAX_HEADER = 16 << 20
_READ_BYTES = 1 << 16
INLINE_OUTPUT_BYTES = 4096
"""Outputs up to this size go in the answer's frame, not the output arena (a 1-item answer is 4 bytes)."""
_ERRORS: dict[str, type[ServingError]] = {
    cls.__name__: cls for cls in (errors.InvalidInput, errors.ModelNotFound, errors.Unavailable, errors.Overloaded,
                                  errors.DeadlineExceeded, errors.InternalError, errors.Unauthenticated,
                                  errors.ServingError)}


class FrameReader:
    """Reads frames in bulk: every whole frame the socket has delivered, for one await.

    Under load a turn of the other side's loop writes many frames in one system call; reading them
    one ``readexactly`` at a time (prefix, header, payload) cost three awaits a frame.
    """

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self._buffer = bytearray()

    def _parse(self) -> list[tuple[dict, bytes]]:
        buffer, frames, start = self._buffer, [], 0
        while len(buffer) - start >= _PREFIX.size:
            header_len, payload_len = _PREFIX.unpack_from(buffer, start)
            if header_len > _MAX_HEADER:
                raise ValueError(f"engine channel frame header of {header_len} bytes")
            body = start + _PREFIX.size
            end = body + header_len + payload_len
            if len(buffer) < end:
                break
            frames.append((marshal.loads(buffer[body:body + header_len]),
                           bytes(buffer[body + header_len:end]) if payload_len else b""))
            start = end
        if start:
            del buffer[:start]
        return frames

    async def frames(self) -> list[tuple[dict, bytes]]:
        """The next whole frames (at least one); IncompleteReadError at the end of the stream."""
        while True:
            frames = self._parse()
            if frames:
                return frames
            wanted = _READ_BYTES
            if len(self._buffer) >= _PREFIX.size:  # a large frame: read up to its end at once
                header_len, payload_len = _PREFIX.unpack_from(self._buffer)
                wanted = max(wanted, _PREFIX.size + header_len + payload_len - len(self._buffer))
            data = await self.reader.read(wanted)
            if not data:
                raise asyncio.IncompleteReadError(bytes(self._buffer), None)
            self._buffer += data


def frame(header: Mapping[str, Any], payload: bytes = b"") -> bytes:
    """One frame's bytes: prefix, marshalled header, payload.

    NOTE: marshal writes any object with the buffer protocol as bytes (a numpy float64 among them): a
    header's numbers are made plain ``int``/``float`` where they are put in, never left to it.
    """
    data = marshal.dumps(header)
    return b"".join((_PREFIX.pack(len(data), len(payload)), data, payload))


class FrameWriter:
    """Frames queued during one turn of the event loop, written in one system call at its end.

    A socket write costs ~50 us on a busy host; under load many requests' frames share one. Frames are
    whole in the queue, so frames from concurrent tasks never interleave. ``free`` gathers output blocks
    to release into one ``free`` frame per turn.
    """

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._queue: list[bytes] = []
        self._freed: list[int] = []
        self._scheduled = False

    def send(self, header: Mapping[str, Any], payload: bytes = b"") -> None:
        self._queue.append(frame(header, payload))
        self._schedule()

    def free(self, offsets: Sequence[int]) -> None:
        self._freed.extend(offsets)
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._freed:
            self._queue.append(frame({"op": "free", "offsets": self._freed}))
            self._freed = []
        if self._queue and not self.writer.is_closing():
            self.writer.write(b"".join(self._queue))
        self._queue.clear()

    def is_closing(self) -> bool:
        return self.writer.is_closing()


def error_fields(exc: BaseException) -> dict[str, str]:
    """An error as the channel carries it: the nearest class of ``sixfold.server.errors``, code, reason, message."""
    if isinstance(exc, ServingError):
        kind = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERRORS), "ServingError")
        return {"error": kind, "code": exc.code.name, "reason": exc.reason, "message": exc.message}
    return {"error": "ServingError", "code": "INTERNAL", "reason": "internal", "message": f"{type(exc).__name__}: {exc}"}


def error_from(fields: Mapping[str, str]) -> ServingError:
    """The ServingError ``error_fields`` described, with the same gRPC code, reason and message."""
    exc = _ERRORS.get(fields.get("error", ""), ServingError)(fields.get("message", ""))
    exc.code = getattr(grpc.StatusCode, fields.get("code", ""), exc.code)
    exc.reason = fields.get("reason", exc.reason)
    return exc


class _FrontEndLink:
    """The engine's side of one front end: its arenas and the replies it is owed."""

    def __init__(self, core: Any, writer: asyncio.StreamWriter) -> None:
        self.core, self.writer = core, writer
        self.frames = FrameWriter(writer)
        self.inputs: ArenaFile | None = None
        self.outputs: ArenaFile | None = None
        self.out_arena: Arena | None = None
        self.tasks: set[asyncio.Task] = set()

    def hello(self, header: Mapping[str, Any]) -> None:
        self.inputs = ArenaFile(Path(header["inputs"]), int(header["input_bytes"]), create=False)
        self.outputs = ArenaFile(Path(header["outputs"]), int(header["output_bytes"]), create=False)
        self.out_arena = Arena(self.outputs.size)

    async def infer(self, header: Mapping[str, Any]) -> None:
        reply: dict[str, Any] = {"id": header["id"]}
        payload: list[bytes] = []
        placed: list[int] = []
        try:
            assert self.inputs is not None and self.outputs is not None and self.out_arena is not None, "no hello"
            model = self.core.serving(header["model"], header["version"])
            inputs = {name: self.inputs.view(offset, np.dtype(dtype), tuple(shape))
                      for name, dtype, shape, offset in header["inputs"]}
            outputs = await model.infer(inputs, header["outputs"], header["timeout"], header["priority"])
            entries = []
            inline = sum(len(p) for p in payload)
            for name, array in outputs.items():
                array = np.ascontiguousarray(array)
                if array.dtype.hasobject:
                    raise InternalError(f"output '{name}' is of BYTES: not served with --workers > 1")
                offset = self.out_arena.alloc(array.nbytes) if array.nbytes > INLINE_OUTPUT_BYTES else None
                if offset is None:  # small (or the output arena is full): the bytes go inline
                    entries.append([name, array.dtype.str, list(array.shape), -1 - inline])
                    data = array.tobytes()
                    payload.append(data)
                    inline += len(data)
                else:
                    placed.append(offset)
                    self.outputs.write(offset, array)
                    entries.append([name, array.dtype.str, list(array.shape), offset])
            reply.update(ok=True, model=model.name, version=model.version, outputs=entries)
        except Exception as exc:  # noqa: BLE001 - every request is answered; the front end raises it again
            if not isinstance(exc, ServingError):
                log.exception("request %s from a front end failed", header.get("id"))
            for offset in placed:
                self.out_arena.free(offset)  # type: ignore[union-attr]
            reply = {"id": header["id"], "ok": False, **error_fields(exc)}
            payload = []
        self.frames.send(reply, b"".join(payload))

    def free(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            self.out_arena.free(offset)  # type: ignore[union-attr]


class EngineChannel:
    """The engine's end: serves every front end's requests through ``core`` (an InferenceCore)."""

    def __init__(self, core: Any, folder: Path) -> None:
        self.core = core
        self.path = folder / ENGINE_SOCKET
        self._server: asyncio.AbstractServer | None = None
        self.links: set[_FrontEndLink] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _FrontEndLink(self.core, writer)
        self.links.add(link)
        frames = FrameReader(reader)
        try:
            while True:
                for header, _ in await frames.frames():
                    op = header.get("op")
                    if op == "infer":
                        task = asyncio.ensure_future(link.infer(header))
                        link.tasks.add(task)
                        task.add_done_callback(link.tasks.discard)
                    elif op == "free":
                        link.free(header["offsets"])
                    elif op == "hello":
                        link.hello(header)
                    else:
                        raise ValueError(f"unknown engine channel op {op!r}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front end is gone: what it asked is still answered into the void, then its arenas unmapped
        except Exception:  # noqa: BLE001 - a broken frame ends this front end's link, not the engine
            log.exception("engine channel: dropping a front end")
        finally:
            self.links.discard(link)
            writer.close()
            for arena in (link.inputs, link.outputs):  # a killed front end cannot remove its own files
                if arena is not None:
                    arena.unlink()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for link in list(self.links):
            link.writer.close()


class EngineClient:
    """A front end's end: puts inputs in its arena, asks the engine, reads the outputs back."""

    def __init__(self, folder: Path, index: int, input_bytes: int, output_bytes: int) -> None:
        self.folder = folder
        self.inputs = ArenaFile(folder / f"frontend-{index}-{id(self):x}.in", input_bytes, create=True)
        self.outputs = ArenaFile(folder / f"frontend-{index}-{id(self):x}.out", output_bytes, create=True)
        self.arena = Arena(input_bytes)
        self._pending: dict[int, tuple[asyncio.Future, list[int]]] = {}
        self._next_id = 0
        self._writer: asyncio.StreamWriter | None = None
        self._frames: FrameWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self.gone: str = ""
        """Why the engine cannot be reached ("" while it can)."""

    def pending(self) -> int:
        """Requests sent to the engine and not answered yet."""
        return len(self._pending)

    async def connect(self) -> None:
        reader, self._writer = await asyncio.open_unix_connection(str(self.folder / ENGINE_SOCKET))
        self._frames = FrameWriter(self._writer)
        self._writer.write(frame({"op": "hello", "inputs": str(self.inputs.path), "input_bytes": self.inputs.size,
                                   "outputs": str(self.outputs.path), "output_bytes": self.outputs.size}))
        await self._writer.drain()
        self._reader_task = asyncio.ensure_future(self._read(reader))

    async def infer(self, model: str, version: str, inputs: Mapping[str, np.ndarray], outputs: Sequence[str],
                    timeout_s: float | None, priority: int) -> tuple[str, str, dict[str, np.ndarray]]:
        """The engine's answer to one request: (model name, version, outputs); its ServingError otherwise."""
        if self.gone or self._frames is None:
            raise Unavailable(f"the server's engine process is gone ({self.gone or 'not connected'})")
        placed: list[int] = []
        entries = []
        for name, array in inputs.items():
            array = np.ascontiguousarray(array)
            offset = self.arena.alloc(array.nbytes)
            if offset is None:
                for block in placed:
                    self.arena.free(block)
                raise Overloaded(f"this front end holds {self.arena.held >> 20} MiB of requests in flight in its "
                                 f"shared memory, its limit is {self.arena.size >> 20} MiB (--max-queue-bytes-mb); "
                                 "retry later")
            placed.append(offset)
            self.inputs.write(offset, array)
            entries.append([name, array.dtype.str, list(array.shape), offset])
        self._next_id += 1
        request_id = self._next_id
        answer = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (answer, placed)
        self._frames.send({"op": "infer", "id": request_id, "model": model, "version": version,
                                   "inputs": entries, "outputs": list(outputs),
                                   "timeout": None if timeout_s is None else float(timeout_s),
                                   "priority": int(priority)})
        header, payload = await answer  # cancelled with the client's call: the reader still frees the blocks
        if not header["ok"]:
            raise error_from(header)
        result: dict[str, np.ndarray] = {}
        freed = []
        for name, dtype, shape, offset in header["outputs"]:
            if offset >= 0:
                result[name] = np.array(self.outputs.view(offset, np.dtype(dtype), tuple(shape)))
                freed.append(offset)
            else:
                start = -1 - offset
                result[name] = np.ndarray(tuple(shape), np.dtype(dtype), payload, start)
        if freed:
            self._frames.free(freed)
        return header["model"], header["version"], result

    async def _read(self, reader: asyncio.StreamReader) -> None:
        frames = FrameReader(reader)
        try:
            while True:
                for header, payload in await frames.frames():
                    answer, placed = self._pending.pop(header["id"])
                    for block in placed:  # the engine is done with the inputs
                        self.arena.free(block)
                    if not answer.done():
                        answer.set_result((header, payload))
                    elif header.get("ok"):  # the client gave up: its outputs are not read
                        offsets = [entry[3] for entry in header["outputs"] if entry[3] >= 0]
                        if offsets and self._frames is not None:
                            self._frames.free(offsets)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            self.gone = f"its channel closed: {type(exc).__name__}"
        except Exception as exc:  # noqa: BLE001 - a broken frame: no answer can be trusted after it
            log.exception("engine channel broke")
            self.gone = f"{type(exc).__name__}: {exc}"
        for answer, _ in self._pending.values():
            if not answer.done():
                answer.set_exception(Unavailable(f"the server's engine process is gone ({self.gone})"))
        self._pending.clear()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()
        self.inputs.unlink()
        self.outputs.unlink()
