"""Every command line in the docs' shell blocks works as written.

README.md's and docs/**/*.md's fenced ``bash``/``sh``/``shell``/``console`` blocks (not
docs/benchmarks/log.md, a historical log), line by line (joined across backslash continuations;
comments and shown output skipped):

- a sixfold command (``sixfold-serve``, ``sixfold-partition``, ``sixfold-loadgen``, ``sixfold-simulate``,
  ``sixfold-delta``, ``python -m sixfold...``; bare or ``.venv/bin/``) is parsed by that command's own
  argparse parser, through its ``main`` with ``ArgumentParser.parse_args`` stopped right after parsing
  (the CLIs stay untouched): a flag that does not exist or a bad choice fails, naming page and line;
- ``docker run ... sixfold ARGS`` is parsed as the image's ENTRYPOINT (sixfold-serve) would parse it;
- a benchmark or script (``python bench/x.py``, ``scripts/...``) must exist, and a Python one's flags are
  parsed by its own parser; ``make`` targets must exist in the Makefile; repository paths must exist;
- the cheap, self-contained lines run for real (RUN says which and why, PARSE_ONLY why the rest do not);
- every ``curl`` line runs against one live ``sixfold-serve`` (free ports put in for 8000/8001), with
  the rest of its console block (docs/http.md's ``python3 -c``/``sed``), and the output a console block
  shows is compared with what the server said.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import logging
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import numpy as np
import pytest

from tests.conftest import ServeProcess

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md")
                                     if p != ROOT / "docs" / "benchmarks" / "log.md")]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)")
VENV_BIN = Path(sys.executable).parent

# The sixfold commands and where their main lives ([project.scripts]; a test checks pyproject.toml agrees).
PROGRAMS = {"sixfold-serve": "sixfold.server.cli", "sixfold-partition": "sixfold.partitioner.cli",
            "sixfold-loadgen": "sixfold.loadgen.cli", "sixfold-simulate": "sixfold.simulate.cli",
            "sixfold-delta": "sixfold.server.deltas.cli"}
# ``python -m NAME``: the module whose main parses its command line.
MODULES = {"sixfold.backends.conformance": "sixfold.backends.conformance.cli", **{m: m for m in PROGRAMS.values()}}
REPO_DIRS = ("backends/", "bench/", "docker/", "docs/", "examples/", "loadgen/", "models/", "partitioner/",
             "scripts/", "server/", "simulate/", "tests/")

# --- Which lines run for real ------------------------------------------------------------------------------
# A line runs when its command (".venv/bin/" and "python3" spelt as bare names) starts with ``starts``;
# ``append`` is added to its argv (argparse: the last value of a flag wins). Every row must match a line.
SIM_CAP = ("--duration", "0.02", "--warmup", "0.01", "--quiet")
# NOTE: sixfold-simulate simulates 1 + 10 virtual seconds per run by default (10,000 q/s: 110,000 queries,
# a dozen runs per search); 0.01 + 0.02 s keeps each command to seconds, the work being planning.
SMALL = ("--max-rows", "500")
# NOTE: the pages' models are full size or 50,000 rows a table; 500 rows keeps each partition to seconds.


@dataclass(frozen=True)
class Run:
    page: str
    starts: str
    why: str
    append: tuple[str, ...] = ()
    process: bool = False  # a real process: sixfold-serve's main sets up the process (allocator, logging)


RUN = (
    Run("README.md", "sixfold-serve --list-backends", "prints the registered backends and exits", process=True),
    Run("README.md", "sixfold-simulate capacity", "a virtual clock: no server, no cards", SIM_CAP),
    Run("docs/simulate.md", "sixfold-simulate capacity", "a virtual clock: no server, no cards", SIM_CAP),
    Run("docs/simulate.md", "sixfold-simulate max-qps", "a virtual clock: no server, no cards", SIM_CAP),
    Run("docs/simulate.md", "sixfold-simulate run", "a virtual clock: no server, no cards", SIM_CAP),
    Run("docs/partition.md", "sixfold-partition --model rm2", "a zoo model into the test's folder", SMALL),
    Run("docs/model-repository.md", "sixfold-partition --model rm2", "a zoo model into the test's folder", SMALL),
    Run("docs/tiered-tables.md", "sixfold-partition tables build rm2", "a zoo model's tables, written in chunks",
        SMALL),
    Run("docs/tiered-tables.md", "sixfold-partition tables build dlrm-mlperf",
        "a zoo model's tables, int8 packed only", SMALL),
    Run("docs/tiered-tables.md", "sixfold-partition tiers repo/rm2/1/plan.json",
        "prices the tiers of the plan the build line wrote, with FILES' disk.json"),
    Run("docs/tiered-tables.md", "sixfold-partition --model rm2 --out repo/rm2/1 --table-memory 10% --table-memory 1G",
        "a zoo model priced with two table memories and FILES' disk.json", SMALL),
    Run("docs/tiered-tables.md", "sixfold-partition show repo/rm2/1", "prints the plan the lines above wrote"),
    Run("docs/deltas.md", "sixfold-delta make repo/rm2/1 staging/rm2-0600",
        "the live server's version against a copy with rows changed (the test writes staging/)"),
    Run("docs/deltas.md", "sixfold-delta make staging/rm2-0600 staging/rm2-0700", "the next delta, chained"),
    Run("docs/deltas.md", "sixfold-delta show deltas/0002", "checks and prints the delta the line above wrote"),
    Run("docs/deltas.md", "sixfold-delta apply", "applies deltas/0001 to the live server (explicit control, T)"),
    Run("docs/deltas.md", "sixfold-delta rollback", "rolls the live server back to sequence 0"),
    Run("docs/backends.md", "sixfold-partition --model rm2 --cards 3 --strategy pipeline",
        "a 3-stage pipeline of a zoo model into the test's repo/", SMALL),
    Run("docs/backends.md", "python -m sixfold.backends.conformance onnxruntime --repository repo",
        "the kit on every stage of the repository the line above wrote", ("--max-batch", "3")),
    Run("docs/backends.md", "sixfold-partition calibrate --card --backend onnxruntime",
        "measures onnxruntime as a card, at small sizes for 2 s", ("--seconds", "2", "--rows", "4,32",
                                                                    "--typical-rows", "32", "--width", "128")),
    Run("docs/backends.md", "sixfold-partition --model rm2 --cards 2 --card-spec card.json",
        "plans on the card.json the line above measured", SMALL),
)

# Why the other sixfold lines are parsed only: (page, or "*" for any; the command's start; why). First match.
PARSE_ONLY = (
    ("docs/vendor.md", "python -m sixfold.backends.conformance mycard --repository", "the reader's own backend and "
     "repository (docs/backends.md's line runs the kit on a repository with onnxruntime)"),
    ("docs/vendor.md", "sixfold-partition calibrate --card --backend mycard", "the reader's own backend "
     "(docs/backends.md's line measures onnxruntime)"),
    ("docs/vendor.md", "", "walked through by tests/backends/test_vendor_page.py, the example backend installed"),
    ("docs/bring-your-own-model.md", "sixfold-partition onehot.pt2", "step 6, run by "
     "tests/partitioner/test_cross_cut_examples.py (the .pt2 files are made by the page's Python)"),
    ("docs/bring-your-own-model.md", "sixfold-partition pooled.pt2", "step 6, run by "
     "tests/partitioner/test_cross_cut_examples.py (the .pt2 files are made by the page's Python)"),
    ("docs/bring-your-own-model.md", "sixfold-partition heads.pt2", "step 7, run by tests/server/test_two_heads.py "
     "(heads.pt2 is made by the page's Python)"),
    ("docs/bring-your-own-model.md", "sixfold-partition mixed.", "step 8, run by tests/server/test_user_model_examples.py "
     "(mixed.pt2 and mixed.onnx are made by the page's Python)"),
    ("docs/bring-your-own-model.md", "sixfold-partition torchrec_dlrm.pt2", "step 9, run by "
     "tests/server/test_torchrec_example.py where torchrec is installed (the page's Python makes the file)"),
    ("docs/bring-your-own-model.md", "", "walked through by tests/server/test_bring_your_own_model.py"),
    ("README.md", "python -m sixfold.backends.conformance mycard", "the reader's own backend (docs/vendor.md's "
     "walkthrough runs the kit on the example one)"),
    ("*", "sixfold-partition my_model", "the reader's own model file"),
    ("*", "sixfold-partition tables import", "the reader's own tables (a state dict or .npy folder)"),
    ("*", "sixfold-partition calibrate", "measures this host for 10 s, and a disk with --disk"),
    ("docs/tiered-tables.md", "sixfold-partition --model rm2 --out repo/rm2/1 --table-memory 10% --table-memory "
     "25%", "--measure calibrates this host for 3 s, then times each stage of the plan"),
    ("*", "sixfold-serve", "serves until stopped; the pages' curl lines run against one live server instead"),
    ("*", "sixfold-loadgen", "needs a server, and sends traffic for --duration seconds (30 to 180)"),
    ("docs/mlperf.md", "python bench/mlperf_peak.py", "two servers in turn, a minute of LoadGen per step: "
     "tens of minutes (tests/bench/test_mlperf_peak.py runs it on the tiny model)"),
    ("*", "python bench/", "a benchmark: minutes (its flags are parsed by its own parser)"),
)

# Placeholders put in before a line is parsed or run: (page, text on the page, what the test puts there).
PLACEHOLDERS = (
    # calibrate checks that --disk is a folder it may write in before it parses anything
    ("docs/tiered-tables.md", "--disk /data ", "--disk {cwd} "),
    # the server reads the delta the page's make line wrote (in the work folder, not /data)
    ("docs/deltas.md", "/data/deltas/", "{cwd}/deltas/"),
)
# Files a page's lines read that a parsed-only line (or the reader) would have made: the test makes them in the
# page's folder first (sixfold-partition tables/tiers/calibrate check their files before they parse).
FILES = (
    ("docs/tiered-tables.md", "disk.json", "calibrate --disk's output: the generic NVMe SSD's figures, not measured"),
    ("docs/tiered-tables.md", "weights.pt", "the reader's state dict (empty: tables import is parsed only)"),
    ("docs/tiered-tables.md", "tables_npy/", "the reader's folder of .npy tables (empty: parsed only)"),
)
# The live server's free ports stand in for the pages' defaults (REST 8000, gRPC 8001).
PORTS = (("localhost:8000", "{http}"), ("127.0.0.1:8000", "{http}"), ("127.0.0.1:8001", "{grpc}"))
CURL_PAGES = ("README.md", "docs/deltas.md", "docs/http.md", "docs/serving.md")  # a test checks no page is missed


# --- The pages' lines ---------------------------------------------------------------------------------------
@dataclass
class DocLine:
    page: str        # relative to the repository root
    lineno: int      # its first line on the page
    text: str        # joined across continuations, comment removed: what a shell runs
    lang: str
    block: int       # which shell block of the page
    output: list[str] = field(default_factory=list)  # console: the lines shown after it

    @property
    def where(self) -> str:
        return f"{self.page}:{self.lineno}"


def _strip_comment(text: str) -> str:
    """``text`` without a trailing shell comment (a # at the start or after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def _complete(text: str) -> bool:
    """No backslash continuation and no open quote."""
    if text.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:
        return False
    return True


def doc_lines(page: Path) -> list[DocLine]:
    """The command lines of ``page``'s shell blocks, in order."""
    rel = page.relative_to(ROOT).as_posix()
    out: list[DocLine] = []
    fence, lang, block, pending, start = None, "", -1, None, 0
    for n, raw in enumerate(page.read_text().splitlines(), 1):
        m = FENCE.match(raw)
        if fence is None:
            if m:
                fence, lang = m.group(1), m.group(2).lower()
                block += 1
            continue
        if raw.strip().startswith(fence) and not raw.strip().strip(fence[0]):
            fence = None
            continue
        if lang not in SHELL_LANGS:
            continue
        if pending is not None:  # a continuation (backslash, or a quote left open)
            pending = pending[:-1] + " " + raw.strip() if pending.rstrip().endswith("\\") else pending + "\n" + raw
        elif lang == "console":
            if not raw.startswith("$ "):
                if out and out[-1].page == rel and out[-1].block == block:
                    out[-1].output.append(raw)  # what the command printed
                continue
            pending, start = raw[2:], n
        else:
            if not raw.strip() or raw.lstrip().startswith("#"):
                continue
            pending, start = raw, n
        if _complete(pending):
            out.append(DocLine(rel, start, _strip_comment(pending.replace("\\\n", " ").strip()), lang, block))
            pending = None
    return out


def _tokens(text: str) -> list[str]:
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def _segments(text: str) -> list[list[str]]:
    """The simple commands of a line (split at | || && & ;), redirections dropped."""
    segments, current, skip = [], [], False
    for tok in _tokens(text):
        if skip:
            skip = False
        elif tok in ("|", "||", "&&", "&", ";", "|&"):
            segments.append(current)
            current = []
        elif tok in (">", ">>", "<", "2>", "&>"):
            skip = True
        else:
            current.append(tok)
    segments.append(current)
    return [s for s in segments if s]


def _bare(program: str) -> str:
    name = program.rsplit("/", 1)[-1]
    return "python" if re.fullmatch(r"python3?(\.\d+)?", name) else name


def _spelled(argv: list[str]) -> str:
    """A segment as RUN and PARSE_ONLY match it: bare program names, the rest as written."""
    return " ".join([_bare(argv[0]), *argv[1:]])


def _unbracket(argv: list[str]) -> list[str]:
    """``[--flag VALUE]`` (a usage line's optional part) parsed as if given."""
    return [a[1:] if a.startswith("[-") else a for a in (a[:-1] if a.endswith("]") else a for a in argv)]


@dataclass
class Invocation:
    line: DocLine
    spelled: str         # for RUN / PARSE_ONLY
    program: str         # what the errors say
    module: str          # where its main lives
    argv: list[str]
    kind: str            # "command" (a sixfold command) or "script"


def _invocations(line: DocLine) -> Iterator[Invocation]:
    for seg in _segments(line.text):
        while seg and re.fullmatch(r"[A-Za-z_]\w*=.*", seg[0]):  # VAR=value before the command
            seg = seg[1:]
        if not seg:
            continue
        name = _bare(seg[0])
        if name in PROGRAMS:
            yield Invocation(line, _spelled(seg), name, PROGRAMS[name], _unbracket(seg[1:]), "command")
        elif name == "python" and seg[1:2] == ["-m"] and len(seg) > 2 and seg[2].startswith("sixfold"):
            yield Invocation(line, _spelled(seg), f"python -m {seg[2]}", MODULES.get(seg[2], seg[2]),
                             _unbracket(seg[3:]), "command")
        elif name == "python" and len(seg) > 1 and seg[1].endswith(".py"):
            yield Invocation(line, _spelled(seg), seg[1], seg[1], _unbracket(seg[2:]), "script")


# --- Parsing with a command's own parser ----------------------------------------------------------------------
class _Parsed(BaseException):
    """Raised by ArgumentParser.parse_args once it parsed (a BaseException: no CLI catches it)."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parsing() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    # a page spells every flag in full: an abbreviation (argparse's allow_abbrev) breaks when a flag is added
    # (no _get_option_tuples: no prefixes, and no -xVALUE either, which no page uses)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
            mock.patch.object(argparse.ArgumentParser, "_get_option_tuples", lambda self, option_string: []):
        yield


def _main_of(inv: Invocation):
    if inv.kind == "script":
        path = ROOT / inv.module

        def main(argv: list[str]) -> Any:  # sys.path too: a benchmark puts the repository root first
            with mock.patch.object(sys, "argv", [str(path), *argv]), mock.patch.object(sys, "path", list(sys.path)):
                return runpy.run_path(str(path), run_name="__main__")
        return main
    if importlib.util.find_spec(inv.module) is None:
        raise LookupError(f"no module {inv.module}")
    return importlib.import_module(inv.module).main


def parse(inv: Invocation, capsys) -> str | None:
    """None when ``inv.argv`` parses with the command's own parser, else why not."""
    if inv.kind == "script" and not (ROOT / inv.module).is_file():
        return f"{inv.module}: no such file"
    try:
        main = _main_of(inv)
    except (LookupError, ImportError) as exc:
        return f"{inv.program}: {exc}"
    capsys.readouterr()
    try:
        with _stop_after_parsing():
            code = main(list(inv.argv))
    except _Parsed:
        return None
    except SystemExit as exc:
        said = capsys.readouterr()
        if exc.code in (0, None):  # --help and the like: parsed, printed and exited
            return None
        return f"{inv.program} does not parse it: {(said.err or said.out).strip()[-600:]}"
    said = capsys.readouterr()
    return f"{inv.program} stopped before parsing (exit {code}): {(said.err or said.out).strip()[-600:]}"


# --- The live server ----------------------------------------------------------------------------------------
@dataclass
class Live:
    site: Path   # its working folder: repo/rm2/1, and staging/ for docs/deltas.md
    grpc: str
    http: str


def _change_rows(version: Path, seed: int, tables: tuple[int, ...]) -> None:
    """Rewrite a tenth of some tables' rows in place, and plan.json's checksums (a retrained checkpoint)."""
    from sixfold.partitioner.tables.checksums import table_checksums
    rng = np.random.default_rng(seed)
    for t in tables:
        path = version / "tables" / f"table_{t:03d}.npy"
        a = np.load(path)
        ids = rng.choice(a.shape[0], a.shape[0] // 10, replace=False)
        a[ids] = rng.standard_normal((ids.shape[0], a.shape[1])).astype(np.float32)
        np.save(path, a)
    plan = json.loads((version / "plan.json").read_text())
    plan["tables"]["checksums"] = table_checksums(version / "tables")
    (version / "plan.json").write_text(json.dumps(plan))


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Iterator[Live]:
    """docs/http.md's server (rm2, 1,000 rows a table, 2 cards), served from a model repository in explicit
    model control with token T (docs/deltas.md's line), so that every page's curl lines run against one."""
    from sixfold.partitioner.cli import main as partition_main
    site = tmp_path_factory.mktemp("live")
    version = site / "repo" / "rm2" / "1"
    with contextlib.redirect_stdout(io.StringIO()) as plan:
        assert partition_main(["--model", "rm2", "--max-rows", "1000", "--cards", "2", "--out", str(version)]) == 0, \
            plan.getvalue()
    shutil.copytree(version, site / "staging" / "rm2-0600")  # docs/deltas.md's retrained checkpoints
    _change_rows(site / "staging" / "rm2-0600", 1, (0, 3, 5))
    shutil.copytree(site / "staging" / "rm2-0600", site / "staging" / "rm2-0700")
    _change_rows(site / "staging" / "rm2-0700", 2, (1, 3))
    process = ServeProcess("--model-repository", "repo", "--model-control-mode", "explicit", "--control-token", "T",
                           "--load-model", "rm2", "--grpc-port", "0", "--metrics-port", "0", cwd=site)
    try:
        assert process.url, process.output[-3000:]
        rest = re.search(r"REST http://([\d.]+:\d+)/v2", process.output)
        assert rest, process.output[-3000:]
        yield Live(site, process.url, rest.group(1))
    finally:
        process.stop()


# --- Output a console block shows ---------------------------------------------------------------------------
def _contained(shown: Any, said: Any) -> bool:
    """Everything the page shows is in the answer (objects: those keys; lists: those items, in order)."""
    if isinstance(shown, dict):
        return isinstance(said, dict) and all(k in said and _contained(v, said[k]) for k, v in shown.items())
    if isinstance(shown, list):
        if not isinstance(said, list):
            return False
        it = iter(said)
        return all(any(_contained(s, x) for x in it) for s in shown)
    return shown == said


def output_differs(shown: list[str], said: str) -> str | None:
    """None when ``said`` is what the page shows (a trailing ``...`` elides the rest), else how it differs."""
    expected, actual = "\n".join(shown).strip(), said.strip()
    if expected.endswith("..."):
        prefix = expected[:-3].rstrip().rstrip(",")
        return None if actual.startswith(prefix) else f"shows {expected!r}, said {actual[:400]!r}"
    code = re.fullmatch(r"(.*\S)\s+(\d{3})", expected, re.S)
    said_code = re.fullmatch(r"(.*\S)\s+(\d{3})", actual, re.S)
    if code and said_code:
        if code.group(2) != said_code.group(2):
            return f"shows status {code.group(2)}, said {said_code.group(2)}: {actual[:400]!r}"
        expected, actual = code.group(1), said_code.group(1)
    try:
        same = _contained(json.loads(expected), json.loads(actual))
    except ValueError:
        same = expected == actual
    return None if same else f"shows {expected[:400]!r}, said {actual[:400]!r}"


# --- Walking a page ------------------------------------------------------------------------------------------
def _run_row(inv: Invocation) -> Run | None:
    rows = [r for r in RUN if r.page == inv.line.page and inv.spelled.startswith(r.starts)]
    return rows[0] if rows else None


def _parse_only_why(inv: Invocation) -> str | None:
    for page, starts, why in PARSE_ONLY:
        if page in ("*", inv.line.page) and inv.spelled.startswith(starts):
            return why
    return None


def _put_in(line: DocLine, text: str, **values: str) -> str:
    for page, shown, instead in PLACEHOLDERS:
        if page == line.page:
            text = text.replace(shown, instead.format(**values))
    if "http" in values:
        for shown, instead in PORTS:
            text = text.replace(shown, instead.format(**values))
    return text


def _make_targets() -> set[str]:
    targets = set()
    for m in re.finditer(r"^([\w.-]+(?:[ \t]+[\w.-]+)*)[ \t]*:(?!=)", (ROOT / "Makefile").read_text(), re.M):
        targets.update(m.group(1).split())
    return targets


def _dockerfile_serve_argv(args: list[str]) -> list[str]:
    """What the image's sixfold-serve gets: its ENTRYPOINT's flags, then ``args`` (or CMD's when none)."""
    text = (ROOT / "docker" / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT\s+(\[.*\])", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD\s+(\[.*\])", text, re.M).group(1))
    assert entry[0] == "sixfold-serve", entry
    return entry[1:] + (args or cmd)


DOCKER_VALUE_OPTIONS = {"-p", "--publish", "-v", "--volume", "-e", "--env", "--name", "--network", "--gpus",
                        "--mount", "-w", "--workdir", "-u", "--user", "--shm-size", "--cpus", "-m", "--memory"}


def _docker_run_args(seg: list[str]) -> list[str] | None:
    """The arguments after the image of ``docker run ... sixfold ARGS``, else None."""
    if seg[:2] != ["docker", "run"]:
        return None
    it = iter(seg[2:])
    for tok in it:
        if tok in DOCKER_VALUE_OPTIONS:
            next(it, None)
        elif not tok.startswith("-"):
            return list(it) if tok.split(":")[0] == "sixfold" else None
    return None


def _unknown_program(seg: list[str]) -> str | None:
    """Why ``seg``'s program or ``python -m`` module is not there (renamed, or moved into sixfold.*), else None."""
    name = _bare(seg[0])
    if seg[0].startswith(".venv/bin/") and not (VENV_BIN / seg[0].rsplit("/", 1)[-1]).exists():
        return f"{seg[0]}: no such program in the venv"
    if name.startswith("sixfold") and name not in PROGRAMS:
        return f"{name}: not a sixfold command (they are {', '.join(PROGRAMS)})"
    if name == "python" and seg[1:2] == ["-m"] and len(seg) > 2:
        top = seg[2].split(".")[0]
        if top in ("backends", "loadgen", "models", "partitioner", "server", "simulate"):
            return f"python -m {seg[2]}: the package is sixfold.{seg[2]} (one import name)"
        if importlib.util.find_spec(top) is None:
            return f"python -m {seg[2]}: no such module"
    return None


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)


