"""sixfold-simulate end to end (small, short runs) and its messages for bad input."""

from __future__ import annotations

import json

import pytest

from sixfold.simulate.cli import main
from sixfold.simulate.platform import build_platform

SHORT = ["--duration", "0.5", "--warmup", "0.1", "--quiet"]


def test_run_prints_a_table_and_writes_json_and_a_plot(tmp_path, capsys) -> None:
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    code = main(["run", "--model", "rm1", "--cards", "2", "--qps", "50,100", *SHORT, "--json", str(out),
                 "--plot", str(png), "--host-spec", "host-cpu"])
    assert code == 0
    text = capsys.readouterr().out
    assert "2 x m2-card" in text and "p99 ms" in text
    data = json.loads(out.read_text())
    runs = data["results"][0]["runs"]
    assert [r["rate"] for r in runs] == [50.0, 100.0]
    assert set(runs[0]["utilisation"]) >= {"frontend", "host", "card0", "card1"}
    assert png.stat().st_size > 1000


def test_scheduling_flags_are_sixfold_serves(tmp_path) -> None:
    out = tmp_path / "run.json"
    args = ["run", "--model", "rm1", "--cards", "1", "--qps", "20", *SHORT, "--json", str(out), "--host-spec",
            "host-cpu", "--query-size", "fixed:10"]
    assert main([*args, "--max-queue-delay-us", "5000", "--no-all-in-dispatch"]) == 0
    slow = json.loads(out.read_text())["results"][0]["runs"][0]["latency_ms"]["p50"]
    assert main([*args, "--max-queue-delay-us", "1000", "--no-all-in-dispatch"]) == 0
    fast = json.loads(out.read_text())["results"][0]["runs"][0]["latency_ms"]["p50"]
    assert slow - fast == pytest.approx(4.0, abs=0.05)  # a lone small query waits out the window
    assert main([*args, "--max-queue-delay-us", "5000"]) == 0
    alone = json.loads(out.read_text())["results"][0]["runs"][0]["latency_ms"]["p50"]
    assert alone < fast - 0.5  # sixfold-serve's default: nobody else outstanding, so no window waited


def test_capacity_answers_the_fewest_cards_and_their_watts(tmp_path, capsys) -> None:
    out = tmp_path / "cap.json"
    code = main(["capacity", "--model", "rm1", "--card-spec", "m2-card", "--qps", "400", "--p99-ms", "60",
                 "--max-cards", "4", "--query-size", "fixed:100", *SHORT, "--json", str(out), "--host-spec",
                 "host-cpu"])
    assert code == 0
    answer = json.loads(out.read_text())["results"][0]
    assert answer["cards"] is not None and 1 <= answer["cards"] <= 4
    assert answer["watts"] == 12 * answer["cards"]
    assert "Fewest cards" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["run", "--model", "rm1", "--card-spec", "no-such-card", "--qps", "10"], "--card-spec: no device spec 'no-such-card'"),
    (["run", "--model", "rm1", "--qps", "0"], "--qps must be > 0"),
    (["run", "--model", "rm1", "--qps", "-5"], "--qps must be > 0"),
    (["run", "--model", "rm1", "--qps", "ten"], "--qps: 'ten' is not a list of numbers"),
    (["run", "--model", "rm1", "--cards", "0", "--qps", "10"], "--cards must be > 0"),
    (["run", "--model", "rm9", "--qps", "10"], "--model: unknown model 'rm9'"),
    (["run", "--model", "rm1", "--qps", "10", "--query-size", "huge"], "--query-size: bad query size spec"),
    (["run", "--model", "rm1", "--qps", "10", "--arrival", "sometimes"], "--arrival: bad arrival spec"),
    (["run", "--model", "rm1", "--qps", "10", "--duration", "0"], "--duration must be > 0"),
    (["max-qps", "--model", "rm1", "--p99-ms", "0.5"], "--p99-ms 0.5: a lone 700-item query"),
    (["capacity", "--model", "rm1", "--qps", "-1"], "--qps must be > 0"),
    (["run", "--model", "dlrm-mlperf", "--qps", "10", "--host-spec", "host-calibrated"], "--host-spec: dlrm-mlperf's tables need"),
    (["run", "--model", "rm1", "--qps", "10", "--max-batch-rows", "0"], "scheduling flags: max_batch_rows must be >= 1"),
])
def test_bad_input_is_refused_naming_the_argument(argv, says, capsys) -> None:
    defaults = [*SHORT, "--host-spec", "host-cpu"]  # first, so the case's own flags win
    assert main([argv[0], *defaults, *argv[1:]]) == 2
    assert says in capsys.readouterr().err


def test_precision_and_spec_change_the_platforms_prices() -> None:
    base = build_platform("dlrm-mlperf", cards=2, card_spec="m2-card", host_spec="host-cpu", max_rows=10_000)
    int8 = build_platform("dlrm-mlperf", cards=2, card_spec="m2-card", host_spec="host-cpu", max_rows=10_000,
                          table_precision="int8")
    fp16 = build_platform("dlrm-mlperf", cards=2, card_spec="m2-card", host_spec="host-cpu", max_rows=10_000,
                          dense_precision="fp16")
    int8_dense = build_platform("dlrm-mlperf", cards=2, card_spec="m2-card", host_spec="host-cpu", max_rows=10_000,
                                dense_precision="int8")
    l4 = build_platform("dlrm-mlperf", cards=2, card_spec="gpu-l4", host_spec="host-cpu", max_rows=10_000)
    assert int8_dense.lanes[0][0].seconds(256) < fp16.lanes[0][0].seconds(256)  # the card's int8 peak
    assert int8.host.seconds(256) < base.host.seconds(256)
    assert int8.table_bytes < base.table_bytes / 3
    assert fp16.lanes[0][0].seconds(256) < base.lanes[0][0].seconds(256)
    assert l4.lanes[0][0].seconds(256) < base.lanes[0][0].seconds(256)
    assert (base.power_watts, l4.power_watts) == (24, 144)
    # The card stage is priced as the plan prices it: its estimate at the plan's batch size.
    est = {d.device: d.batch_seconds for d in base.plan.estimates.per_device}
    assert base.lanes[0][0].seconds(base.plan.estimates.batch_rows) == pytest.approx(est["card0"])
    assert base.host.seconds(base.plan.estimates.batch_rows) == pytest.approx(est["host"])


