"""A small PromQL evaluator over scraped /metrics pages, enough for the queries of Triton's dashboards.

It reads a page the way Prometheus does (prometheus-client's text parser; the names as written, so
a counter written ``nv_inference_count`` is queried as ``nv_inference_count``), adds the target
labels Prometheus adds at scrape time (``instance``, ``job``, ``pod``), and evaluates:
selectors with matchers, ``rate``/``irate``/``increase`` over two scrapes, ``sum``/``avg``/``count``/
``min``/``max`` with ``by``/``without`` (before or after the parentheses), ``+ - * /`` between
numbers and vectors with ``on``/``ignoring`` and ``group_left``/``group_right``.

A page with two samples of one series is refused, as Prometheus refuses such a scrape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scrape", "Query", "parse", "evaluate", "scrape"]

Labels = frozenset[tuple[str, str]]
Vector = dict[Labels, float]

_AGGREGATIONS = ("sum", "avg", "count", "min", "max")
_RANGE_FUNCTIONS = ("rate", "irate", "increase")
_KEYWORDS = ("by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset")
_TOKEN = re.compile(r'\s*(?:(?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)(?![a-zA-Z_])|(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)'
                    r'|(?P<string>"(?:[^"\\]|\\.)*")|(?P<range>\[[^\]]*\])|(?P<op>=~|!=|!~|==|[-+*/(){},=]))')


@dataclass
class Scrape:
    """One scrape of a target: every sample by name and labels (target labels added), and when."""

    at: float
    samples: dict[str, Vector]
    types: dict[str, str] = field(default_factory=dict)
    """Family name -> type, as the page declares it."""


def scrape(text: str, at: float, target: dict[str, str]) -> Scrape:
    """Read ``text`` as Prometheus would, with ``target``'s labels added to every sample."""
    families = list(text_string_to_metric_families(text))  # the whole page must parse
    del families
    samples: dict[str, Vector] = {}
    types: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            types[name] = kind.strip()
            continue
        if not line.strip() or line.startswith("#"):
            continue
        match = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)', line)
        assert match, f"unreadable sample line {line!r}"
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        pairs = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', labels))
        key: Labels = frozenset({**pairs, **target}.items())
        series = samples.setdefault(name, {})
        assert key not in series, f"duplicate series {name}{{{labels}}}: Prometheus would refuse the scrape"
        series[key] = value
    return Scrape(at, samples, types)


@dataclass
class Query:
    """A parsed query: the tree, and what it reads (metric names; label names it groups or matches on)."""

    text: str
    tree: tuple
    metrics: set[str]
    labels: set[str]


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        at = 0
        while at < len(text.rstrip()):
            match = _TOKEN.match(text, at)
            assert match and match.end() > at, f"cannot read {text[at:]!r} in {text!r}"
            kind = match.lastgroup
            assert kind is not None
            self.tokens.append((kind, match.group(kind)))
            at = match.end()
        self.at = 0
        self.metrics: set[str] = set()
        self.labels: set[str] = set()

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.at] if self.at < len(self.tokens) else ("end", "")

    def take(self, value: str | None = None) -> str:
        kind, text = self.peek()
        assert kind != "end", "query ends too soon"
        assert value is None or text == value, f"expected {value!r}, got {text!r}"
        self.at += 1
        return text

    def label_list(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take())
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        self.labels.update(names)
        return tuple(names)

    def expr(self) -> tuple:
        return self.binary(("+", "-"), lambda: self.binary(("*", "/"), self.unary))

    def binary(self, ops: tuple[str, ...], operand: Callable[[], tuple]) -> tuple:
        left = operand()
        while self.peek()[1] in ops:
            op = self.take()
            match: tuple = ("ignoring", ())
            group: tuple = ("", ())
            if self.peek()[1] in ("on", "ignoring"):
                match = (self.take(), self.label_list())
                if self.peek()[1] in ("group_left", "group_right"):
                    side = self.take()
                    group = (side, self.label_list() if self.peek()[1] == "(" else ())
            left = ("binary", op, left, operand(), match, group)
        return left

    def unary(self) -> tuple:
        kind, text = self.peek()
        if kind == "number":
            return ("number", float(self.take()))
        if text == "(":
            self.take("(")
            inner = self.expr()
            self.take(")")
            return inner
        if text == "-":
            self.take("-")
            return ("binary", "*", ("number", -1.0), self.unary(), ("ignoring", ()), ("", ()))
        name = self.take()
        if name in _AGGREGATIONS:
            grouping: tuple = ("by", ())  # no clause: one group of all
            if self.peek()[1] in ("by", "without"):
                grouping = (self.take(), self.label_list())
            self.take("(")
            inner = self.expr()
            self.take(")")
            if self.peek()[1] in ("by", "without"):
                grouping = (self.take(), self.label_list())
            return ("aggregate", name, grouping, inner)
        if name in _RANGE_FUNCTIONS:
            self.take("(")
            selector = self.selector(self.take())
            self.take(")")
            assert selector[3], f"{name}() needs a range selector"
            return ("range", name, selector)
        assert kind == "name" and name not in _KEYWORDS, f"unexpected {name!r}"
        selector = self.selector(name)
        assert not selector[3], f"a range selector outside a function: {name}"
        return selector

    def selector(self, name: str) -> tuple:
        self.metrics.add(name)
        matchers = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label, op, value = self.take(), self.take(), self.take()
                matchers.append((label, op, value[1:-1]))
                self.labels.add(label)
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        window = self.take()[1:-1] if self.peek()[0] == "range" else ""
        return ("selector", name, tuple(matchers), window)


