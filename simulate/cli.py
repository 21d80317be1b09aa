"""sixfold-simulate: capacity planning on a virtual clock, with sixfold's own batcher and runtime.

    sixfold-simulate run      --model M --cards 6 --card-spec m2-card --qps 1000,2000,4000
    sixfold-simulate max-qps  --model M --cards 1-16 --card-spec m2-card --card-spec gpu-l4 --p99-ms 60
    sixfold-simulate capacity --model M --card-spec m2-card --card-spec gpu-l4 --qps 20000 --p99-ms 60

Scheduling flags are sixfold-serve's own (same names, same defaults). See docs/simulate.md.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sixfold import models

from sixfold.simulate.capacity import fewest_cards, latency_curve, max_rate
from sixfold.simulate.engine import ServingSettings
from sixfold.simulate.platform import build_platform
from sixfold.simulate.report import (cards_table, max_rate_table, plot_cards, plot_curves, plot_max_rates, result_dict, runs_table,
                     write_json)
from sixfold.simulate.traffic import Traffic, parse_traffic
from sixfold.simulate.vloop import SimulationDeadlock, SimulationLimit

__all__ = ["main", "SERVE_FLAGS"]

SERVE_FLAGS = ("max_batch_rows", "no_wait_rows", "max_queue_delay_us", "max_queue_size", "default_timeout_us", "max_queue_work_ms",
               "max_queue_bytes_mb", "preferred_batch_rows", "max_inflight_batches", "priority_levels",
               "default_priority_level", "max_card_batch_rows", "min_split_rows", "card_scheduling", "host_dense_max_rows",
               "card_timeout_multiple", "card_timeout_floor_ms", "no_all_in_dispatch")
"""sixfold-serve's scheduling flags, taken from its own parser (names, defaults and help)."""


def _add_serve_flags(group: argparse._ArgumentGroup) -> None:
    from sixfold.server.cli import _parser as serve_parser
    # NOTE: copied from sixfold-serve's parser, so a flag means here what it means there.
    for action in serve_parser()._actions:
        if action.dest in SERVE_FLAGS:
            kwargs: dict[str, Any] = {"dest": action.dest, "default": action.default, "help": action.help}
            if isinstance(action, argparse._AppendAction):
                kwargs.update(action="append", type=action.type, metavar=action.metavar, default=[])
            elif isinstance(action, argparse._StoreTrueAction):
                kwargs.update(action="store_true")
            else:
                kwargs.update(type=action.type, metavar=action.metavar, choices=action.choices)
            group.add_argument(*action.option_strings, **kwargs)


def serving_settings(args: argparse.Namespace) -> ServingSettings:
    """The scheduling settings sixfold-serve would build from the same flags."""
    from sixfold.partitioner.cli import UsageError
    from sixfold.server.cli import apply_sla
    from sixfold.server.scheduling.batcher import BatchingConfig
    # NOTE: the work bound and the queue timeout not given: sixfold-serve's defaults (its --p99-ms is not taken
    # here: this command's --p99-ms is the searched bound, not the served SLA)
    args = argparse.Namespace(**{**vars(args), "p99_ms": None})
    try:
        apply_sla(args)
    except UsageError as exc:
        raise ValueError(str(exc)) from None
    try:
        extra = {"no_wait_rows": args.no_wait_rows} if hasattr(args, "no_wait_rows") else {}
        extra["all_in_dispatch"] = not getattr(args, "no_all_in_dispatch", False)
        batching = BatchingConfig(max_batch_rows=args.max_batch_rows, **extra,
                                  max_queue_delay_microseconds=args.max_queue_delay_us,
                                  max_queue_size=args.max_queue_size,
                                  default_timeout_microseconds=args.default_timeout_us,
                                  max_queue_work_ms=args.max_queue_work_ms,
                                  max_queue_bytes=args.max_queue_bytes_mb << 20,
                                  preferred_batch_rows=tuple(args.preferred_batch_rows),
                                  max_inflight_batches=args.max_inflight_batches,
                                  priority_levels=args.priority_levels,
                                  default_priority_level=args.default_priority_level or args.priority_levels)
    except ValueError as exc:
        raise ValueError(f"scheduling flags: {exc}") from None
    return ServingSettings(batching=batching, max_card_rows=args.max_card_batch_rows or None,
                           min_split_rows=args.min_split_rows, card_scheduling=args.card_scheduling,
                           host_dense_max_rows=args.host_dense_max_rows,
                           card_timeout_multiple=args.card_timeout_multiple,
                           card_timeout_floor_s=args.card_timeout_floor_ms / 1e3)


