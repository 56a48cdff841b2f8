"""What the report pictures draw, read back from the matplotlib artists (issue #30 items 3, 5, 20):
the loss scale at every step it changed, skip markers where they overflowed, labelled comparisons,
legends outside the curves, events marked, honest axes."""
from __future__ import annotations

import json
import math

import pytest

from mixprec.report import compare, report
from mixprec.report.compare import compare_notes, compare_summary, load_run, write_comparison
from mixprec.report.figures import _LINE_STYLE
from mixprec.runs.metrics import MetricsLogger


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the report saves, by file name (the artists as drawn)."""
    figures = {}
    for module in (report, compare):
        real = module.save

        def keep(fig, path, real=real):
            figures[path.name] = fig
            return real(fig, path)
        monkeypatch.setattr(module, "save", keep)
    return figures


def _run(path, *, steps: int, max_steps: int, final: float, skips: range = range(0),
         events: tuple = (), log_interval: int = 10, precision: str = "16-mixed") -> None:
    """A run folder as a trainer writes it: rows every ``log_interval`` steps, one ``skip`` record
    per skipped step (the scale halves on each), the scale 2^30 at the start."""
    path.mkdir(parents=True)
    (path / "config.toml").write_text(f'precision = "{precision}"\nmax_steps = {max_steps}\n')
    scale, total = 2.0 ** 30, 0
    with MetricsLogger(path, tensorboard=False) as log:
        log.event({"kind": "start", "step": 0, "precision": precision, "message": "device: cpu x 1"})
        for step in range(1, steps + 1):
            if step in skips:
                log.event({"kind": "skip", "step": step, "loss_scale_before": scale,
                           "loss_scale_after": scale / 2, "message": f"step {step} skipped"})
                scale, total = scale / 2, total + 1
            for e in events:
                if e["step"] == step:
                    log.event(e)
            if step % log_interval == 0 or step == steps:
                loss = final + (steps - step) * 0.01
                log.log(step, loss=loss, val_loss=loss + 0.1, lr=1e-3 * step / steps, loss_scale=scale,
                        skipped=step in skips, skipped_total=total, tokens_per_s=1000.0 + step,
                        mfu=0.01 * (1 + step / steps), peak_mem_mb=300.0 + step, time_s=0.1)


def test_loss_scale_plot_draws_every_back_off_between_logged_rows(tmp_path, drawn):
    _run(tmp_path / "run", steps=20, max_steps=20, final=3.0, skips=range(1, 10))
    report.write_report(tmp_path / "run", tmp_path / "out")
    ax = drawn["loss_scale.png"].axes[0]
    line, marks = ax.lines[0], ax.lines[1]
    by_step = dict(zip(line.get_xdata(), line.get_ydata()))
    # The scale halved at each of steps 1-9 (only the row at step 10 logged it, as 2^21).
    assert [by_step[s] for s in range(0, 10)] == [2.0 ** (30 - s) for s in range(0, 10)]
    assert list(marks.get_xdata()) == list(range(1, 10))               # every skipped step
    assert list(marks.get_ydata()) == [2.0 ** (31 - s) for s in range(1, 10)]  # at the scale it overflowed


def test_comparison_says_what_it_compares_and_that_a_run_is_incomplete(tmp_path, capsys):
    _run(tmp_path / "ref", steps=2000, max_steps=2000, final=3.215, log_interval=40)
    _run(tmp_path / "short", steps=320, max_steps=2000, final=3.014, log_interval=40)
    _run(tmp_path / "stop", steps=400, max_steps=2000, final=3.1, log_interval=40,
         events=({"kind": "interrupted", "step": 400, "message": "stopped by SIGINT at step 400"},))
    loaded = [load_run(tmp_path / n) for n in ("ref", "short", "stop")]
    ref, short, stop = compare_summary(loaded)
    # Finals at steps 2000, 320 and 400 are not compared with each other (it said -6.25 %, step
    # 320 against step 2000); a note names each run's last step.
    assert "final loss vs first's final (%)" not in short
    assert compare_notes(loaded) == [
        f"the runs' last {name} steps differ (ref: step 2000, short: step 320, stop: step 400): "
        "compared at step 320 only, the last step every run logged" for name in ("loss", "validation loss")]
    # The other comparison names its step in the column header: the last step all runs reached.
    at_320 = 100 * (3.014 / (3.215 + (2000 - 320) * 0.01) - 1)
    assert short["loss vs first at step 320 (%)"] == pytest.approx(at_320)
    assert "loss vs first (%)" not in short
    assert ref["steps"] == "2000 of 2000 (complete)"
    assert short["steps"] == "320 of 2000 (incomplete: still running, or killed)"
    assert stop["steps"] == "400 of 2000 (stopped)"
    # Stopped between two logged rows: the step it reached, not the last row's (it said 400).
    _run(tmp_path / "mid", steps=400, max_steps=2000, final=3.1, log_interval=40)
    with open(tmp_path / "mid" / "events.jsonl", "a") as f:          # the stop, between two rows
        f.write(json.dumps({"kind": "interrupted", "step": 409, "message": "stopped by SIGINT"}) + "\n")
    assert compare_summary([load_run(tmp_path / "mid")])[0]["steps"] == "409 of 2000 (stopped)"
    # A mode without loss scaling shows no loss scale (it showed 1 for 32-true and bf16 runs).
    _run(tmp_path / "fp32", steps=40, max_steps=40, final=3.0, precision="32-true")
    fp32, fp16 = compare_summary([load_run(tmp_path / n) for n in ("fp32", "ref")])
    assert fp32["final loss scale"] is None and fp16["final loss scale"] is not None
    one = report.summarize(load_run(tmp_path / "short")["rows"], [], {"max_steps": 2000})
    assert one["steps"] == "320 of 2000 (incomplete: still running, or killed)"


def test_comparison_legends_are_short_and_outside_the_axes(tmp_path, drawn):
    long = "fp8-tensorwise"
    for name in ("a", "b", "c"):
        _run(tmp_path / name, steps=30, max_steps=30, final=3.0, precision=long)
    write_comparison([tmp_path / n for n in "abc"], tmp_path / "cmp")
    fig = drawn["compare_loss.png"]
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b", "c"]       # no precision strings
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    renderer = FigureCanvasAgg(fig).get_renderer()
    box, axes_box = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert box.y1 <= axes_box.y0                                              # under the axes: covers no curve
    saved = fig.get_tightbbox(renderer)                                       # what bbox_inches="tight" writes
    assert saved.x0 <= box.x0 / fig.dpi and box.x1 / fig.dpi <= saved.x1


def test_each_run_keeps_its_colour_in_every_comparison_picture(tmp_path, drawn):
    """The relative-loss plot has no line for the reference, so its lines took the colour cycle
    from the start: run b was orange in the loss plot and blue there."""
    for name, final in (("a", 3.0), ("b", 3.1), ("c", 3.2)):
        _run(tmp_path / name, steps=30, max_steps=30, final=final)
    write_comparison([tmp_path / n for n in "abc"], tmp_path / "cmp")

    def colours(png):
        return {line.get_label(): line.get_color() for line in drawn[png].axes[0].get_lines()
                if line.get_label() in "abc"}
    loss = colours("compare_loss.png")
    assert len(set(loss.values())) == 3
    for png in ("compare_val_loss.png", "compare_lr.png", "compare_loss_relative.png"):
        assert all(loss[run] == c for run, c in colours(png).items()), png
    assert set(colours("compare_loss_relative.png")) == {"b", "c"}


def test_skipped_count_axis_starts_at_zero_with_integer_ticks_or_says_none(tmp_path, drawn):
    for name in ("a", "b"):
        _run(tmp_path / name, steps=20, max_steps=20, final=3.0)
    write_comparison([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")
    ax = drawn["compare_skipped.png"].axes[0]
    assert ax.get_ylim() == (0.0, 1.0)                                        # was -0.04..0.04
    assert any(t.get_text() == "no skipped steps" for t in ax.texts)
    assert all(float(t).is_integer() for t in ax.get_yticks())


def test_single_run_pictures_lr_separate_mfu_memory_label_events_and_titles(tmp_path, drawn):
    _run(tmp_path / "run", steps=40, max_steps=40, final=3.0, skips=range(5, 7),
         events=({"kind": "start", "step": 20, "message": "resumed"},
                 {"kind": "format", "step": 30, "module": "fc", "from": "fp8-tensorwise", "to": "bf16",
                  "message": "re-plan"}))
    html = report.write_report(tmp_path / "run", tmp_path / "out").read_text()
    lr = drawn["lr.png"].axes[0].lines[0]
    assert list(lr.get_ydata()) == pytest.approx([1e-3 * s / 40 for s in (10, 20, 30, 40)])
    throughput = drawn["throughput.png"].axes
    assert [a.get_ylabel() for a in throughput] == ["tokens/s", "MFU (%)"]    # two panels, not one axis
    assert "RSS" in drawn["memory.png"].axes[0].get_title()                   # says what it measures
    loss = drawn["loss.png"].axes[0]
    marked = {tuple(l.get_xdata())[0]: l.get_label() for l in loss.lines if l.get_label() in _LINE_STYLE}
    assert marked == {20: "resumed", 30: "re-plan"}
    ticks = [l for l in loss.lines if l.get_label() == "skipped step"]
    assert list(ticks[0].get_xdata()) == [5, 6]
    assert "<figcaption>Learning rate</figcaption>" in html and "<figcaption>lr</figcaption>" not in html


def test_a_run_with_one_logged_row_draws_its_point(tmp_path, drawn):
    """A line through one point draws nothing: a one-row run got an empty throughput picture."""
    _run(tmp_path / "run", steps=1, max_steps=1, final=3.0)
    report.write_report(tmp_path / "run", tmp_path / "out")
    for name in ("throughput.png", "loss.png", "lr.png", "memory.png"):
        drawn_lines = [line for ax in drawn[name].axes for line in ax.lines
                       if len(line.get_xdata()) == 1 and line.get_label() not in _LINE_STYLE]
        assert drawn_lines and all(line.get_marker() not in (None, "", "None") for line in drawn_lines), name
    tokens = drawn["throughput.png"].axes[0].lines[0]
    assert list(tokens.get_xdata()) == [1] and list(tokens.get_ydata()) == [1001.0]


def _legend_names(fig) -> set[str]:
    legends = [*(ax.get_legend() for ax in fig.axes if ax.get_legend()), *fig.legends]
    return {t.get_text() for legend in legends for t in legend.get_texts()}


_RESUMED = ({"kind": "start", "step": 20, "message": "resumed"},)


def test_memory_picture_marks_where_the_run_was_resumed(tmp_path, drawn):
    """A resumed run is a new process: its high-water mark starts over, and the picture says where."""
    _run(tmp_path / "run", steps=40, max_steps=40, final=3.0, events=_RESUMED)
    report.write_report(tmp_path / "run", tmp_path / "out")
    ax = drawn["memory.png"].axes[0]
    marked = {tuple(l.get_xdata())[0]: l.get_label() for l in ax.lines if l.get_label() != "peak memory"}
    assert marked == {20: "resumed"}
    assert _legend_names(drawn["memory.png"]) == {"peak memory", "resumed"}


def test_every_line_of_the_throughput_and_memory_pictures_is_named_in_a_legend(tmp_path, drawn):
    _run(tmp_path / "run", steps=40, max_steps=40, final=3.0, events=_RESUMED)
    report.write_report(tmp_path / "run", tmp_path / "out")
    for name in ("throughput.png", "memory.png"):
        drawn_labels = {l.get_label() for ax in drawn[name].axes for l in ax.lines}
        assert drawn_labels and not any(label.startswith("_") for label in drawn_labels), name
        assert _legend_names(drawn[name]) == drawn_labels, name
    assert _legend_names(drawn["throughput.png"]) == {"tokens/s", "MFU (%)", "resumed"}


def test_guard_promotions_are_marked_as_the_guard_and_re_plan_switches_as_re_planning(tmp_path, drawn):
    """The guard's promotion is a ``format`` record with ``"guard": "promote"``
    (mixprec/monitor/guard.py); the re-planner's has none (replan.py). Both pictures say which."""
    switch = {"kind": "format", "module": "fc", "from": "fp8-tensorwise", "to": "bf16"}
    events = ({**switch, "step": 10, "reason": "underflow", "message": "re-plan"},
              {**switch, "step": 30, "from": "bf16", "to": "fp32", "reason": "SQNR", "guard": "promote",
               "message": "guard promoted fc"})
    _run(tmp_path / "a", steps=40, max_steps=40, final=3.0)
    _run(tmp_path / "b", steps=40, max_steps=40, final=3.0, events=events)
    report.write_report(tmp_path / "b", tmp_path / "out")
    write_comparison([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")
    for name, prefix in (("loss.png", ""), ("compare_loss.png", "b: ")):
        ax = drawn[name].axes[0]
        marked = {tuple(l.get_xdata())[0]: l.get_label() for l in ax.lines if l.get_label() != "peak memory"}
        assert marked == {10: f"{prefix}re-plan", 30: f"{prefix}guard: promoted"}, name


def test_an_overlay_tells_a_runs_resume_from_its_stop_by_line_style(tmp_path, drawn):
    """Overlays draw a run's events in the run's colour; every event was dashed, so a resume and a
    stop of one run were two identical lines told apart only by the legend's order."""
    events = ({"kind": "start", "step": 10, "message": "resumed"},
              {"kind": "interrupted", "step": 20, "message": "stopped by SIGINT at step 20"})
    _run(tmp_path / "a", steps=30, max_steps=30, final=3.0, events=events)
    _run(tmp_path / "b", steps=30, max_steps=30, final=3.0)
    write_comparison([tmp_path / "a", tmp_path / "b"], tmp_path / "cmp")
    ax = drawn["compare_loss.png"].axes[0]
    marks = {l.get_label(): l for l in ax.lines if l.get_label().startswith("a: ")}
    assert set(marks) == {"a: resumed", "a: stopped"}
    resumed, stopped = marks["a: resumed"], marks["a: stopped"]
    assert resumed.get_color() == stopped.get_color()               # the run's colour, both
    assert resumed.get_linestyle() != stopped.get_linestyle()


_HEAT_MODULES = ("wte", "blocks.1.mlp.proj", "head")
_GEMM_SKIP = {"kind": "skip", "step": 20, "module": "blocks.1.mlp.proj", "direction": "backward",
              "tensor": "grad of weight", "made_by": "weight-gradient GEMM", "nonfinite": "inf",
              "message": "step 20 skipped: inf first at blocks.1.mlp.proj (backward, fp16 weight-gradient GEMM)"}


def _heat_run(path, steps=(10, 20), events=()) -> None:
    """A run as ``init_scale=1e12 monitor_every=10`` logs it: at step 10 the head's output gradient
    overflowed (absmax inf, 0.0039 of it), every layer below it got NaN; later steps finite, no overflow."""
    _run(path, steps=max(steps), max_steps=max(steps), final=3.0, events=events)
    bad = {"wte": (math.nan, 1.0), "blocks.1.mlp.proj": (math.nan, 1.0), "head": (math.inf, 0.00390625)}
    with MetricsLogger(path, tensorboard=False, resume_step=max(steps)) as log:    # appends
        for step in steps:
            rows = [{"step": step, "module": m, "kind": "act", "absmax": 1.0 + i, "overflow_frac": 0.0,
                     "underflow_frac": 0.0, "dtype": "fp16"} for i, m in enumerate(_HEAT_MODULES)]
            for m in reversed(_HEAT_MODULES):
                absmax, over = bad[m] if step == 10 else (100.0, 0.0)
                rows.append({"step": step, "module": m, "kind": "grad", "absmax": absmax, "overflow_frac": over,
                             "underflow_frac": 0.0, "dtype": "fp16", "loss_scale": 1024.0})
            log.log_numerics(rows)


def _cell(ax, column: int, module: str) -> tuple[float, float]:
    return (float(column), float([t.get_text() for t in ax.get_yticklabels()].index(module)))


def _cells_drawn(ax, label: str) -> set[tuple[float, float]]:
    """Centres of the squares of the collection labelled ``label`` (nothing when none)."""
    return {tuple(path.vertices[:4].mean(axis=0)) for c in ax.collections if c.get_label() == label
            for path in c.get_paths()}


def test_heat_map_cells_that_held_inf_or_nan_are_drawn_hatched_and_named_in_the_legend(tmp_path, drawn):
    """The head's inf gradient was a blank cell on the absmax map and a black one (0.0039) on the
    overflow map, drawn like any finite value; the NaN below it was blank too."""
    _heat_run(tmp_path / "run")
    report.write_report(tmp_path / "run", tmp_path / "out")
    for name in ("numerics_grad_absmax.png", "numerics_grad_overflow_frac.png"):
        ax = drawn[name].axes[0]
        assert _cells_drawn(ax, "tensor held inf") == {_cell(ax, 0, "head")}, name
        assert _cells_drawn(ax, "tensor held NaN") == {_cell(ax, 0, m) for m in ("wte", "blocks.1.mlp.proj")}, name
        inf, nan = (next(c for c in ax.collections if c.get_label() == label)
                    for label in ("tensor held inf", "tensor held NaN"))
        assert inf.get_hatch() and nan.get_hatch() and inf.get_hatch() != nan.get_hatch(), name
        assert list(inf.get_facecolor()[0]) != list(nan.get_facecolor()[0]), name
        assert {"tensor held inf", "tensor held NaN"} <= _legend_names(drawn[name]), name
    act = drawn["numerics_act_absmax.png"].axes[0]                          # finite throughout: nothing over it
    assert not act.collections and not _legend_names(drawn["numerics_act_absmax.png"])


def test_a_skipped_steps_column_outlines_the_layer_its_trace_named_with_the_gemm_in_the_legend(tmp_path, drawn):
    head = {"kind": "skip", "step": 10, "module": "head", "direction": "backward", "tensor": "grad_output",
            "made_by": None, "nonfinite": "inf", "message": "step 10 skipped: inf first at head"}
    between = {**head, "step": 15}                                          # no logged column: no cell
    _heat_run(tmp_path / "run", events=(head, between, _GEMM_SKIP))
    report.write_report(tmp_path / "run", tmp_path / "out")
    output_label = "skipped step: first inf in this layer's output gradient"
    gemm_label = "skipped step: first inf in this layer's weight-gradient GEMM (not on this map)"
    for name in ("numerics_grad_absmax.png", "numerics_grad_overflow_frac.png"):
        ax = drawn[name].axes[0]
        marks = {line.get_label(): set(zip(line.get_xdata(), line.get_ydata())) for line in ax.lines}
        assert marks == {output_label: {_cell(ax, 0, "head")}, gemm_label: {_cell(ax, 1, "blocks.1.mlp.proj")}}
        assert {output_label, gemm_label} <= _legend_names(drawn[name]), name
    assert not drawn["numerics_act_absmax.png"].axes[0].lines               # backward origins: grad maps only


def test_an_overflow_map_without_overflow_is_drawn_when_a_skipped_step_is_traced_to_a_layer(tmp_path, drawn):
    """Step 20's inf was in a weight-gradient GEMM: every output gradient's overflow is 0, and the
    overflow map, drawn only when some fraction was above 0, was not drawn at all."""
    _heat_run(tmp_path / "run", steps=(20, 30), events=(_GEMM_SKIP,))
    report.write_report(tmp_path / "run", tmp_path / "out")
    ax = drawn["numerics_grad_overflow_frac.png"].axes[0]
    assert [set(zip(line.get_xdata(), line.get_ydata())) for line in ax.lines] == [{_cell(ax, 0, "blocks.1.mlp.proj")}]
    _heat_run(tmp_path / "clean", steps=(20, 30))
    drawn.clear()
    report.write_report(tmp_path / "clean", tmp_path / "out2")
    assert "numerics_grad_overflow_frac.png" not in drawn                   # nothing to show: still skipped


def test_the_gradient_heat_maps_say_they_show_output_gradients_and_what_they_cannot_show(tmp_path, drawn):
    from pathlib import Path

    from mixprec.report.figures import caption
    for stem in ("numerics_grad_absmax", "numerics_grad_overflow_frac"):
        text = caption(Path(f"{stem}.png"))
        assert "output gradients" in text and "weight- or input-gradient GEMM" in text, stem
        assert "hatched cells held inf/NaN" in text and "at logged steps only" in text, stem
    _heat_run(tmp_path / "run")
    report.write_report(tmp_path / "run", tmp_path / "out")
    assert drawn["numerics_grad_absmax.png"].axes[0].get_title().startswith("output gradients:")


def test_a_forward_origin_is_outlined_on_the_activation_maps_not_the_gradient_maps(tmp_path, drawn):
    forward = {"kind": "skip", "step": 20, "module": "blocks.1.mlp.proj", "direction": "forward",
               "tensor": "output", "made_by": None, "nonfinite": "nan", "message": "step 20 skipped: nan first"}
    _heat_run(tmp_path / "run", events=(forward,))
    report.write_report(tmp_path / "run", tmp_path / "out")
    ax = drawn["numerics_act_absmax.png"].axes[0]
    assert {line.get_label(): set(zip(line.get_xdata(), line.get_ydata())) for line in ax.lines} == {
        "skipped step: first nan in this layer's output": {_cell(ax, 1, "blocks.1.mlp.proj")}}
    assert not drawn["numerics_grad_absmax.png"].axes[0].lines