def parse(text: str) -> Query:
    parser = _Parser(text)
    tree = parser.expr()
    assert parser.peek()[0] == "end", f"unread tail {parser.tokens[parser.at:]} in {text!r}"
    return Query(text, tree, parser.metrics, parser.labels)


def _matches(labels: Labels, matchers: tuple) -> bool:
    values = dict(labels)
    for label, op, want in matchers:
        have = values.get(label, "")
        ok = {"=": have == want, "!=": have != want, "=~": re.fullmatch(want, have) is not None,
              "!~": re.fullmatch(want, have) is None}[op]
        if not ok:
            return False
    return True


def _select(page: Scrape, name: str, matchers: tuple) -> Vector:
    return {labels: value for labels, value in page.samples.get(name, {}).items() if _matches(labels, matchers)}


def _signature(labels: Labels, match: tuple) -> Labels:
    kind, names = match
    if kind == "on":
        return frozenset((k, v) for k, v in labels if k in names)
    return frozenset((k, v) for k, v in labels if k not in names and k != "__name__")


_OPS: dict[str, Callable[[float, float], float]] = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "/": lambda a, b: a / b if b else (math.nan if a == 0 else math.copysign(math.inf, a)),
}


def evaluate(query: Query | str, before: Scrape, after: Scrape) -> Vector | float:
    """The query's instant value at ``after`` (range functions over ``before`` .. ``after``)."""
    tree = (parse(query) if isinstance(query, str) else query).tree
    return _eval(tree, before, after)


def _eval(node: tuple, before: Scrape, after: Scrape) -> Vector | float:
    kind = node[0]
    if kind == "number":
        return node[1]
    if kind == "selector":
        _, name, matchers, _ = node
        return _select(after, name, matchers)
    if kind == "range":
        _, function, (_, name, matchers, _) = node
        old, new = _select(before, name, matchers), _select(after, name, matchers)
        seconds = after.at - before.at
        assert seconds > 0, "two scrapes are needed for a rate"
        out: Vector = {}
        for labels, value in new.items():
            if labels in old:
                gained = value - old[labels] if value >= old[labels] else value  # a counter reset
                out[labels] = gained if function == "increase" else gained / seconds
        return out
    if kind == "aggregate":
        _, op, (how, names), inner = node
        vector = _eval(inner, before, after)
        assert isinstance(vector, dict), f"{op}() of a number"
        groups: dict[Labels, list[float]] = {}
        for labels, value in vector.items():
            key = frozenset((k, v) for k, v in labels if (k in names) == (how == "by") and k != "__name__")
            groups.setdefault(key, []).append(value)
        combine: dict[str, Callable[[list[float]], float]] = {
            "sum": sum, "avg": lambda v: sum(v) / len(v), "count": len, "min": min, "max": max}
        return {key: float(combine[op](values)) for key, values in groups.items()}
    assert kind == "binary", node
    _, op, left_node, right_node, match, (group, _) = node
    left, right = _eval(left_node, before, after), _eval(right_node, before, after)
    fn = _OPS[op]
    if not isinstance(left, dict) and not isinstance(right, dict):
        return fn(left, right)
    if not isinstance(left, dict):
        assert isinstance(right, dict)
        return {labels: fn(left, value) for labels, value in right.items()}
    if not isinstance(right, dict):
        return {labels: fn(value, right) for labels, value in left.items()}
    one, many = (right, left) if group != "group_right" else (left, right)
    by_signature: dict[Labels, tuple[Labels, float]] = {}
    for labels, value in one.items():
        signature = _signature(labels, match)
        assert signature not in by_signature, f"many-to-many match on {sorted(signature)} in {op}"
        by_signature[signature] = (labels, value)
    out = {}
    seen: set[Labels] = set()
    for labels, value in many.items():
        signature = _signature(labels, match)
        if signature not in by_signature:
            continue
        assert group or signature not in seen, f"several series match one on {sorted(signature)}: needs group_left"
        seen.add(signature)
        other = by_signature[signature][1]
        result = fn(value, other) if group != "group_right" else fn(other, value)
        out[labels if group else signature] = result
    return out