def _numbers(text: str, what: str, kind: type = float) -> list:
    """"1000,2000" or "1-16" (integers) -> a list; ValueError naming ``what``."""
    out: list = []
    try:
        for part in filter(None, (p.strip() for p in text.split(","))):
            if kind is int and "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                if a > b:
                    raise ValueError
                out.extend(range(a, b + 1))
            else:
                out.append(kind(part))
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a list of numbers (e.g. 1000,2000{' or 1-16' if kind is int else ''})"
                         ) from None
    if not out:
        raise ValueError(f"{what}: no value given")
    bad = [v for v in out if not v > 0]
    if bad:
        raise ValueError(f"{what} must be > 0, got {', '.join(str(b) for b in bad)}")
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sixfold-simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    commands = {
        "run": "simulate the platform at one or more offered rates: p50/p99/p99.9, queueing, utilisation",
        "max-qps": "the highest rate meeting --p99-ms, for each platform (lists of cards, specs, precisions)",
        "capacity": "the fewest cards (and their watts) meeting --qps at --p99-ms, per card spec and precision",
    }
    for name, text in commands.items():
        c = sub.add_parser(name, help=text, description=text)
        plat = c.add_argument_group("platform")
        plat.add_argument("--model", required=True, help=f"built-in model: {', '.join(models.names())}")
        if name != "capacity":
            plat.add_argument("--cards", default="6", help="cards: N, a list (1,2,4) or a range (1-16); default 6")
        else:
            plat.add_argument("--max-cards", type=int, default=16, help="largest card count tried (default 16)")
        plat.add_argument("--card-spec", action="append", default=None, metavar="SPEC",
                          help="card spec name or JSON file (repeatable; default m2-card)")
        plat.add_argument("--host-spec", default=None,
                          help="host spec name or JSON file (default auto: this machine, calibrated on first "
                               "use and cached; host-cpu is a generic server host)")
        plat.add_argument("--cpu-host", action="store_true",
                          help="price sixfold-serve --backend cpu's layout: the dense part on "
                               "one lane per usable core of this host, each priced as one core calibrated here; "
                               "cards default to the usable cores, and no --card-spec (docs/simulate.md)")
        plat.add_argument("--spec-only", action="store_true",
                          help="price the cards at their spec, a what-if of cards not bought yet (default with "
                               "--host-spec auto: as sixfold-serve emulates them on this host's cores, at the "
                               "speed the emulation reaches here, measured once and cached; docs/simulate.md)")
        plat.add_argument("--host-memory-gib", type=float, default=None,
                          help="host DRAM to plan with, GiB (default: the host spec's)")
        plat.add_argument("--max-rows", type=int, default=None,
                          help="cap every table at R rows for the host memory check (default: full size)")
        plat.add_argument("--table-precision", action="append", default=None,
                          help="fp32, fp16, int8 or int4 (repeatable; default fp32)")
        plat.add_argument("--dense-precision", action="append", default=None, help="fp32, fp16 or int8 (repeatable)")
        plat.add_argument("--per-request-us", type=float, default=None,
                          help="event-loop cost of one request (decode, validate, encode), us (default 60)")
        traffic = c.add_argument_group("traffic")
        if name == "run":
            traffic.add_argument("--qps", default=None,
                                 help="offered rate(s), queries/s, comma-separated (a --replay may omit it)")
        elif name == "capacity":
            traffic.add_argument("--qps", type=float, required=True, help="the rate to serve, queries/s")
        if name != "run":
            traffic.add_argument("--p99-ms", type=float, default=60.0, help="p99 latency bound (default 60)")
            traffic.add_argument("--max-error-rate", type=float, default=0.0,
                                 help="share of requests that may be refused or fail and still pass (default 0)")
        else:
            traffic.add_argument("--p99-ms", type=float, default=None, help="draw this bound on the plot")
        traffic.add_argument("--arrival", action="append", default=None,
                             help="poisson (default), constant, bursty[:on=S,off=S,factor=F], diurnal[...], "
                                  "trace:PATH (repeatable)")
        traffic.add_argument("--query-size", action="append", default=None,
                             help="mlperf (default), fixed:N, uniform:A-B, lognormal:MEAN,SIGMA, file:PATH "
                                  "(repeatable)")
        traffic.add_argument("--replay", help="a sixfold-loadgen --record file: its times, sizes and ids "
                                              "(scaled to --qps when given)")
        traffic.add_argument("--duration", type=float, default=10.0, help="measured seconds per run (virtual; default 10)")
        traffic.add_argument("--warmup", type=float, default=1.0, help="virtual seconds before measuring (default 1)")
        traffic.add_argument("--seed", type=int, default=0)
        traffic.add_argument("--jobs", type=int, default=1,
                             help="simulate each run's window in this many consecutive segments at once, one process "
                                  "each (time-parallel; segments overlap by 2 s; default 1)")
        _add_serve_flags(c.add_argument_group("scheduling (sixfold-serve's flags and defaults)"))
        out = c.add_argument_group("output")
        out.add_argument("--json", help="write the results as JSON here")
        out.add_argument("--plot", help="write a PNG plot here")
        out.add_argument("--quiet", action="store_true",
                         help="no progress (a bar on a terminal, else a line as each run starts)")
    return p


