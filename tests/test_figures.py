"""Figures a reader understands without the code: states and positions counted from 1 as the text
counts them, every parent and every curve visible, a bar of 0 seen, each score's direction and each
run's Bayes accuracy drawn, captions that say what is drawn."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from experiments.plots import SYMLOG_TICKS, _bar, _line, _table, _text, mark_off_scale  # noqa: E402
from experiments.spec import Panel, Results, Table  # noqa: E402
from probes import plots  # noqa: E402
from probes.attention import attention_probe  # noqa: E402
from probes.config import ProbeConfig  # noqa: E402
from probes.patching import patching_probe  # noqa: E402
from probes.scoring import HEADLINE, LEARNED, accuracy_finding, compare, direction, scorecard  # noqa: E402
from probes.transition import transition_probe  # noqa: E402
from rwinterp.chains import PersistentWalk  # noqa: E402
from rwinterp.model import DeepConfig, DeepTransformer  # noqa: E402
from rwinterp.tasks import CircleWalk  # noqa: E402
from tests.conftest import paper_model  # noqa: E402

CFG = ProbeConfig(progress=False, bootstrap=0, gradient_walks=10)


@pytest.fixture
def drawn(monkeypatch):
    """The figures the probe plots draw, in order (each is saved as usual)."""
    figures = []
    save = plots._save

    def keep(fig, path):
        save(fig, path)
        figures.append(fig)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def texts(labels) -> list[str]:
    return [t.get_text() for t in labels]


def test_the_transition_figure_numbers_states_from_1_and_says_whether_it_draws_probabilities(tmp_path, drawn):
    task = CircleWalk(5, 0.7, 9)
    data = task.sample(20, 0)
    caption = plots.plot_transition(transition_probe(paper_model(task, pos_dim=16, init="gaussian", seed=1), task,
                                                     data, CFG), tmp_path / "walk.png")
    maps = [ax for ax in drawn[0].axes if ax.get_xlabel() == "current state"]
    assert len(maps) == 2
    for ax in maps:
        assert texts(ax.get_xticklabels()) == texts(ax.get_yticklabels()) == ["1", "2", "3", "4", "5"]
    assert "raw scores, not probabilities" in maps[1].get_title() and "not probabilities" in caption
    standard = DeepTransformer(DeepConfig.standard(task.n_states, task.seq_len, 8, seed=1))
    caption = plots.plot_transition(transition_probe(standard, task, data, CFG), tmp_path / "standard.png")
    right = [ax for ax in drawn[1].axes if ax.get_xlabel() == "current state"][1]
    assert "as probabilities" in right.get_title() and "as probabilities" in caption
    assert "not probabilities" not in caption


def test_the_attention_figure_marks_every_parent_and_counts_positions_from_1(tmp_path, drawn):
    """A second-order chain has two parents, N-2 and N-1: both are marked in both panels, however
    little attention one of them gets."""
    task = PersistentWalk(5, 0.8, 8)
    model = paper_model(task, pos_dim=16, init="gaussian", seed=1)
    caption = plots.plot_attention(attention_probe(model, task, task.sample(30, 0), CFG), tmp_path / "a.png")
    full, zoom = drawn[0].axes[:2]
    parents = [p + 1 for p in task.parent_positions()]  # 1-indexed: 6 and 7
    assert parents == [6, 7]
    for ax in (full, zoom):
        marked = sorted(float(line.get_xdata()[0]) for line in ax.get_lines() if line.get_linestyle() == "--")
        assert marked == parents
    assert texts(zoom.get_xticklabels())[-3:] == ["6\nN-2", "7\nN-1", "8\nN"]
    red = [t.get_text() for t in zoom.get_xticklabels() if t.get_color() == plots.PARENT]
    assert red == ["6\nN-2", "7\nN-1"]
    assert list(full.get_xticks()) == list(range(1, 9))  # positions 1 .. N, no 0
    assert "positions 6, 7" in caption


def test_the_patching_figure_shows_curves_that_coincide_and_heads_of_zero_effect(tmp_path, drawn):
    """In a trained one-layer paper model patching the embeddings and the values give the same curve:
    both must show, so they differ in style. Every head's bar has a dot at its end, so a bar of 0 is
    seen."""
    task = CircleWalk(5, 0.7, 9)
    model = paper_model(task, pos_dim=16, init="gaussian", seed=1)
    result = patching_probe(model, task, task.sample(30, 0), CFG)
    plots.plot_patching(result, tmp_path / "p.png")
    sweeps, _, heads = drawn[0].axes[:3]
    curves = [line for line in sweeps.get_lines() if line.get_color() != plots.PARENT]
    assert len(curves) == 2
    assert curves[0].get_linestyle() != curves[1].get_linestyle()
    assert curves[0].get_linewidth() > curves[1].get_linewidth()  # the first, wide, shows around the second
    (dots,) = [line for line in heads.get_lines() if line.get_marker() == "o"]
    assert list(np.nan_to_num(dots.get_xdata())) == pytest.approx([bar.get_width() for bar in heads.patches])
    assert len(dots.get_xdata()) == len(heads.patches) == len(heads.get_yticks())


def test_score_bars_mark_direction_zero_and_each_runs_bayes_accuracy(tmp_path):
    rows = [("accuracy", 0.5, (0.45, 0.55), 0.2, (0.15, 0.25)),
            ("transition.distance", 0.2, (0.15, 0.25), 1.4, (1.3, 1.5)),
            ("transition.ones_cosine", 0.7, (math.nan, math.nan), 0.0, (0.0, 0.0))]
    fig = plots.plot_bars(rows, ("A: runs/a", "B: runs/b"), tmp_path / "b.png", "t",
                          references={"accuracy": (0.5, 0.7)}, reference_label="Bayes accuracy")
    ax = fig.axes[0]
    assert texts(ax.get_yticklabels()) == ["accuracy ↑", "transition.distance ↓", "transition.ones_cosine"]
    dots = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert [list(d.get_xdata()) for d in dots] == [[0.5, 0.2, 0.7], [0.2, 1.4, 0.0]]  # the 0 bar has its dot
    bayes = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [float(line.get_xdata()[0]) for line in bayes] == [0.5, 0.7]
    assert texts(ax.get_legend().get_texts()) == ["Bayes accuracy", "A: runs/a", "B: runs/b"]


def test_the_comparison_figure_names_the_runs_and_draws_each_runs_bayes_accuracy(tmp_path, monkeypatch):
    """0.5 against 0.7 reads as the second run better unless each is drawn against its own Bayes."""
    from probes.report import write_compare_report

    figures = []
    draw = plots.plot_bars
    monkeypatch.setattr(plots, "plot_bars", lambda *args, **kwargs: figures.append(draw(*args, **kwargs)))
    cards = []
    for p in (0.5, 1.0):
        task = CircleWalk(5, p, 9)
        cards.append(scorecard(paper_model(task, pos_dim=16, init="gaussian", seed=1), task, task.sample(30, 0), CFG))
    write_compare_report(tmp_path / "cmp", compare(*cards), ("runs/half", "runs/one"))
    ax = figures[0].axes[0]
    legend = texts(ax.get_legend().get_texts())
    assert "A: runs/half" in legend and "B: runs/one" in legend and "Bayes accuracy of each run's task" in legend
    bayes = sorted(float(line.get_xdata()[0]) for line in ax.get_lines() if line.get_linestyle() == "--")
    assert bayes == pytest.approx([0.5, 1.0])
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "| `accuracy` ↑ |" in report and "| `attention.uniformity` ↓ |" in report


def test_every_headline_score_has_a_direction():
    assert set(LEARNED) == set(HEADLINE)
    assert direction("accuracy") == " ↑" and direction("transition.distance") == " ↓"
    assert direction("transition.ones_cosine") == direction("bayes_accuracy") == ""


@pytest.mark.parametrize("interval, exact, says", [
    ((0.483, 0.546), False, "Accuracy 0.511, Bayes 0.500: within sampling error (interval [0.483, 0.546])."),
    ((0.430, 0.470), False, "below it by more than sampling error"),
    ((0.505, 0.560), False, "above it by more than the interval [0.505, 0.560] allows"),
    (None, True, "Accuracy 0.511, Bayes 0.500: 0.011 above it (exact: scored on the whole population)."),
    (None, False, "no interval"),
])
def test_accuracy_beside_bayes_is_worded_by_its_sampling_error(interval, exact, says):
    accuracy = 0.45 if says.startswith("below") else 0.511
    text = accuracy_finding(accuracy, 0.5, interval, exact)
    assert says in text and "best possible" not in text


# ------------------------------------------------------------------------------ reproduction figures
def test_an_all_zero_log_panel_keeps_0_clear_of_the_bottom_and_of_the_first_decade():
    figure, ax = plt.subplots()
    _line(ax, Panel("line", series={"a": lambda r: ([0, 1], [0.0, 0.0]), "b": lambda r: ([0, 1], [0.0, 0.0])},
                    logy=True, options={"dashes": True}), Results({}))
    assert ax.get_yscale() == "symlog" and list(ax.get_yticks()) == list(SYMLOG_TICKS)
    assert min(t for t in ax.get_yticks() if t > 0) >= 1e-12  # no 1e-16 tick glued to the 0 tick
    assert ax.get_ylim()[0] < 0  # the curves at 0 are above the axis line, not under it
    plt.close(figure)


def test_curves_lying_on_each_other_and_on_reference_lines_all_show():
    figure, ax = plt.subplots()
    same = {"a": lambda r: ([0, 1], [0.5, 0.5]), "b": lambda r: ([0, 1], [0.5, 0.5])}
    _line(ax, Panel("line", series=same, ref={"chance": 0.5}, options={"dashes": True}), Results({}))
    first, second, ref = ax.get_lines()
    assert first.get_linewidth() > second.get_linewidth() and first.get_zorder() < second.get_zorder()
    assert ref.get_zorder() < first.get_zorder()
    plt.close(figure)


def test_a_curve_cut_off_by_the_panels_range_is_marked_at_the_edge():
    figure, ax = plt.subplots()
    x = np.arange(5.0)
    _line(ax, Panel("line", series={"a": lambda r: (x, [3.5, 1.1, 1.0, 0.9, 0.8]),
                                    "b": lambda r: (x, [0.5, 0.5, 0.5, 0.5, 0.5])}, ref={"r": 2.0}), Results({}))
    ax.set_ylim(0, 1.3)
    mark_off_scale(ax)
    marks = [c for c in ax.collections if c.get_gid() == "off-scale"]
    assert len(marks) == 1 and marks[0].get_offsets().tolist() == [[0.0, 1.3]]
    assert any("up to 3.5" in t.get_text() for t in ax.texts)
    plt.close(figure)


def test_a_bar_of_zero_has_a_dot():
    figure, ax = plt.subplots()
    _bar(ax, Panel("bar", data=lambda r: {"random": 0.0, "trained": 1.0}), Results({}))
    (dots,) = ax.collections
    assert dots.get_offsets().tolist() == [[0.0, 0.0], [1.0, 1.0]]
    plt.close(figure)


def test_text_panels_use_the_figures_font_and_tables_are_tables():
    figure, (left, right) = plt.subplots(1, 2)
    _text(left, Panel("text", data=lambda r: "summed: 2/5 claims hold"), Results({}))
    assert "monospace" not in left.texts[0].get_fontfamily()
    _table(right, Panel("table", data=lambda r: Table(["run", "layer"], [["two-s0", 1]], "a note")), Results({}))
    cells = right.tables[0].get_celld()
    assert [cells[0, 0].get_text().get_text(), cells[1, 1].get_text().get_text()] == ["run", "1"]
    assert right.texts[0].get_text() == "a note"
    plt.close(figure)


def _panel_strings(panel: Panel) -> list[str]:
    out = [panel.title, panel.ylabel, *panel.ref, *panel.series]
    out += [panel.xlabel] if isinstance(panel.xlabel, str) else []
    for key in ("xticklabels", "yticklabels", "ticklabels"):
        out += [str(v) for v in panel.options.get(key, [])]
    return out


def test_figure_text_writes_subscripts_as_mathtext_and_counts_columns_from_1():
    """``s_{N-1}`` outside ``$...$`` is drawn literally; V[:,0] would count V's columns from 0."""
    import re

    from experiments.runner import discover

    for spec in discover().values():
        strings = [spec.caption] + [s for panel in spec.panels for s in _panel_strings(panel)]
        for text in strings:
            plain = re.sub(r"\$[^$]*\$", "", text)
            assert "_{" not in plain and "^{" not in plain, (spec.id, text)
            assert "[:,0]" not in text.replace(" ", ""), (spec.id, text)