def test_a_trace_runs_at_its_own_rate_without_qps(tmp_path, capsys) -> None:
    trace = tmp_path / "times.txt"
    trace.write_text("\n".join(str(i * 0.02) for i in range(20)))
    out = tmp_path / "trace.json"
    code = main(["run", "--model", "rm1", "--cards", "1", *SHORT, "--host-spec", "host-cpu", "--arrival",
                 f"trace:{trace}", "--query-size", "fixed:20", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    run = json.loads(out.read_text())["results"][0]["runs"][0]
    assert run["rate"] == pytest.approx(50.0)


def test_no_wait_rows_is_sixfold_serves_too(tmp_path) -> None:
    out = tmp_path / "run.json"
    args = ["run", "--model", "rm1", "--cards", "1", "--qps", "5", *SHORT, "--json", str(out), "--host-spec",
            "host-cpu", "--query-size", "fixed:300", "--host-dense-max-rows", "0"]
    assert main([*args, "--no-wait-rows", "256"]) == 0
    at_once = json.loads(out.read_text())["results"][0]["runs"][0]["latency_ms"]["p50"]
    assert main([*args, "--no-wait-rows", "0", "--no-all-in-dispatch"]) == 0
    waited = json.loads(out.read_text())["results"][0]["runs"][0]["latency_ms"]["p50"]
    assert waited - at_once == pytest.approx(2.0, abs=0.05)  # a 300-item query waits out the 2 ms window


def test_card_scheduling_is_sixfold_serves_and_reaches_the_settings() -> None:
    from sixfold.server.cli import _parser as serve_parser
    from sixfold.simulate.cli import _parser, serving_settings
    serve = next(a for a in serve_parser()._actions if a.dest == "card_scheduling")
    assert serving_settings(_parser().parse_args(["run", "--model", "rm1", "--qps", "1"])).card_scheduling == serve.default
    args = _parser().parse_args(["run", "--model", "rm1", "--qps", "1", "--card-scheduling", "fifo"])
    assert serving_settings(args).card_scheduling == "fifo"


def test_an_unknown_card_scheduling_is_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--model", "rm1", "--qps", "1", "--card-scheduling", "random"])
    assert exited.value.code == 2 and "--card-scheduling: invalid choice: 'random'" in capsys.readouterr().err


CAPACITY = ["capacity", "--model", "rm1", "--card-spec", "m2-card", "--qps", "400", "--p99-ms", "60",
            "--max-cards", "4", "--query-size", "fixed:100", "--duration", "0.5", "--warmup", "0.1",
            "--host-spec", "host-cpu"]


def test_progress_off_a_terminal_is_a_line_per_run_and_quiet_is_silent(capsys) -> None:
    """Piped (as under pytest), a long command still says what it does: a line as each run starts."""
    assert main(CAPACITY) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("simulating run ")]
    assert lines and lines[0].startswith("simulating run 1 (of about 5): rm1 on 4 x m2-card (fp32/fp32) at 400 q/s")
    assert all(line.endswith(" s so far") for line in lines)
    assert out.index(lines[-1]) < out.index("Fewest cards")
    assert "\x1b[" not in out  # no bar, no colour codes in a pipe
    assert main([*CAPACITY, "--quiet"]) == 0
    assert "simulating run" not in capsys.readouterr().out


def test_progress_on_a_terminal_is_a_rich_bar() -> None:
    import io

    from rich.console import Console

    from sixfold.simulate.cli import _Bar

    terminal = Console(file=io.StringIO(), force_terminal=True)
    with _Bar(terminal, 3, quiet=False) as bar:
        bar.note("rm1 on 1 x m2-card")
        assert bar.progress is not None and not bar.plain
        assert bar.progress.tasks[0].description == "rm1 on 1 x m2-card"
    assert "simulating run" not in terminal.file.getvalue()
    assert _Bar(terminal, 3, quiet=True).progress is None


def test_the_capacity_plot_keeps_every_label_inside(tmp_path, monkeypatch) -> None:
    from sixfold.simulate import report

    figures = []
    real = report.cards_figure
    monkeypatch.setattr(report, "cards_figure", lambda *a: figures.append(real(*a)) or figures[-1])
    png = tmp_path / "cap.png"
    assert main([*CAPACITY, "--card-spec", "gpu-l4", "--quiet", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    [fig] = figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # NOTE: the saved figure was closed; draw it again as saved
    canvas.draw()
    renderer = canvas.get_renderer()
    box, ax = fig.bbox, fig.axes[0]
    drawn = ax.get_tightbbox(renderer)  # the axes with every label, tick label and title as drawn
    assert box.x0 <= drawn.x0 and drawn.x1 <= box.x1 and box.y0 <= drawn.y0 and drawn.y1 <= box.y1, (drawn, box)
    assert ax.yaxis.label.get_text() == "p99 latency at 400 q/s (ms)"
    assert all(float(t).is_integer() for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1])
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(label.startswith("m2-card fp32/fp32 poisson fixed:100: ") and " card" in label for label in legend)
    assert "missed: over the bound, refused or saturated" in legend