def _traffics(args: argparse.Namespace) -> list[Traffic]:
    if args.replay:
        if args.arrival or args.query_size:
            raise ValueError("--replay: give it alone, without --arrival or --query-size (the recording has both)")
        return [Traffic.from_recording(args.replay)]
    arrivals = args.arrival or ["poisson"]
    sizes = args.query_size or ["mlperf"]
    return [parse_traffic(a, s) for a, s in itertools.product(arrivals, sizes)]


def _cpu_host(args: argparse.Namespace, argv: list[str]) -> None:
    """--cpu-host: sixfold-serve's cpu layout (``sixfold.backends.cpu_layout``) as this command's cards and settings.

    Lanes take batches of any size (no --max-card-batch-rows), as served. sixfold-serve measures where a split
    across cores pays and prints it; here a batch is split only from --min-split-rows when that flag is given.
    """
    from sixfold.backends.cpu_layout import cpu_layout, core_spec_path

    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(f"{flag}=") for a in argv)

    if args.card_spec:
        raise ValueError(f"--cpu-host prices this host's cores; --card-spec {args.card_spec[0]} names cards: give one "
                         "or the other")
    layout = cpu_layout()
    args.card_spec = [str(core_spec_path())]
    if args.command == "capacity":
        args.max_cards = args.max_cards if given("--max-cards") else layout.cards
    elif not given("--cards"):
        args.cards = str(layout.cards)
    args.max_card_batch_rows = 0
    if not given("--min-split-rows"):
        args.min_split_rows = 0


def _host_spec(args: argparse.Namespace) -> str:
    return args.host_spec or "auto"


def _platform_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"host_spec": _host_spec(args), "max_rows": args.max_rows}
    if args.host_memory_gib is not None:
        kwargs["host_memory_bytes"] = int(args.host_memory_gib * 2**30)
    if args.per_request_us is not None:
        if args.per_request_us < 0:
            raise ValueError(f"--per-request-us must be >= 0, got {args.per_request_us:g}")
        kwargs["per_request_s"] = args.per_request_us / 1e6
    if _host_spec(args) == "auto":  # this host: its serving path as calibrated here (or the documented default)
        from sixfold.partitioner.pricing.served_latency import load_serving_path
        kwargs["serving_path"] = load_serving_path()
        from sixfold.partitioner.pricing.host_stage_fit import load_host_stage
        kwargs["host_stage_fit"] = load_host_stage()  # measured here by bench/unloaded_latency.py --calibrate
    kwargs["emulation"] = _emulation(args)
    return kwargs


def _emulation(args: argparse.Namespace) -> Any:
    """This host's emulated-card calibration when the cards are emulated here, as sixfold-serve --backend auto
    runs them (host spec auto, no --cpu-host, no accelerator backend, no --spec-only); else None. Sets
    ``args.cards_priced``: how the cards are priced, in words, for the output."""
    from sixfold.backends.cpu_layout import AUTO, resolve_layout

    if args.spec_only or args.cpu_host or _host_spec(args) != "auto" or resolve_layout(AUTO).name != "simcard":
        why = ("--spec-only" if args.spec_only else "--cpu-host: lanes are this host's cores" if args.cpu_host
               else f"--host-spec {args.host_spec}: another host" if _host_spec(args) != "auto"
               else "an accelerator backend reports a device here")
        args.cards_priced = f"cards priced at their spec ({why})" + (
            "; a what-if of cards not bought yet" if args.spec_only else "")
        return None
    from sixfold.backends.emulation_calibrate import auto_emulation
    cal = auto_emulation()
    args.cards_priced = (f"cards emulated on this host's cores, priced at the speed they reach here "
                         f"({cal.effective_cores:.1f} of {cal.usable_cores} cores shared; {cal.source}); "
                         "--spec-only prices them at their spec (cards not bought yet)")
    return cal


