"""What the conformance kit found: one row per (case, check), a rich table, a verdict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

__all__ = ["CheckResult", "ConformanceReport", "Outcome"]

Outcome = Literal["pass", "fail", "skip", "declined"]


@dataclass(frozen=True)
class CheckResult:
    """One check on one case."""

    case: str
    """The model whose dense partition was used."""
    check: str
    """The check's name (see ``sixfold.backends.conformance.CHECKS``)."""
    outcome: Outcome
    """"pass", "fail", "skip" (not run because an earlier check, e.g. load, failed; counts as not passed) or
    "declined" (not run: the case's precision is one the backend's ``supports()`` declines, which serving
    never sends it; counts as passed)."""
    seconds: float
    detail: str = ""
    atol: float | None = None
    """The absolute tolerance the check compared answers with (the kit's ``atol``, or a case's own when larger:
    fp16 and int8 cases carry theirs); None for a check that compares no answers (memory, close, ...)."""
    max_error: float | None = None
    """The largest |answer - onnxruntime| the check saw over every answer it compared (a failing one included);
    None when it compared none."""

    @property
    def tolerance_text(self) -> str:
        """"3.1e-07 / 0.0001" (max error / atol) for a check that compared answers, else ""."""
        if self.max_error is None or self.atol is None:
            return ""
        return f"{self.max_error:.1e} / {self.atol:.2g}"

    @property
    def passed(self) -> bool:
        return self.outcome in ("pass", "declined")


@dataclass
class ConformanceReport:
    """Every check's result for one backend; ``passed`` is the verdict."""

    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    device: str = ""
    results: list[CheckResult] = field(default_factory=list)
    hung: bool = False
    """A backend thread never returned (a hang); the process may not exit cleanly (the CLI uses os._exit)."""

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if not r.passed]

    def result(self, case: str, check: str) -> CheckResult:
        """The result of ``check`` on ``case`` (KeyError naming what exists)."""
        for r in self.results:
            if r.case == case and r.check == check:
                return r
        raise KeyError(f"no result for {case}/{check}; have {[f'{r.case}/{r.check}' for r in self.results]}")

    def failed_checks(self) -> set[str]:
        """Names of the checks that failed (not skipped) on any case."""
        return {r.check for r in self.results if r.outcome == "fail"}

    def summary(self) -> str:
        counts = {o: sum(r.outcome == o for r in self.results) for o in ("pass", "fail", "skip", "declined")}
        verdict = "PASSED" if self.passed else "FAILED"
        return (f"backend {self.backend}: {verdict} ({len(self.results)} checks: {counts['pass']} passed, "
                f"{counts['fail']} failed, {counts['skip']} skipped"
                + (f", {counts['declined']} declined by supports()" if counts["declined"] else "") + ")")

    def table(self) -> Any:
        """A ``rich.table.Table`` of the results."""
        from rich.table import Table

        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        title = f"sixfold conformance: backend {self.backend}" + (f" ({opts})" if opts else "")
        table = Table(title=title, caption=self.summary(), title_justify="left", caption_justify="left")
        table.add_column("model", no_wrap=True)  # a case's name stays greppable ("op Gemm(...) float16")
        table.add_column("check")
        table.add_column("result")
        table.add_column("time", justify="right")
        table.add_column("max err / atol", justify="right", no_wrap=True)
        table.add_column("detail", overflow="fold")
        style = {"pass": "[green]PASS[/]", "fail": "[bold red]FAIL[/]", "skip": "[yellow]SKIP[/]", "declined": "[cyan]DECLINED[/]"}
        for r in self.results:
            table.add_row(r.case, r.check, style[r.outcome], f"{r.seconds:.2f}s", r.tolerance_text, r.detail)
        return table

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "options": {k: repr(v) for k, v in self.options.items()},
                "device": self.device, "passed": self.passed, "hung": self.hung,
                "results": [asdict(r) for r in self.results]}
