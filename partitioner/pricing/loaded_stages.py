"""A lone query's stages timed on what the server really loaded, at start, cached by plan and machine.

Pricing an emulated card from a 512-wide calibration graph scaled by FLOPs missed what sixfold-serve served on
the 2-core development VM by 0.66x (dlrm-mlperf, 100 items): a real dense partition's narrow first and last
layers and its interaction op run slower per FLOP than the calibration graph, and its split parts share the
cores differently. The host stage's per-id fit missed small rm2 queries by 0.65x. So the server times its own
loaded partitions once, at load, in a second or two:

- ``dense``: a lone ``rows``-item query's card stage, split as the router splits it (``parts(rows)`` equal
  parts, each on its own thread as nice as a card worker, all on the card's real session at once): the wall
  time until the last part is done, at ``PRICE_ROWS``;
- ``alone`` and ``sharing``: one part's time alone at a few sizes, and how much longer ``k`` parts at once take
  (what the simulator needs to price parts of batches that overlap);
- ``host``: the host stage's real lookups of this model's tables at a few sizes.

The figures are cached by the plan's fingerprint (``plan_fingerprint``: the model, its dense partition's shape,
the tables, the cards and the split) and the machine (``stage_timing_file``); a cache hit costs nothing, and
``sixfold-simulate`` reads the same file for the same plan. Each figure is the median of a few tries, as the
served figures it predicts are medians on a host that other processes share.
"""

from __future__ import annotations

from sixfold.backends.host.native import write_json_atomic
import hashlib
import json
import os
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["StageTiming", "plan_fingerprint", "stage_timing_file", "load_stage_timing", "save_stage_timing",
           "time_dense", "time_host", "TRIES", "ALONE_ROWS", "HOST_ROWS"]

TRIES = 7
"""Each figure is the median of at least this many tries."""
MAX_TRIES, SMALL_CALLS_S = 41, 0.03
"""Quick calls are tried more: until their tries add up to 30 ms, at most 41."""
ALONE_ROWS: tuple[int, ...] = (1, 16, 64, 128, 256)
"""Part sizes one part is timed alone at (a split part of a 1,024-item query is 171 rows on six cards)."""
HOST_ROWS: tuple[int, ...] = (1, 16, 64, 128, 256, 512, 1024)
"""Sizes the host stage is timed at (linear between and beyond)."""
DISTINCT_QUERIES = 4
"""Different queries the host stage is timed on per size (2 above 256 items): each try looks up other rows."""
INLINE_BELOW_S = 1e-3
"""sixfold-serve's default ``max_inline_s``: a host stage quicker than this runs inline, on one intra-op thread."""
BUDGET_S = 20.0
"""No timing runs on past this many seconds: a figure not reached by then is left out (its price falls back)."""


@dataclass(frozen=True)
class StageTiming:
    """What the loaded partitions took here; (rows, seconds) points, ``sharing[k-1]``: slowdown of k parts."""

    fingerprint: str
    dense: tuple[tuple[int, float], ...] = ()
    alone: tuple[tuple[int, float], ...] = ()
    sharing: tuple[float, ...] = (1.0,)
    host: tuple[tuple[int, float], ...] = ()
    source: str = field(default="")
    measure_s: float = 0.0
    """Seconds the timing took (the start-up cost of a cache miss)."""

    def sharing_factor(self, k: int) -> float:
        """Slowdown of each of ``k`` parts at once (beyond the measured ``k``: in proportion to the last)."""
        if k <= 1 or not self.sharing:
            return 1.0
        if k <= len(self.sharing):
            return max(1.0, self.sharing[k - 1])
        last = len(self.sharing)
        return max(1.0, self.sharing[-1] * k / last)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StageTiming":
        def points(key: str) -> tuple[tuple[int, float], ...]:
            return tuple((int(r), float(s)) for r, s in data.get(key, []))

        return cls(str(data["fingerprint"]), points("dense"), points("alone"),
                   tuple(float(s) for s in data.get("sharing", [1.0])), points("host"), str(data.get("source", "")),
                   float(data.get("measure_s", 0.0)))