class _Bar:
    """Progress over the runs of a command (``note`` names the one starting): a rich bar on a terminal;
    elsewhere (a pipe, a file, CI) one plain line per run, flushed as it starts, so a long command is
    never silent; nothing with ``--quiet``. ``total`` is an estimate (searches stop when they know)."""

    def __init__(self, console: Console, total: int, quiet: bool) -> None:
        self.console = console
        self.plain = not quiet and not console.is_terminal
        self.progress = None if quiet or self.plain else Progress(
            TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} runs"),
            TimeElapsedColumn(), console=console, transient=True)
        self.task = None
        self.total = total
        self.runs = 0
        self.started = time.perf_counter()

    def __enter__(self) -> "_Bar":
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task("simulating", total=self.total)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def note(self, text: str) -> None:
        self.runs += 1
        if self.plain:
            self.console.print(f"simulating run {self.runs} (of about {max(self.total, self.runs)}): {text}; "
                               f"{time.perf_counter() - self.started:.0f} s so far", markup=False, highlight=False)
            self.console.file.flush()
        if self.progress is not None:
            task = self.progress.tasks[0]
            if task.completed >= task.total:
                self.progress.update(self.task, total=task.total + 1)
            self.progress.update(self.task, description=text, advance=1 if task.description != "simulating" else 0)


def _label(platform: Any, tp: str, dp: str, traffic: Traffic, combos: int) -> str:
    text = f"{platform.cards} x {platform.card_spec.name}"
    if (tp, dp) != ("fp32", "fp32"):
        text += f" {tp}/{dp}"
    return f"{text}, {traffic.label}"


def _run(args: argparse.Namespace, console: Console, settings: ServingSettings) -> dict[str, Any]:
    cards_list = _numbers(args.cards, "--cards", int)
    traffics = _traffics(args)
    rates = _numbers(args.qps, "--qps") if args.qps else [None]
    if rates == [None] and traffics[0].own_rate is None:
        raise ValueError("--qps is required (only a --replay or trace: arrivals bring a rate of their own)")
    kw = _platform_kwargs(args)
    combos = list(itertools.product(args.card_spec or ["m2-card"], cards_list, args.table_precision or ["fp32"],
                                    args.dense_precision or ["fp32"], traffics))
    curves, rows, payload = [], [], []
    with _Bar(console, len(combos) * len(rates), args.quiet) as bar:
        for spec, cards, tp, dp, traffic in combos:
            platform = build_platform(args.model, cards=cards, card_spec=spec, table_precision=tp,
                                      dense_precision=dp, **kw)
            label = _label(platform, tp, dp, traffic, len(combos))
            runs = latency_curve(platform, traffic, rates, duration_s=args.duration, warmup_s=args.warmup,
                                 settings=settings, seed=args.seed, progress=bar.note, jobs=args.jobs)
            curves.append((label, runs))
            rows.extend((label, r) for r in runs)
            payload.append({"platform": platform.describe(), "traffic": traffic.label,
                            "runs": [result_dict(r) for r in runs]})
    console.print(runs_table(rows, f"sixfold-simulate run: {args.model} (host {kw['host_spec']})"))
    if args.plot and any(r.rate for _, r in rows):
        console.print(f"plot: {plot_curves(curves, args.plot, args.p99_ms)}")
    return {"command": "run", "results": payload}