@dataclass
class Tally:
    found: int = 0
    parsed: int = 0
    run: int = 0
    checked: int = 0  # make targets and repository paths found


def walk(page: str, cwd: Path, capsys, live: Live | None) -> tuple[Tally, list[str]]:
    """Check every command line of ``page`` in order; (what was done, what failed, each naming its line)."""
    tally, errors = Tally(), []
    lines = doc_lines(ROOT / page)
    for where, path, _ in FILES:
        if where == page:
            if path.endswith("/"):
                (cwd / path).mkdir(parents=True, exist_ok=True)
            elif path == "disk.json":
                from sixfold.partitioner.pricing.tiers import GENERIC_SSD
                (cwd / path).write_text(GENERIC_SSD.to_json() + "\n")
            else:
                (cwd / path).touch()
    curl_blocks = {ln.block for ln in lines if any(s[0] == "curl" for s in _segments(ln.text))}
    targets = _make_targets()
    values = {"cwd": str(cwd)}
    if live is not None:
        values.update(http=live.http, grpc=live.grpc)
    for line in lines:
        tally.found += 1
        text = _put_in(line, line.text, **values)
        ran = False
        for seg in _segments(text):
            if why := _unknown_program(seg):
                errors.append(f"{line.where}: {why}")
            if _bare(seg[0]) == "make":
                missing = [t for t in seg[1:] if not t.startswith("-") and "=" not in t and t not in targets]
                if missing:
                    errors.append(f"{line.where}: make {' '.join(missing)}: no such target in the Makefile")
                tally.checked += 1
            for tok in seg:
                tok = tok.split("=", 1)[-1] if tok.startswith("--") else tok
                if tok.startswith(REPO_DIRS):
                    if not (ROOT / tok).exists():
                        errors.append(f"{line.where}: {tok}: no such file or folder in the repository")
                    tally.checked += 1
            docker = _docker_run_args(seg)
            if docker is not None:
                inv = Invocation(line, "sixfold-serve", "sixfold-serve (the image's ENTRYPOINT)",
                                 PROGRAMS["sixfold-serve"], _unbracket(_dockerfile_serve_argv(docker)), "command")
                if why := parse(inv, capsys):
                    errors.append(f"{line.where}: {why}")
                tally.parsed += 1
        for inv in _invocations(DocLine(line.page, line.lineno, text, line.lang, line.block)):
            if why := parse(inv, capsys):
                errors.append(f"{line.where}: {why}")
                continue
            tally.parsed += 1
            row = _run_row(inv)
            if row is None:
                if inv.kind == "command" and _parse_only_why(inv) is None:
                    errors.append(f"{line.where}: {inv.spelled[:80]!r} is neither in RUN nor in PARSE_ONLY: say "
                                  "why it does not run, or run it")
                continue
            if failed := run(inv, row, cwd, capsys):
                errors.append(f"{line.where}: {failed}")
            ran = True
        segments = _segments(text)
        # a console block with curl runs whole (docs/http.md writes the bodies it sends); elsewhere the curl lines
        if line.block in curl_blocks and (line.lang == "console" or segments[0][0] == "curl") and not ran:
            if live is None:
                errors.append(f"{line.where}: a curl block on a page not in CURL_PAGES")
                continue
            ran = True
            command = re.sub(r"\bcurl -s\b", "curl -sf", text) if line.lang != "console" else text  # -f: 4xx fails
            done = _bash(command, cwd)
            if done.returncode != 0:
                errors.append(f"{line.where}: exit {done.returncode}: {command}\n{done.stderr[-600:]}")
            elif line.output and (diff := output_differs(line.output, done.stdout)):
                errors.append(f"{line.where}: {diff}")
            elif "%{http_code}" in command and not line.output and done.stdout.strip() != "200":
                errors.append(f"{line.where}: said {done.stdout.strip()!r}, not 200")
        tally.run += ran
    return tally, errors


