"""The cut pieces are run at awkward batch sizes before a plan is written, against the original model.

A piece that only works at the sizes it was traced at (a ``squeeze()`` that drops the
batch dim of a 1-item batch, a size baked into a reshape) would otherwise be found by
the server's warm-up or by a lone 1-item request. Here it is refused at partition
time, naming the size and the reason. For an ONNX model (``check_onnx_pieces``) the
original is the .onnx file under ONNX Runtime, and the pieces are host.onnx and dense.onnx.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree

from sixfold.models.signature import DENSE, INDICES, LENGTHS
from sixfold.partitioner.cut.graph_cut import SplitGraph
from sixfold.partitioner.placement.strategy import PlanError

__all__ = ["CHECK_SIZES", "PieceCheckError", "check_pieces", "check_onnx_pieces", "jagged_request"]

CHECK_SIZES = (1, 2, 3, 7, 64)
"""Item counts every piece must answer: the smallest batches, odd ones, and a large one."""

ExampleFn = Callable[[int], dict[str, torch.Tensor]]
Piece = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


class PieceCheckError(PlanError):
    """A piece (or the model itself) fails or disagrees with the model at one request size."""


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:400]}"


def jagged_request(example: ExampleFn, items: int = 7) -> dict[str, torch.Tensor]:
    """A jagged request with empty bags: ``items`` items, pooling 0, 1 or 2 per (item, table), id 0 (valid anywhere)."""
    base = example(items)
    tables = base[LENGTHS].shape[1]
    lengths = (torch.arange(items * tables, dtype=torch.int64).reshape(items, tables) % 3).to(base[LENGTHS].dtype)
    lengths[0] = 0  # one item with every bag empty
    ids = torch.zeros(int(lengths.sum()), dtype=base[INDICES].dtype)
    return {DENSE: base[DENSE], LENGTHS: lengths, INDICES: ids}


def _run(fn: Callable[[], object]) -> list[torch.Tensor]:
    with torch.no_grad():  # NOTE: not inference_mode: its tensors refuse the in-place ops some pieces run
        return [t for t in pytree.tree_leaves(fn()) if isinstance(t, torch.Tensor)]


def _compare(what: str, heads: Sequence[str], got: Sequence[torch.Tensor], want: Sequence[torch.Tensor],
             items: int, rtol: float, atol: float) -> str | None:
    for name, g, w in zip(heads, got, want):
        g, w = torch.as_tensor(g), torch.as_tensor(w)
        if list(g.shape) != list(w.shape):
            return f"{what} gives {name!r} {list(g.shape)}, the model {list(w.shape)}"
        if not g.shape or g.shape[0] != items:
            return f"{what} gives {name!r} {list(g.shape)}: not item-major ([{items}, ...])"
        if g.is_floating_point() and not torch.allclose(g.float(), w.float(), rtol=rtol, atol=atol, equal_nan=True):
            return f"{what} gives {name!r} up to {float((g.float() - w.float()).abs().max()):.3g} off the model's"
        if not g.is_floating_point() and not torch.equal(g, w):
            return f"{what} gives {name!r} values that differ from the model's"
    return None


def onnx_piece(onnx_bytes: bytes, input_names: Sequence[str], output_names: Sequence[str]) -> Piece:
    """The exported card ONNX as a piece, run by onnxruntime as a card backend would run it."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    session = ort.InferenceSession(io.BytesIO(onnx_bytes).getvalue(), options, providers=["CPUExecutionProvider"])
    feeds = [i.name for i in session.get_inputs()]

    def run(env: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = session.run(list(output_names), {n: np.ascontiguousarray(env[n].numpy()) for n in feeds})
        return {n: torch.from_numpy(np.asarray(o)) for n, o in zip(output_names, out)}

    del input_names
    return run


def check_pieces(reference: Callable[..., object], split: SplitGraph, heads: Sequence[str], example: ExampleFn,
                 cards: dict[str, Piece], *, sizes: Sequence[int] = CHECK_SIZES,
                 rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    """Run the host piece and each card piece at every size (and a jagged request with empty bags) against
    ``reference`` (the original model); raise PieceCheckError naming the size and the reason.

    ``cards``: name -> function from the dense inputs (model inputs and host outputs) to the outputs.
    Returns the requests checked, as words. A jagged request the model itself cannot take (a one-hot
    model's fixed id count) is skipped; a size the model itself cannot take is refused, since the
    server would be asked for it.
    """
    requests: list[tuple[str, int, dict[str, torch.Tensor]]] = [
        (f"{n}-item request", n, example(n)) for n in sizes]
    jagged = jagged_request(example)
    try:
        jagged_want = _run(lambda: reference(jagged[DENSE], jagged[LENGTHS], jagged[INDICES]))
        requests.append(("7-item jagged request with empty bags", 7, jagged))
    except Exception:  # noqa: BLE001 - the model takes a fixed id count per item: jagged traffic is not its
        jagged_want = None
    wants = []
    for what, items, request in requests:
        if request is jagged:
            wants.append(jagged_want)
            continue
        try:
            wants.append(_run(lambda: reference(request[DENSE], request[LENGTHS], request[INDICES])))
        except Exception as exc:  # noqa: BLE001 - the reason goes in the refusal
            raise PieceCheckError(f"the model itself fails on a {what}: {_why(exc)}. The server is asked for "
                                  "any batch size from 1 up; make the model run at every size "
                                  "(a squeeze() or a size baked into a reshape drops or pins the batch dim)"
                                  ) from None
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    trailing = [list(w.shape[1:]) for w in wants[largest]]
    checked = []
    for (what, items, request), want in zip(requests, wants):
        _check_item_major(what, items, heads, want, trailing)
        try:
            boundary = _run(lambda: split.host(*[request[n] for n in split.host_inputs]))
        except Exception as exc:  # noqa: BLE001
            raise PieceCheckError(f"the host piece fails on a {what}: {_why(exc)}") from None
        env = {**request, **dict(zip(split.boundary, boundary))}
        for card, piece in cards.items():
            try:
                with torch.no_grad():
                    out = piece(env)
            except Exception as exc:  # noqa: BLE001
                raise PieceCheckError(f"the card piece {card!r} fails on a {what}: {_why(exc)}") from None
            why = _compare(f"the card piece {card!r}", heads, [out[h] for h in heads], want, items, rtol, atol)
            if why:
                raise PieceCheckError(f"on a {what}, {why}")
        checked.append(what)
    return checked


NumpyExampleFn = Callable[[int], dict[str, np.ndarray]]


def _ort_session(model: object) -> object:
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    options.log_severity_level = 4  # failures are reported in the refusal, not logged
    data = model if isinstance(model, bytes) else model.SerializeToString()  # type: ignore[attr-defined]
    return ort.InferenceSession(data, sess_options=options, providers=["CPUExecutionProvider"])


def check_onnx_pieces(original: object, host: object, dense: object, *, host_inputs: Sequence[str],
                      boundary: Sequence[str], dense_inputs: Sequence[str], heads: Sequence[str],
                      example: NumpyExampleFn, sizes: Sequence[int] = CHECK_SIZES,
                      rtol: float = 1e-4, atol: float = 1e-5) -> list[str]:
    """``check_pieces`` for ONNX: host.onnx then dense.onnx against the original model, all under ONNX Runtime.

    ``original``, ``host``, ``dense``: ONNX models (``onnx.ModelProto`` or serialized bytes).
    ``example(n)``: a canonical n-item request as numpy arrays. Raises PieceCheckError naming the
    size and the reason; returns the requests checked, as words.
    """
    reference, host_session, dense_session = (_ort_session(m) for m in (original, host, dense))
    requests = [(f"{n}-item request", n, example(n)) for n in sizes]
    as_torch = lambda n: {k: torch.from_numpy(v) for k, v in example(n).items()}  # noqa: E731
    jagged = {k: v.numpy() for k, v in jagged_request(as_torch).items()}
    try:
        jagged_want = reference.run(list(heads), jagged)  # type: ignore[attr-defined]
        requests.append(("7-item jagged request with empty bags", 7, jagged))
    except Exception:  # noqa: BLE001 - the model takes a fixed id count per item: jagged traffic is not its
        jagged_want = None
    wants = []
    for what, items, request in requests:
        if request is jagged:
            wants.append([np.asarray(w) for w in jagged_want])
            continue
        try:
            wants.append([np.asarray(w) for w in reference.run(list(heads), request)])  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - the reason goes in the refusal
            raise PieceCheckError(f"the model itself fails on a {what}: {_why(exc)}. The server is asked for "
                                  "any batch size from 1 up; make the model run at every size (a squeeze() or "
                                  "a size baked into a reshape drops or pins the batch dim)") from None
    largest = max(range(len(sizes)), key=lambda i: sizes[i])
    trailing = [list(w.shape[1:]) for w in wants[largest]]
    checked = []
    for (what, items, request), want in zip(requests, wants):
        _check_item_major(what, items, heads, want, trailing)
        try:
            crossing = host_session.run(list(boundary), {n: request[n] for n in host_inputs})  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001
            raise PieceCheckError(f"the host piece (host.onnx) fails on a {what}: {_why(exc)}") from None
        env = {**request, **dict(zip(boundary, crossing))}
        try:
            got = dense_session.run(list(heads), {n: env[n] for n in dense_inputs})  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001
            raise PieceCheckError(f"the card piece (dense.onnx) fails on a {what}: {_why(exc)}") from None
        why = _compare("the card piece (dense.onnx)", heads, [torch.from_numpy(np.asarray(g)) for g in got],
                       [torch.from_numpy(w) for w in want], items, rtol, atol)
        if why:
            raise PieceCheckError(f"on a {what}, {why}")
        checked.append(what)
    return checked


def _check_item_major(what: str, items: int, heads, want, trailing) -> None:
    """PieceCheckError when the model's own answer to a ``what`` of ``items`` items is not item-major in every head."""
    bad = next((f"{h!r} {list(w.shape)}, not {[items, *rest]}" for h, w, rest in zip(heads, want, trailing)
                if list(w.shape) != [items, *rest]), None)
    if bad:
        raise PieceCheckError(f"the model itself answers a {what} with {bad}: every output must be item-major "
                              "at every batch size (a squeeze() drops the batch dim of a 1-item batch: "
                              "squeeze(-1) keeps it)")