def _max_qps(args: argparse.Namespace, console: Console, settings: ServingSettings) -> dict[str, Any]:
    cards_list = _numbers(args.cards, "--cards", int)
    traffics = _traffics(args)
    kw = _platform_kwargs(args)
    combos = list(itertools.product(args.card_spec or ["m2-card"], cards_list, args.table_precision or ["fp32"],
                                    args.dense_precision or ["fp32"], traffics))
    rows, payload = [], []
    with _Bar(console, len(combos) * 8, args.quiet) as bar:
        for spec, cards, tp, dp, traffic in combos:
            platform = build_platform(args.model, cards=cards, card_spec=spec, table_precision=tp,
                                      dense_precision=dp, **kw)
            label = _label(platform, tp, dp, traffic, len(combos))
            m = max_rate(platform, traffic, args.p99_ms, duration_s=args.duration, warmup_s=args.warmup,
                         settings=settings, seed=args.seed, max_error_rate=args.max_error_rate, progress=bar.note,
                         jobs=args.jobs)
            rows.append((label, m))
            payload.append({"platform": platform.describe(), "traffic": traffic.label, "max_qps": m.max_qps,
                            "watts": platform.power_watts, "lone_query_ms": m.lone_ms,
                            "best": result_dict(m.best) if m.best else None,
                            "steps": [{"rate": s.rate, "passed": s.passed, "p99_ms": s.result.latency_ms["p99"],
                                       "errors": s.result.errors} for s in m.steps]})
    console.print(max_rate_table(rows, f"sixfold-simulate max-qps: {args.model} (host {kw['host_spec']}), "
                                       f"p99 <= {args.p99_ms:g} ms"))
    if args.plot:
        console.print(f"plot: {plot_max_rates(rows, args.plot)}")
    return {"command": "max-qps", "p99_ms": args.p99_ms, "results": payload}


def _capacity(args: argparse.Namespace, console: Console, settings: ServingSettings) -> dict[str, Any]:
    traffics = _traffics(args)
    kw = _platform_kwargs(args)
    combos = list(itertools.product(args.card_spec or ["m2-card"], args.table_precision or ["fp32"],
                                    args.dense_precision or ["fp32"], traffics))
    answers, payload = [], []
    with _Bar(console, len(combos) * 5, args.quiet) as bar:
        for spec, tp, dp, traffic in combos:
            a = fewest_cards(args.model, traffic, args.qps, args.p99_ms, card_spec=spec, table_precision=tp,
                             dense_precision=dp, max_cards=args.max_cards, duration_s=args.duration,
                             warmup_s=args.warmup, settings=settings, seed=args.seed,
                             max_error_rate=args.max_error_rate, progress=bar.note, jobs=args.jobs,
                             **{k: v for k, v in kw.items()})
            answers.append((traffic.label, a))
            payload.append({"card_spec": spec, "table_precision": tp, "dense_precision": dp, "traffic": traffic.label,
                            "cards": a.cards, "watts": a.watts, "reason": a.reason,
                            "result": result_dict(a.result) if a.result else None,
                            "tried": {c: {"p99_ms": r.latency_ms["p99"], "errors": r.errors, "passed": a.passed.get(c),
                                          "utilisation": r.utilisation} for c, r in sorted(a.tried.items())}})
    console.print(cards_table(answers, args.qps, args.p99_ms))
    if args.plot:
        console.print(f"plot: {plot_cards(answers, args.qps, args.p99_ms, args.plot)}")
    return {"command": "capacity", "qps": args.qps, "p99_ms": args.p99_ms, "results": payload}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 200)
    started = time.perf_counter()
    from sixfold.partitioner.cli import check_output_file, error_text
    try:
        for flag, path in (("--json", args.json), ("--plot", args.plot)):  # written after minutes of simulating
            if path:
                check_output_file(path, flag)
        if args.plot:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        if args.cpu_host:
            _cpu_host(args, sys.argv[1:] if argv is None else argv)
        settings = serving_settings(args)
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        command = {"run": _run, "max-qps": _max_qps, "capacity": _capacity}[args.command]
        payload = command(args, console, settings)
        if getattr(args, "cards_priced", None):
            console.print(args.cards_priced, markup=False)
            payload["cards_priced"] = args.cards_priced
    except (ValueError, OSError) as exc:  # ImpossibleTarget too: its message names the flag
        print(f"sixfold-simulate: {error_text(exc)}", file=sys.stderr)
        return 2
    except (SimulationLimit, SimulationDeadlock) as exc:
        print(f"sixfold-simulate: the simulation stopped: {exc}", file=sys.stderr)
        return 3
    wall = time.perf_counter() - started
    console.print(f"simulated in {wall:.1f} s of wall time", style="dim")
    if args.json:
        payload["wall_s"] = wall
        try:
            console.print(f"json: {write_json(args.json, payload)}")
        except OSError as exc:
            print(f"sixfold-simulate: --json {args.json}: {error_text(exc)}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
