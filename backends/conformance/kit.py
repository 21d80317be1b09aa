"""The conformance checks and their runner.

Every check drives the backend through the same calls the server makes
(``supports``, ``load``, ``infer``, ``memory_bytes``, ``close``) and compares
with ONNX Runtime. Every call into the backend runs under a timeout, on a
thread the kit can abandon, so a backend that hangs fails a check instead of
hanging the kit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from sixfold.backends.api import Arrays, Backend, CardRef, DoesNotFit, Executable
from sixfold.backends.memory import format_bytes
from sixfold.backends.spec import DeviceSpec
from sixfold.backends.spec_catalog import load_spec
from sixfold.backends.conformance.cases import DEFAULT_MODELS, Case, Reference, builtin_cases
from sixfold.backends.conformance.report import CheckResult, ConformanceReport

__all__ = ["CHECKS", "run_conformance", "run_conformance_async", "CheckFailed", "rows_per_item"]

CHECKS: tuple[str, ...] = ("load", "memory", "outputs", "items", "concurrency", "bad-input", "does-not-fit",
                           "close", "op")
"""Every check, in the order they run on each case. "load" always runs: the others need it. "op" runs
on the one-node op cases (``sixfold.backends.conformance.ops``: every ONNX op use of the zoo's dense
partitions), which run only "load" and "op"; the model cases run the rest."""

T = TypeVar("T")


class CheckFailed(AssertionError):
    """A check found the backend wrong; the message is the table's detail."""


class Hung(CheckFailed):
    """A call into the backend did not return within the timeout."""