def plan_fingerprint(model: str, dense: Any, tables: dict[str, Any], cards: int, min_split_rows: int,
                     splittable: bool) -> str:
    """What the timings depend on: the model, the dense partition's shape (``name``, ``flops_per_item``,
    ``param_bytes``, inputs and outputs; not its weights), the tables' rows, pooling and width, the cards and
    the split. The server and the simulator plan the same model alike, so they share it."""
    key = {"model": model, "dense": [getattr(dense, "name", ""), round(float(getattr(dense, "flops_per_item", 0.0))),
                                     int(getattr(dense, "param_bytes", 0))],
           "tables": [list(map(int, tables.get("rows") or [])), list(map(int, tables.get("pooling") or [])),
                      int(tables.get("dim") or 0)],
           "cards": int(cards), "min_split_rows": int(min_split_rows), "splittable": bool(splittable)}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def stage_timing_file(fingerprint: str) -> Path:
    """This machine's timings of the plan ``fingerprint`` (beside ``--host-spec auto``'s cache)."""
    from sixfold.backends.host.calibrate import cache_dir, machine_key
    return cache_dir() / f"stages-{machine_key()}-{fingerprint}.json"


def load_stage_timing(fingerprint: str, path: Path | None = None) -> StageTiming | None:
    """The cached timings of ``fingerprint``; None when there are none, they are damaged, or another plan's."""
    try:
        timing = StageTiming.from_dict(json.loads((path or stage_timing_file(fingerprint)).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return timing if timing.fingerprint == fingerprint else None


def save_stage_timing(timing: StageTiming, path: Path | None = None) -> Path:
    """Write ``timing`` atomically (a concurrent reader sees a whole file)."""
    return write_json_atomic(path or stage_timing_file(timing.fingerprint), timing.to_dict())


def _at_once(run: Callable[[int], Any], sizes: Sequence[int], nice: int | None) -> float:
    """Wall seconds from the first ``run(size)`` starting to the last one done, each size on a thread of its own,
    released together (each thread stamps its own start and end: the releasing thread may wake late)."""
    start = threading.Barrier(len(sizes))
    errors: list[BaseException] = []
    stamps: list[tuple[float, float]] = []

    def worker(size: int) -> None:
        if nice is not None:
            from sixfold.backends.os_threads import lower_this_thread
            lower_this_thread(nice)
        start.wait()
        t0 = time.perf_counter()
        try:
            run(size)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)
        stamps.append((t0, time.perf_counter()))

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    if len(stamps) != len(sizes):
        raise RuntimeError(f"stage timing: {len(sizes) - len(stamps)} of {len(sizes)} parts did not finish in 60 s")
    return max(e for _, e in stamps) - min(s for s, _ in stamps)


def _typical(fn: Callable[[], float], deadline: float) -> float | None:
    """The median of ``TRIES`` runs of ``fn`` (more, up to ``MAX_TRIES``, while they add up to less than
    ``SMALL_CALLS_S``: a sub-millisecond call meets a busy host's noise; fewer past ``deadline``): what a lone
    query meets on this host as it is, other processes included, as the served median does."""
    took: list[float] = []
    while len(took) < TRIES or (sum(took) < SMALL_CALLS_S and len(took) < MAX_TRIES):
        if time.perf_counter() > deadline and took:
            break
        took.append(fn())
    return statistics.median(took) if took else None


def time_dense(run: Callable[[int], Any], parts: Callable[[int], int], price_rows: Sequence[int], *,
               max_sharing: int, nice: int | None = None, budget_s: float = BUDGET_S
               ) -> tuple[tuple[tuple[int, float], ...], tuple[tuple[int, float], ...], tuple[float, ...]]:
    """(dense, alone, sharing): ``run(rows)`` computes a ``rows``-row batch on the real partition; ``parts(rows)``
    is how many equal parts the router splits a lone ``rows``-item query into."""
    deadline = time.perf_counter() + budget_s
    for rows in sorted(dense_sizes(parts, price_rows, max_sharing)):  # warm-up: a size's first call allocates
        run(rows)
    dense = []
    for rows in price_rows:
        k = max(1, parts(rows))
        sizes = [len(chunk) for chunk in _split(rows, k)]
        took = _typical(lambda: _at_once(run, sizes, nice), deadline)
        if took is None:
            break
        dense.append((int(rows), took))
    alone = []
    for rows in ALONE_ROWS:
        took = _typical(lambda: _at_once(run, [rows], nice), deadline)
        alone.append((rows, took))
    part = ALONE_ROWS[-2]
    base = dict(alone)[part]
    sharing = [1.0]
    for k in range(2, max_sharing + 1):
        if time.perf_counter() > deadline:
            break
        took = _typical(lambda: _at_once(run, [part] * k, nice), deadline)
        sharing.append(max(1.0, took / base))
    return tuple(dense), tuple(alone), tuple(sharing)


def _split(rows: int, k: int) -> list[range]:
    """``rows`` in ``k`` near-equal parts, as the router splits them (the larger parts first)."""
    step, extra = divmod(rows, k)
    out, at = [], 0
    for i in range(k):
        n = step + (1 if i < extra else 0)
        out.append(range(at, at + n))
        at += n
    return [r for r in out if len(r)]


def time_host(run: Callable[[int], Any], rows: Sequence[int] = HOST_ROWS, *, budget_s: float = BUDGET_S,
              inline_below_s: float = INLINE_BELOW_S) -> tuple[tuple[int, float], ...]:
    """(rows, seconds) of the host stage: ``run(rows)`` makes a real ``rows``-item query and returns a callable that
    looks up its ids (the request is made before the clock starts).

    Timed as the server runs the stage (``sixfold.server.execution.runtime.StageRunner``): a lookup that takes
    under ``inline_below_s`` with one intra-op thread runs inline on the event loop with one thread; a longer
    one on a worker thread with torch's default threads. Each on a thread of its own, as there."""
    deadline = time.perf_counter() + budget_s
    # a few different queries per size, taken in turn: one query's rows looked up again are in the CPU's caches,
    # which a served query's are not (rm2 at 16 items: 0.5 ms the same query again, 2 ms as served)
    prepared = [(int(n), [run(n) for _ in range(DISTINCT_QUERIES if n <= 256 else 2)]) for n in rows]
    return _on_thread(lambda: _time_lookups(prepared, deadline, inline_below_s))


def _time_lookups(prepared: list[tuple[int, list[Callable[[], Any]]]], deadline: float,
                  inline_below_s: float) -> tuple[tuple[int, float], ...]:
    import torch

    def typical(queries: list[Callable[[], Any]]) -> float:
        queries[0]()  # warm-up at this size and thread count: the first calls pay one-off costs
        took = []
        for i in range(TRIES):
            lookups = queries[(i + 1) % len(queries)]
            t0 = time.perf_counter()
            lookups()
            took.append(time.perf_counter() - t0)
        return statistics.median(took)

    for _, queries in prepared:  # one pass over every query first: a freshly loaded table's pages are faulted in
        for lookups in queries:  # by the first lookups that touch them, which a served model has long done
            lookups()
    workers = torch.get_num_threads()
    out = []
    for n, queries in prepared:
        if time.perf_counter() > deadline and len(out) >= 2:
            break
        torch.set_num_threads(1)
        try:
            took = typical(queries)
        finally:
            torch.set_num_threads(workers)
        if took >= inline_below_s and workers > 1:
            took = min(took, _on_thread(lambda: typical(queries)))  # a worker thread keeps the default
        out.append((n, float(took)))
    return tuple(out)


def _on_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a fresh thread (its own torch thread count), its result or its exception."""
    out: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=120)
    if errors:
        raise errors[0]
    if not out:
        raise RuntimeError("stage timing: the host stage's timing did not finish in 120 s")
    return out[0]


def dense_sizes(parts: Callable[[int], int], price_rows: Sequence[int], max_sharing: int) -> set[int]:
    """Every part size ``time_dense`` runs (the feeds to make before the clock starts)."""
    sizes = {len(chunk) for rows in price_rows for chunk in _split(rows, max(1, parts(rows)))}
    return sizes | set(ALONE_ROWS) | {1}


def time_loaded(model: str, plan: Any, host: Any, card: Any, cards: Any, request: Callable[[int], dict[str, Any]],
                price_rows: Sequence[int], *, nice: int | None = None) -> StageTiming:
    """Time a served model's loaded host executable and one card's executable (``run``: the functional
    computation on the card's real session) on real requests (``request(items)``: the model's input tensors);
    ``cards``: an ``EmulatedCards`` that says how a lone query is split."""
    t0 = time.perf_counter()
    dense_inputs = tuple(card.artifact.input_names)
    feeds: dict[int, dict[str, Any]] = {}
    for n in sorted(dense_sizes(cards.parts, price_rows, cards.cards)):
        arrays = request(n)
        arrays.update(host.run({k: arrays[k] for k in host.artifact.input_names}))
        feeds[n] = {k: arrays[k] for k in dense_inputs}
    dense, alone, sharing = time_dense(lambda rows: card.run(feeds[rows]), cards.parts, price_rows,
                                       max_sharing=cards.cards, nice=nice)

    def lookups(n: int) -> Callable[[], Any]:
        arrays = request(n)
        feed = {k: arrays[k] for k in host.artifact.input_names}
        return lambda: host.run(feed)

    host_points = time_host(lookups)
    from sixfold.backends.host.calibrate import machine_key
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    took = time.perf_counter() - t0
    fingerprint = plan_fingerprint(model, _dense_partition(plan), plan.tables or {}, cards.cards, cards.min_split_rows,
                                   cards.splittable)
    return StageTiming(fingerprint, dense, alone, sharing, host_points,
                       f"timed at load {time.strftime('%Y-%m-%d %H:%M')} on {machine_key()}, load average "
                       f"{load:.1f}, {took:.1f} s", took)


def _dense_partition(plan: Any) -> Any:
    """The plan's dense partition (None when it has several stages or none)."""
    dense = [p for p in plan.partitions if p.kind == "dense"]
    return dense[0] if len(dense) == 1 else None


def served_stage_timing(model: str, plan: Any, runtime: Any, cards: Any, price_rows: Sequence[int]
                        ) -> StageTiming | None:
    """The cached timings of this served plan on this machine, or timed now (said on stderr) and cached; None
    when the model's requests cannot be made here (not a built-in model) or the runtime has no host stage."""
    from sixfold import models

    host = getattr(runtime, "host", None)
    dense = _dense_partition(plan)
    if model not in models.names() or host is None or dense is None or not plan.tables:
        return None
    fingerprint = plan_fingerprint(model, dense, plan.tables, cards.cards, cards.min_split_rows, cards.splittable)
    found = load_stage_timing(fingerprint)
    if found is not None:
        return found
    import sys

    config = models.get_config(model)
    tables = plan.tables
    gen = models.RequestGenerator(tuple(int(r) for r in tables["rows"]), config.dense_dim,
                                  tuple(int(p) for p in tables["pooling"]), zipf=_zipf(tables.get("zipf"), config.zipf),
                                  fixed_pooling=bool(tables.get("fixed_pooling", False)))
    from sixfold.backends.builtin.simcard import DEFAULT_WORKER_NICE
    print(f"sixfold: timing {model}'s loaded host stage and dense partition once for this plan; cached in "
          f"{stage_timing_file(fingerprint)}", file=sys.stderr)
    timing = time_loaded(model, plan, host, runtime.cards[0], cards, gen.make, price_rows, nice=DEFAULT_WORKER_NICE)
    save_stage_timing(timing)
    return timing


def timed_lone_host(lone: Any, timing: StageTiming) -> Any:
    """``lone`` (a ``ServedLatency``) with its host term as the loaded host stage ran here."""
    import dataclasses

    if len(timing.host) < 2:
        return lone
    from sixfold.partitioner.pricing.served_latency import _interpolate
    host = tuple((r, _interpolate(timing.host, r)) for r, _ in lone.host)
    return dataclasses.replace(lone, host=host, host_source=f"timed at load here ({timing.source})")


def _zipf(planned: Any, default: Any) -> Any:
    """The plan's zipf exponent(s) as ``RequestGenerator`` takes them (one float or a tuple)."""
    if planned is None:
        return default
    return tuple(float(z) for z in planned) if isinstance(planned, (list, tuple)) else float(planned)