def run(inv: Invocation, row: Run, cwd: Path, capsys) -> str | None:
    """Run ``inv`` for real in ``cwd`` with ``row``'s options appended; None when it exits 0."""
    argv = [*inv.argv, *row.append]
    if row.process:
        program = [str(VENV_BIN / inv.program)] if inv.program in PROGRAMS else [sys.executable, "-m", inv.module]
        done = subprocess.run([*program, *argv], cwd=cwd, capture_output=True, text=True, timeout=120)
        return None if done.returncode == 0 else f"exit {done.returncode}: {(done.stderr or done.stdout)[-800:]}"
    capsys.readouterr()
    try:
        code = _main_of(inv)(argv)
    except SystemExit as exc:
        code = exc.code
    said = capsys.readouterr()
    return None if code in (0, None) else f"{inv.spelled[:80]}: exit {code}: {(said.err or said.out)[-800:]}"


# --- The tests -------------------------------------------------------------------------------------------------
PAGE_NAMES = [p.relative_to(ROOT).as_posix() for p in PAGES if doc_lines(p)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", PAGE_NAMES)
def test_the_page_commands_work(page: str, tmp_path, monkeypatch, capsys, caplog, request) -> None:
    live = request.getfixturevalue("live") if page in CURL_PAGES else None
    cwd = live.site if page == "docs/deltas.md" else tmp_path  # its lines make and apply deltas of live's repo
    monkeypatch.chdir(cwd)
    caplog.set_level(logging.WARNING, logger="torch.__trace")  # torch.export's trace records: thousands a model
    tally, errors = walk(page, cwd, capsys, live)
    assert not errors, "\n".join(errors)
    assert tally.found


def test_the_tables_name_only_lines_that_exist() -> None:
    spelled = {(inv.line.page, inv.spelled) for p in PAGES for ln in doc_lines(p) for inv in _invocations(ln)}
    for row in RUN:
        assert any(page == row.page and s.startswith(row.starts) for page, s in spelled), \
            f"RUN names {row.starts!r} on {row.page}, which has no such line any more"
    for page, starts, why in PARSE_ONLY:
        assert any(page in ("*", p) and s.startswith(starts) for p, s in spelled), \
            f"PARSE_ONLY names {starts!r} on {page}, which matches no line any more"
    for page, path, _ in FILES:
        assert path in (ROOT / page).read_text(), f"FILES: {page} no longer names {path!r}"
    for page, shown, _ in PLACEHOLDERS:
        assert shown in (ROOT / page).read_text(), f"PLACEHOLDERS: {page} no longer says {shown!r}"


def test_every_curl_page_gets_the_live_server() -> None:
    with_curl = {ln.page for p in PAGES for ln in doc_lines(p) if any(s[0] == "curl" for s in _segments(ln.text))}
    assert with_curl == set(CURL_PAGES)


def test_the_programs_are_the_installed_commands() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    scripts = dict(re.findall(r'^(sixfold-[\w-]+) = "([\w.]+):main"$', text.split("[project.scripts]")[1], re.M))
    assert scripts == {name: f"{module}" for name, module in PROGRAMS.items()}


def test_the_walker_catches_a_bad_flag_and_a_bad_choice(capsys, tmp_path) -> None:
    """The check itself: a renamed flag and a wrong choice fail, naming the command."""
    line = DocLine("x.md", 1, ".venv/bin/sixfold-partition --model rm2 --out x --rows 5", "bash", 0)
    (inv,) = _invocations(line)
    assert "unrecognized arguments: --rows" in (parse(inv, capsys) or "")
    line = DocLine("x.md", 1, ".venv/bin/sixfold-partition --model rm2 --out x --max-row 5", "bash", 0)
    (inv,) = _invocations(line)
    assert "unrecognized arguments: --max-row" in (parse(inv, capsys) or "")  # spelled in full
    line = DocLine("x.md", 2, "sixfold-serve --model rm2 --card-scheduling fastest &", "bash", 0)
    (inv,) = _invocations(line)
    assert "invalid choice: 'fastest'" in (parse(inv, capsys) or "")
    line = DocLine("x.md", 3, "python -m sixfold.conformance --list", "bash", 0)
    (inv,) = _invocations(line)
    assert "no module sixfold.conformance" in (parse(inv, capsys) or "")
    line = DocLine("x.md", 4, "sixfold-partition tables build rm2 --out r --max-rows 5", "bash", 0)
    (inv,) = _invocations(line)
    assert parse(inv, capsys) is None and not (tmp_path / "r").exists()  # parsed, nothing built
    line = DocLine("x.md", 5, ".venv/bin/python bench/fifo_server.py --model rm2 --prot 0", "bash", 0)
    (inv,) = _invocations(line)
    assert "unrecognized arguments: --prot" in (parse(inv, capsys) or "")
    line = DocLine("x.md", 6, ".venv/bin/python bench/no_such_bench.py --quick", "bash", 0)
    (inv,) = _invocations(line)
    assert "bench/no_such_bench.py: no such file" in (parse(inv, capsys) or "")


@pytest.mark.parametrize("text, why", [
    ("python -m backends.conformance --list", "the package is sixfold.backends.conformance"),
    (".venv/bin/sixfold-server --model rm2", "no such program in the venv"),
    ("sixfold-partitioner --model rm2", "not a sixfold command"),
    ("python3 -m no_such_module_here", "no such module"),
])
def test_the_walker_catches_a_moved_program(text, why) -> None:
    assert why in (_unknown_program(_segments(text)[0]) or "")


def test_shown_output_is_compared() -> None:
    assert output_differs(['{"error":"x"} 400'], '{"error":"x"} 400\n') is None
    assert "status 400" in output_differs(['{"error":"x"} 400'], '{"error":"x"} 404')
    assert output_differs(['{"a":[1,2],"b":{"c":1}}'], '{"a":[1,2,3],"b":{"c":1,"d":2},"e":0}') is None
    assert output_differs(['{"a":[1,2]}'], '{"a":[2,1]}')  # order kept
    assert output_differs(['{"a":1.5}'], '{"a":1.25}')
    assert output_differs(['{"name":"rm2", ...'], '{"name":"rm2", "x": 1}') is None
    assert output_differs(["200"], "201")


def test_make_targets_the_docs_name_exist() -> None:
    """Inline ``make X`` in prose too, not only in the shell blocks."""
    targets = _make_targets()
    for page in PAGES:
        for n, text in enumerate(page.read_text().splitlines(), 1):
            for target in re.findall(r"`make ([\w-]+)", text):
                assert target in targets, f"{page.relative_to(ROOT)}:{n}: make {target}: no such Makefile target"