class _Context:
    """What the checks of one case share: the backend, the case, devices, the timeout, loaded executables."""

    def __init__(self, backend: Backend, case: Case, spec: DeviceSpec, timeout_s: float, atol: float,
                 report: ConformanceReport) -> None:
        self.backend, self.case, self.spec = backend, case, spec
        self.timeout_s, self.atol, self.report = timeout_s, atol, report
        self.main: Executable | None = None
        self._devices = 0
        self.max_error: float | None = None
        """The largest |answer - onnxruntime| the current check compared (None: it compared no numbers)."""
        self._error_lock = threading.Lock()

    def _seen(self, error: float) -> None:
        with self._error_lock:  # the concurrency check compares on several threads
            self.max_error = error if self.max_error is None else max(self.max_error, error)

    def card(self, **changes: Any) -> tuple[CardRef, DeviceSpec]:
        """The next card (index 0, 1, ...) and its DeviceSpec named ``SPEC/cardK``: each load is its own
        physical card, named as the server names them (``CardRef``)."""
        card = CardRef(self._devices, self.spec.name)
        self._devices += 1
        return card, dataclasses.replace(self.spec, name=card.device_name, **changes)

    def call(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` on an abandonable thread, within the timeout; its exception is re-raised here."""
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed back to the caller
                box["error"] = exc

        thread = threading.Thread(target=target, daemon=True, name=f"conformance-{what}")
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self.report.hung = True
            raise Hung(f"{what} did not return within {self.timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box["value"]

    async def infer(self, exe: Executable, feed: Mapping[str, np.ndarray], what: str) -> Arrays:
        try:
            return await asyncio.wait_for(exe.infer(feed), self.timeout_s)
        except asyncio.TimeoutError:
            self.report.hung = True
            raise Hung(f"{what}: no answer and no error within {self.timeout_s:g} s") from None

    def load(self, **device_changes: Any) -> Executable:
        """Load the case's artifact on the next card, the artifact labelled with that card as serving labels it."""
        card, device = self.card(**device_changes)
        artifact = self.case.artifact.for_card(card)
        return self.call(lambda: self.backend.load(artifact, device), f"load on {device.name}")

    def close(self, exe: Executable) -> None:
        self.call(exe.close, f"close() of {exe.device.name}")

    def compare(self, rows: int, outputs: Any) -> str | None:
        """Why ``outputs`` for batch ``rows`` differ from ONNX Runtime's, or None when they agree."""
        expected = self.case.expected[rows]
        if not isinstance(outputs, Mapping):
            return f"batch {rows}: returned {type(outputs).__name__}, expected a dict of arrays"
        for name, want in expected.items():
            if name not in outputs:
                return f"batch {rows}: output {name!r} missing; got {sorted(outputs)}"
            got = np.asarray(outputs[name])
            if got.shape != want.shape:
                return f"batch {rows}: {name} shape {got.shape}, expected {want.shape}"
            if got.dtype != want.dtype:
                return f"batch {rows}: {name} dtype {got.dtype}, expected {want.dtype}"
            diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
            if diff.size:
                both_nan = np.isnan(got.astype(np.float64)) & np.isnan(want.astype(np.float64))
                self._seen(float(np.max(np.where(both_nan, 0.0, np.where(np.isnan(diff), np.inf, diff)))))
            if not np.allclose(got, want, rtol=0.0, atol=self.atol, equal_nan=True):
                worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(diff), np.inf, diff))), diff.shape)
                return (f"batch {rows}: {name} differs from onnxruntime by up to {np.nanmax(diff):.3g} "
                        f"(atol {self.atol:g}) at {tuple(int(i) for i in worst)}: got {got[worst]!r}, "
                        f"expected {want[worst]!r}")
        return None

    def max_diff(self, rows: int, outputs: Mapping[str, np.ndarray]) -> float:
        return max(float(np.max(np.abs(np.asarray(outputs[n], np.float64) - want.astype(np.float64)), initial=0.0))
                   for n, want in self.case.expected[rows].items())


def _spread(sizes: Sequence[int], count: int = 10) -> list[int]:
    """Up to ``count`` batch sizes from ``sizes``: small ones, Fibonacci-ish ones, and the largest."""
    picks = [s for s in (1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233) if s in sizes][: count - 1]
    return sorted({*picks, max(sizes)})


def _ranges(sizes: list[int]) -> str:
    """[1, 2, 3, 7, 9, 10] -> "1-3, 7, 9-10"."""
    parts, start = [], None
    for i, s in enumerate(sizes):
        if start is None:
            start = s
        if i + 1 == len(sizes) or sizes[i + 1] != s + 1:
            parts.append(f"{start}" if start == s else f"{start}-{s}")
            start = None
    return ", ".join(parts)


# -- the checks; each returns its pass detail or raises CheckFailed ---------------------------------


async def check_load(ctx: _Context) -> str:
    art = ctx.case.artifact
    if not ctx.backend.supports(art):
        raise CheckFailed(f"supports() is False for the {art.format} partition {art.name}; "
                          f"backend formats: {', '.join(ctx.backend.formats)}")
    t0 = time.perf_counter()
    ctx.main = ctx.load()
    if not isinstance(ctx.main, Executable):
        got = type(ctx.main).__name__
        ctx.main = None
        raise CheckFailed(f"load() returned {got}, not a sixfold.backends.api.Executable")
    return (f"{art.format} partition, {len(art.input_names)} inputs, {format_bytes(art.param_bytes)} "
            f"weights, loaded in {time.perf_counter() - t0:.2f}s")


async def check_memory(ctx: _Context) -> str:
    exe = ctx.main
    assert exe is not None
    used = ctx.call(exe.memory_bytes, "memory_bytes()")
    if isinstance(used, bool) or not isinstance(used, (int, np.integer)):
        raise CheckFailed(f"memory_bytes() returned {used!r} ({type(used).__name__}), expected an int")
    if used <= 0:
        raise CheckFailed(f"memory_bytes() returned {used}; a loaded partition holds device memory (> 0)")
    return f"memory_bytes() = {int(used)} ({format_bytes(int(used))}; weights {format_bytes(ctx.case.artifact.param_bytes)})"


async def check_outputs(ctx: _Context) -> str:
    exe = ctx.main
    assert exe is not None
    wrong: list[int] = []
    first = ""
    worst = 0.0
    for rows in ctx.case.batch_sizes:
        try:
            out = await ctx.infer(exe, ctx.case.feeds[rows], f"batch {rows}")
        except Hung:
            raise
        except Exception as exc:
            wrong.append(rows)
            first = first or f"batch {rows}: raised {type(exc).__name__}: {exc}"
            continue
        why = ctx.compare(rows, out)
        if why:
            wrong.append(rows)
            first = first or why
        else:
            worst = max(worst, ctx.max_diff(rows, out))
    sizes = ctx.case.batch_sizes
    if wrong:
        raise CheckFailed(f"{len(wrong)} of {len(sizes)} batch sizes wrong ({_ranges(wrong)}); first: {first}")
    return f"batch sizes 1..{max(sizes)} equal onnxruntime (max |diff| {worst:.1e}, atol {ctx.atol:g})"


def rows_per_item(case: Case) -> tuple[dict[str, int], dict[str, int]]:
    """Rows of dim 0 per item of every input and output of ``case`` (the tensor contract, read off its feeds).

    Dim 0 of every card tensor is items x k, k fixed per tensor and item-major:
    ``dense_features`` [N, D] has k = 1, ``host_embedding_bag`` [N * T, dim]
    has k = T (rows i*T .. i*T + T - 1 are item i's tables), ``scores`` [N, 1]
    has k = 1. CheckFailed when a feed or an answer breaks that.
    """
    sizes = case.batch_sizes
    first = sizes[0]

    def per(by_size: Mapping[int, Arrays], kind: str) -> dict[str, int]:
        k: dict[str, int] = {}
        for name, array in by_size[first].items():
            if np.ndim(array) == 0 or array.shape[0] % first:
                raise CheckFailed(f"case {case.name}: {kind} {name} has shape {np.shape(array)} for {first} items; "
                                  f"dim 0 must be a whole number of rows per item")
            k[name] = array.shape[0] // first
        for rows in sizes:
            for name, array in by_size[rows].items():
                if array.shape[0] != rows * k[name]:
                    raise CheckFailed(f"case {case.name}: {kind} {name} has {array.shape[0]} rows for {rows} items, "
                                      f"not {k[name]} per item")
        return k

    return per(case.feeds, "input"), per(case.expected, "output")


async def check_items(ctx: _Context) -> str:
    """The tensor contract: a batch split at item boundaries (k rows per item per tensor) and rejoined is the batch.

    The server does exactly this when it spreads a batch over cards, and
    concatenates requests the same way, so a backend must treat each item's
    rows independently of the others, whatever k each input has.
    """
    exe = ctx.main
    assert exe is not None
    art = ctx.case.artifact
    whole = [n for n in (*art.input_names, *art.output_names) if n in art.layouts and not art.layouts[n].per_item]
    if whole:  # as the server does: a batch is split only where every layout gives rows per item
        return (f"not split: {', '.join(whole)} {'has' if len(whole) == 1 else 'have'} no fixed rows per item "
                "(ragged or unknown layout); the server sends this partition whole batches only")
    k_in, k_out = rows_per_item(ctx.case)
    layout = ", ".join(f"{n} {k} row{'s' if k != 1 else ''}" for n, k in k_in.items())
    sizes = [s for s in ctx.case.batch_sizes if s >= 3]
    if not sizes:
        return f"rows per item: {layout}; batches under 3 items: nothing to split"
    rows = max(s for s in sizes if s <= 13) if min(sizes) <= 13 else min(sizes)
    cuts = sorted({1, rows // 2, rows})
    bounds = list(zip([0, *cuts[:-1]], cuts))
    feed = ctx.case.feeds[rows]
    parts: list[Arrays] = []
    for a, b in bounds:
        piece = {n: feed[n][a * k_in[n]:b * k_in[n]] for n in feed}
        try:
            out = await ctx.infer(exe, piece, f"items {a}..{b - 1} of a {rows}-item batch")
        except Hung:
            raise
        except Exception as exc:
            raise CheckFailed(f"items {a}..{b - 1} of batch {rows} ({layout} per item): raised "
                              f"{type(exc).__name__}: {exc}") from None
        if not isinstance(out, Mapping):
            raise CheckFailed(f"items {a}..{b - 1}: returned {type(out).__name__}, expected a dict of arrays")
        for name, k in k_out.items():
            got = np.shape(out.get(name)) if name in out else None
            if got is None or not got or got[0] != (b - a) * k:
                raise CheckFailed(f"items {a}..{b - 1} ({b - a} items; inputs {layout} per item): output {name} "
                                  f"has shape {got}, expected {(b - a) * k} rows on dim 0")
        parts.append(out)
    joined = {name: np.concatenate([np.asarray(p[name]) for p in parts]) for name in k_out}
    if why := ctx.compare(rows, joined):
        raise CheckFailed(f"batch {rows} split at items {cuts[:-1]} ({layout} per item) and rejoined differs from "
                          f"the whole: {why}")
    return (f"rows per item: {layout}; batch {rows} split at items {', '.join(map(str, cuts[:-1]))} and "
            f"rejoined equals the whole")


async def check_concurrency(ctx: _Context, executables: int = 3, per_executable: int = 6) -> str:
    """Threads calling ``run`` on separate executables; asyncio tasks calling ``infer`` on each, interleaved."""
    sizes = _spread(ctx.case.batch_sizes)
    extra: list[Executable] = []
    try:
        for _ in range(executables - 1):
            extra.append(ctx.load())
        exes = [e for e in (ctx.main, *extra) if e is not None]
        # Threads: one per executable, all released at once, each walking the sizes in its own order.
        errors: list[str] = []
        barrier = threading.Barrier(len(exes))

        def walk(i: int, exe: Executable) -> None:
            barrier.wait()
            order = sizes[i % len(sizes):] + sizes[: i % len(sizes)]
            for rows in (order if i % 2 == 0 else order[::-1]):
                try:
                    why = ctx.compare(rows, exe.run(ctx.case.feeds[rows]))
                except Exception as exc:
                    why = f"batch {rows}: raised {type(exc).__name__}: {exc}"
                if why:
                    errors.append(f"thread {i} ({exe.device.name}): {why}")

        threads = [threading.Thread(target=walk, args=(i, e), daemon=True, name=f"conformance-walk{i}")
                   for i, e in enumerate(exes)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + ctx.timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            ctx.report.hung = True
            raise Hung(f"{len(exes)} threads calling run() on separate executables did not finish "
                       f"within {ctx.timeout_s:g} s")
        if errors:
            raise CheckFailed(f"{len(errors)} wrong answers from threads on {len(exes)} executables; first: {errors[0]}")
        # asyncio: several batches queued at once on each executable, all executables at once.
        jobs: list[tuple[Executable, int]] = [(e, sizes[(i + k) % len(sizes)])
                                              for k in range(per_executable) for i, e in enumerate(exes)]

        async def one(exe: Executable, rows: int) -> str | None:
            try:
                return ctx.compare(rows, await exe.infer(ctx.case.feeds[rows]))
            except Exception as exc:
                return f"batch {rows}: raised {type(exc).__name__}: {exc}"

        try:
            whys = await asyncio.wait_for(asyncio.gather(*(one(e, r) for e, r in jobs)), ctx.timeout_s)
        except asyncio.TimeoutError:
            ctx.report.hung = True
            raise Hung(f"{len(jobs)} concurrent infer() calls on {len(exes)} executables did not finish "
                       f"within {ctx.timeout_s:g} s") from None
        bad = [w for w in whys if w]
        if bad:
            raise CheckFailed(f"{len(bad)} of {len(jobs)} concurrent infer() answers wrong; first: {bad[0]}")
        return (f"{len(exes)} threads x {len(sizes)} run() calls and {len(jobs)} concurrent infer() calls "
                f"({per_executable} queued per executable) all correct")
    finally:
        for exe in extra:
            try:
                ctx.close(exe)
            except Exception:  # a failing close is the close check's business
                pass


def _bad_feeds(case: Case) -> list[tuple[str, Arrays, bool]]:
    """(what, feed, a correct answer is acceptable) for inputs a backend must refuse."""
    art = case.artifact
    rows = min(4, max(case.batch_sizes))
    good = case.feeds[rows]
    variants: list[tuple[str, Arrays, bool]] = []
    first = art.input_names[0]
    variants.append((f"missing input {first!r}", {n: a for n, a in good.items() if n != first}, False))
    wide = next((n for n in art.input_names if good[n].ndim >= 2 and good[n].dtype.kind == "f"), None)
    if wide is not None:
        a = good[wide]
        padded = np.concatenate([a, np.ones((*a.shape[:-1], 3), a.dtype)], axis=-1)
        variants.append((f"{wide} {a.shape[-1] + 3} wide instead of {a.shape[-1]}", {**good, wide: padded}, False))
        variants.append((f"{wide} as float64", {**good, wide: a.astype(np.float64)}, True))
    others = [n for n in art.input_names if n != first]
    if others and rows > 1:
        fewer = case.feeds[rows - 1]
        variants.append((f"{first} for {rows} rows but {others[0]} for {rows - 1}",
                         {**good, others[0]: fewer[others[0]]}, False))
    return variants


async def check_bad_input(ctx: _Context) -> str:
    """Bad inputs raise (within the timeout); the executable then still answers a good batch."""
    exe = ctx.load()
    abandoned = False
    try:
        problems: list[str] = []
        tried: list[str] = []
        rows = min(4, max(ctx.case.batch_sizes))
        reference = Reference(ctx.case.artifact)
        for what, feed, correct_ok in _bad_feeds(ctx.case):
            if not reference.refuses(feed):
                continue
            tried.append(what)
            try:
                out = await ctx.infer(exe, feed, what)
            except Hung as exc:
                abandoned = True
                raise CheckFailed(f"hung on bad input: {exc}") from None
            except Exception:
                continue
            if correct_ok and ctx.compare(rows, out) is None:
                continue
            shapes = {k: getattr(v, "shape", None) for k, v in out.items()} if isinstance(out, Mapping) else out
            problems.append(f"{what}: returned {shapes} instead of raising")
        if problems:
            raise CheckFailed(f"{len(problems)} of {len(tried)} bad inputs answered; first: {problems[0]}")
        after = await ctx.infer(exe, ctx.case.feeds[rows], "a good batch after bad ones")
        if why := ctx.compare(rows, after):
            raise CheckFailed(f"after the bad inputs, a good batch is wrong: {why}")
        return f"raised on {len(tried)} bad inputs ({'; '.join(tried)}), then answered a good batch correctly"
    finally:
        if not abandoned:
            ctx.close(exe)


_NUMBER = re.compile(r"\d")


async def check_does_not_fit(ctx: _Context) -> str:
    art = ctx.case.artifact
    memory = max(1, art.param_bytes // 4)
    try:
        exe = ctx.load(memory_bytes=memory)
    except DoesNotFit as exc:
        message = str(exc)
        if len(_NUMBER.findall(message)) < 2:
            raise CheckFailed(f"DoesNotFit raised, but its message quotes no sizes: {message!r}") from None
        return f"DoesNotFit: {message}"
    except Hung:
        raise
    except Exception as exc:
        raise CheckFailed(f"raised {type(exc).__name__} instead of DoesNotFit on a device with "
                          f"{memory} B for {art.param_bytes} B of weights: {exc}") from None
    ctx.close(exe)
    raise CheckFailed(f"loaded a partition with {format_bytes(art.param_bytes)} of weights on a device with "
                      f"{format_bytes(memory)} of memory; load() must raise DoesNotFit")


async def check_close(ctx: _Context) -> str:
    exe = ctx.main
    assert exe is not None
    ctx.main = None
    ctx.close(exe)
    try:
        ctx.close(exe)
    except Hung:
        raise
    except Exception as exc:
        raise CheckFailed(f"a second close() raised {type(exc).__name__}: {exc} (close must be idempotent)") from None
    rows = min(ctx.case.batch_sizes)
    try:
        out = await ctx.infer(exe, ctx.case.feeds[rows], "infer() after close()")
    except Hung:
        raise
    except Exception as exc:
        return f"close() twice without error; infer() after close raised {type(exc).__name__}"
    finally:
        try:
            ctx.close(exe)  # the infer may have started a new worker thread
        except Exception:
            pass
    raise CheckFailed(f"infer() after close() answered ({type(out).__name__}) instead of raising")


_CHECK_FNS: dict[str, Callable[[_Context], Awaitable[str]]] = {
    "load": check_load, "memory": check_memory, "outputs": check_outputs, "items": check_items,
    "concurrency": check_concurrency,
    "bad-input": check_bad_input, "does-not-fit": check_does_not_fit, "close": check_close,
    "op": check_outputs,  # a one-node model of one op use: the same comparison, at the case's tolerance
}
_NEEDS_MAIN = {"memory", "outputs", "items", "concurrency", "close", "op"}


# -- the runner ---------------------------------------------------------------------------------------


def _backend(backend: str | Backend, options: Mapping[str, Any]) -> tuple[Backend, str]:
    if isinstance(backend, Backend):
        if options:
            raise ValueError("options are for a backend given by name; configure an instance yourself")
        return backend, getattr(backend, "name", type(backend).__name__)
    from sixfold.backends.registry import get_backend
    return get_backend(backend, **options), backend


async def _run_case(backend: Backend, case: Case, spec: DeviceSpec, checks: Sequence[str], timeout_s: float,
                    atol: float, report: ConformanceReport) -> None:
    if case.notes.get("atol"):
        atol = max(atol, float(case.notes["atol"]))
    ctx = _Context(backend, case, spec, timeout_s, atol, report)
    is_op = bool(case.notes.get("op"))
    checks = [c for c in checks if (c == "op") == is_op]
    art = case.artifact
    if art.dtype != "fp32" and not backend.supports(art):
        # A precision the backend declines is never sent to it in serving (the planner asks supports() first,
        # and keeps that partition on the host); fp32 it must take.
        for name in ("load", *[c for c in checks if c != "load"]):
            report.results.append(CheckResult(case.name, name, "declined", 0.0,
                                              f"supports() is False for {art.dtype} (the {art.format} "
                                              f"partition {art.name}); a plan of that precision is refused at load on "
                                              "this backend, naming the formats it takes"))
        return
    try:
        for name in ("load", *[c for c in checks if c != "load"]):
            if name in _NEEDS_MAIN and ctx.main is None:
                report.results.append(CheckResult(case.name, name, "skip", 0.0, "not run: load failed"))
                continue
            t0 = time.perf_counter()
            ctx.max_error = None
            try:
                detail = await _CHECK_FNS[name](ctx)
                outcome = "pass"
            except CheckFailed as exc:
                detail, outcome = str(exc), "fail"
            except Exception as exc:
                detail, outcome = f"raised {type(exc).__name__}: {exc}", "fail"
            compared = ctx.max_error is not None
            report.results.append(CheckResult(case.name, name, outcome, time.perf_counter() - t0, detail,  # type: ignore[arg-type]
                                              atol=ctx.atol if compared else None, max_error=ctx.max_error))
    finally:
        if ctx.main is not None:
            try:
                ctx.close(ctx.main)
            except Exception:
                pass


async def run_conformance_async(backend: str | Backend, *, models: Iterable[str] = DEFAULT_MODELS,
                                cases: Iterable[Case] | None = None, max_batch: int = 64, max_rows: int = 200,
                                card_spec: str | DeviceSpec = "m2-card", options: Mapping[str, Any] | None = None,
                                checks: Iterable[str] | None = None, timeout_s: float = 10.0,
                                atol: float = 1e-4, seed: int = 0, ops: bool = True,
                                repository: str | Path | None = None) -> ConformanceReport:
    """``run_conformance`` for callers already on an event loop."""
    options = dict(options or {})
    checks = list(checks) if checks is not None else list(CHECKS)
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {', '.join(unknown)}; known: {', '.join(CHECKS)}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    instance, name = _backend(backend, options)
    spec = card_spec if isinstance(card_spec, DeviceSpec) else load_spec(card_spec)
    if cases is not None and repository is not None:
        raise ValueError("give cases or a repository, not both")
    if repository is not None:
        from sixfold.backends.conformance.repository import repository_cases
        cases = repository_cases(repository, max_batch=max_batch, seed=seed)
    case_list = list(cases) if cases is not None else builtin_cases(
        list(models), max_batch=max_batch, max_rows=max_rows, seed=seed)
    if cases is None and ops and "op" in checks:
        from sixfold.backends.conformance.ops import op_cases
        case_list += op_cases(seed)
    report = ConformanceReport(backend=name, options=options, device=spec.name)
    for case in case_list:
        await _run_case(instance, case, spec, [c for c in CHECKS if c in checks], timeout_s, atol, report)
    return report


def run_conformance(backend: str | Backend, **kwargs: Any) -> ConformanceReport:
    """Check ``backend`` (a registered name, or an instance) against ONNX Runtime; see the package docstring.

    Keyword arguments: ``models`` (zoo names, default rm2 and dlrm-mlperf),
    ``cases`` (your own ``Case`` list instead), ``max_batch`` (64: batch sizes
    1..max_batch), ``max_rows`` (200: rows per embedding table when building
    the models), ``card_spec`` (device spec name, path or DeviceSpec; default
    m2-card), ``options`` (backend options, for a name), ``checks`` (a subset
    of CHECKS), ``timeout_s`` (10: per call into the backend), ``atol`` (1e-4),
    ``seed``, ``ops`` (True: also run every ONNX op use of the zoo's dense
    partitions as a one-node model, check "op"), ``repository`` (a model
    repository folder: every version's dense partitions instead of the zoo's,
    ``sixfold.backends.conformance.repository``). Never raises for a wrong
    backend: the report says what failed.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_conformance_async(backend, **kwargs))
    # NOTE: called from inside a running loop (a notebook, an async test): run on a fresh loop elsewhere.
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(run_conformance_async(backend, **kwargs))
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=target, name="conformance")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
