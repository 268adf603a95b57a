"""The reproduction runner: every spec runs in reduced mode, claims are data, runs are shared and
deterministic, and bad input is a one-line error."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import numpy as np
import pytest

from experiments.runner import discover, evaluate_claims, plan, reproduce, select
from experiments.spec import (Claim, Computed, FigureSpec, Record, Results, RunSpec, at_least, at_most, between,
                              binomial_tol, is_true, near, walk_run)
from rwinterp.cli import main
from rwinterp.errors import RwinterpError
from tests.conftest import RTOL, assert_close

PAPER_FIGURES = {"2", "4", "5", "6", "7", "8", "9", "10", "11", "12", "13"}
EXTRA_STUDIES = {"fragility", "theorem31", "lockin", "probes", "readings"}


@pytest.fixture(scope="module")
def reduced_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    return reproduce(["all"], out, reduced=True, progress=False, jobs=2), out


def test_every_figure_and_study_has_a_spec():
    assert PAPER_FIGURES | EXTRA_STUDIES <= set(discover())


@pytest.mark.slow
def test_every_spec_runs_in_reduced_mode_and_writes_its_report(reduced_report):
    rep, out = reduced_report
    assert {f.spec.id for f in rep.figures} == set(discover())
    for fig in rep.figures:
        assert fig.draw_errors == [], (fig.spec.id, fig.draw_errors)
        assert fig.spec.claims, f"figure {fig.spec.id} checks no claim"
        if fig.spec.panels:
            assert (out / fig.image).stat().st_size > 10_000
        for c in fig.claims:
            assert c.error is None, (fig.spec.id, c.claim, c.error)
    claims = json.loads((out / "results.json").read_text())
    assert len(claims) == len(rep.claims) and len(claims) >= 60
    for c in claims:
        assert {"figure", "claim", "expected", "measured", "holds"} <= set(c)
        assert isinstance(c["holds"], bool)
    text = (out / "REPRODUCTION.md").read_text()
    for c in rep.claims:
        assert c.claim.replace("|", "\\|") in text
    assert "REDUCED MODE" in text
    by_figure = text.split("## Every claim")[0]  # the opening table: one row per figure, its claims that hold
    for fig in rep.figures:
        held = sum(c.holds for c in fig.claims)
        verdict = f"all {held}" if held == len(fig.claims) else f"**{held} of {len(fig.claims)}**"
        assert f"| [{fig.spec.id}]({fig.image}): {fig.spec.title} | {verdict} |" in by_figure
        if held < len(fig.claims):  # and why the others do not
            assert (fig.spec.shortfall or "see the claims' notes below") in by_figure
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_claims_marked_for_reduced_mode_hold_there(reduced_report):
    rep, _ = reduced_report
    marked = [(f.spec.id, spec_claim, result) for f in rep.figures
              for spec_claim, result in zip(f.spec.claims, f.claims) if spec_claim.reduced]
    assert len(marked) >= 30
    failing = [(fid, r.claim, r.measured) for fid, c, r in marked if not r.holds]
    assert failing == []


def test_identical_runs_are_trained_once_with_the_union_of_records():
    specs = select(discover(), ["4", "probes"])
    runs, names = plan(specs, reduced=True)
    assert names[("4", "walk")] == names[("probes", "walk_p05")]
    shared = next(r for r in runs if r.key == names[("4", "walk")])
    assert set(shared.users) == {("4", "walk"), ("probes", "walk_p05")}
    assert len(runs) == len(set(names.values()))


def test_runs_spelled_differently_are_one_run_and_a_real_change_is_another():
    task = {"kind": "circle", "K": 6, "p": 0.5, "N": 13}
    terse = RunSpec("a", task, {"pos_dim": 50}, {"lr": 1})
    spelled = RunSpec("b", {**task, "kind": "circle"}, {"pos_dim": 50, "init": "zero", "seed": 0, "n_ctx": 13,
                                                        "kind": "deep"}, {"lr": 1.0, "steps": 50, "seed": 0})
    assert terse.key() == spelled.key() and terse.steps() == 50
    changes = [RunSpec("c", {**task, "p": 0.7}, {"pos_dim": 50}, {"lr": 1}),
               RunSpec("d", task, {"pos_dim": 50, "seed": 1}, {"lr": 1}),
               RunSpec("e", task, {"pos_dim": 50, "rank_one_query": False}, {"lr": 1}),
               RunSpec("f", task, {"pos_dim": 50}, {"lr": 1, "reduction": "sum"})]
    assert len({terse.key()} | {run.key() for run in changes}) == 1 + len(changes)
    specs = [FigureSpec(name, "t", "c", runs=[run]) for name, run in (("x", terse), ("y", spelled))]
    runs, names = plan(specs)
    assert len(runs) == 1 and names[("x", "a")] == names[("y", "b")]
    with pytest.raises(RwinterpError, match="lr must be positive"):
        RunSpec("g", task, {"pos_dim": 50}, {"lr": -1}).key()


def test_same_seed_gives_the_same_numbers(tmp_path):
    a = reproduce(["4"], tmp_path / "a", reduced=True, progress=False)
    b = reproduce(["4"], tmp_path / "b", reduced=True, progress=False)
    assert [c.measured for c in a.claims] == [c.measured for c in b.claims]
    assert (tmp_path / "a" / "results.json").read_text() == (tmp_path / "b" / "results.json").read_text()


def test_reduced_overrides_apply_to_runs_that_have_the_fields():
    run = RunSpec("qa", {"kind": "qa_majority"}, train={"steps": 100}, reduced={"train": {"steps": 7}})
    walk = walk_run("w", 6, 0.5, 97)
    fig = FigureSpec("x", "t", "c", runs=[run, walk], reduced={"task": {"N": 13}, "model": {"pos_dim": 50}})
    qa, w = fig.resolved_runs(reduced=True)
    assert qa.task == {"kind": "qa_majority"} and qa.train["steps"] == 7 and qa.model["pos_dim"] == 50
    assert w.task["N"] == 13
    full = fig.resolved_runs(reduced=False)
    assert full[1].task["N"] == 97 and "pos_dim" not in full[1].model


def test_a_failing_measurement_is_a_claim_that_does_not_hold():
    def broken(results):
        raise KeyError("missing")

    fig = FigureSpec("x", "t", "c", claims=[
        Claim("breaks", Computed(broken), is_true()),
        Claim("nan never holds", Computed(lambda r: math.nan), at_most(1.0)),
        Claim("near", Computed(lambda r: 0.52), near(0.5, binomial_tol(0.5, 1000))),
    ])
    out = evaluate_claims(fig, Results())
    assert [c.holds for c in out] == [False, False, True]
    assert "KeyError" in out[0].error and "measurement failed" in out[0].note
    assert out[1].measured is None
    assert out[2].expected == "0.5 ± 0.04743"
    # The ends of a range and the bounds themselves count as holding.
    assert between(1, 2).holds(1) and between(1, 2).holds(2) and not between(1, 2).holds(2.0001)
    assert at_most(1).holds(1) and at_least(1).holds(1) and near(0.5, 0.1).holds(0.6)


def test_a_claims_measured_explanation_is_added_to_its_note_only_when_it_fails():
    def why(results):
        return f"measured {results['n']}."

    def broken_why(results):
        raise ValueError("no run")

    fig = FigureSpec("x", "t", "c", claims=[
        Claim("holds", Computed(lambda r: 1.0), at_least(1.0), note="context", why=why),
        Claim("fails", Computed(lambda r: 0.0), at_least(1.0), note="context", why=why),
        Claim("fails, its why fails", Computed(lambda r: 0.0), at_least(1.0), why=broken_why),
    ])
    results = Results()
    results["n"] = 3
    out = evaluate_claims(fig, results)
    assert [c.holds for c in out] == [True, False, False]
    assert out[0].note == "context" and out[1].note == "context measured 3."
    assert out[2].error is None and "ValueError: no run" in out[2].note


@pytest.mark.slow
def test_a_terminated_reproduction_leaves_nothing_behind(tmp_path):
    """SIGTERM (kill, a timeout) unwinds like Ctrl-C: the scratch directory of figures goes with it."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "rwinterp.cli", "reproduce", "4", "--reduced", "--jobs", "1",
                             "--out", str(tmp_path / "rr"), "--no-progress"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not any(p.name.startswith(".rr.tmp-") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err.strip()) == (128 + signal.SIGTERM, "rwinterp: terminated"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_at_a_terminal_stops_the_workers_quietly(tmp_path, ctrl_c_handled):
    """Ctrl-C at a terminal reaches the whole process group, training workers included: only this process
    answers it (the workers start with SIGINT blocked and are ended by it), in one line, at once."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "rwinterp.cli", "reproduce", "4", "5", "8", "9", "--jobs", "2",
                             "--out", str(tmp_path / "rr"), "--no-progress"], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    children = f"/proc/{proc.pid}/task/{proc.pid}/children"
    deadline = time.monotonic() + 120
    while len(open(children).read().split()) < 3 and time.monotonic() < deadline:  # the workers are starting
        time.sleep(0.05)
    time.sleep(1.0)  # in the workers' imports: a KeyboardInterrupt there used to print its traceback
    os.killpg(proc.pid, signal.SIGINT)
    start = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (130, "rwinterp: interrupted\n")
    assert time.monotonic() - start < 20  # the workers' runs are not waited for
    assert list(tmp_path.iterdir()) == []


def test_records_merge_steps_and_quantities():
    a, b = Record(("V",), at=(1, 5)), Record(("attention",), at=(5, 9))
    merged = a.merged(b)
    assert merged.quantities == ("V", "attention") and merged.at == (1, 5, 9)
    assert Record(("V",), at=None).merged(a).at is None
    assert merged.wants(9, 20) and merged.wants(20, 20) and not merged.wants(2, 20)


def test_unknown_figures_and_quantities_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(RwinterpError):
        select(discover(), ["99"])
    bad = FigureSpec("x", "t", "c", runs=[walk_run("w", 6, 0.5, 97, record=Record(("no_such",)))])
    with pytest.raises(RwinterpError, match="unknown quantity"):
        plan([bad])
    assert main(["reproduce", "nope", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert capsys.readouterr().err.startswith("rwinterp: error: unknown figure 'nope'")
    cpus = os.cpu_count() or 1
    for jobs in (0, 4 * cpus + 1, 10**6):  # refused before any worker starts
        assert main(["reproduce", "4", "--jobs", str(jobs), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
        assert capsys.readouterr().err.startswith(f"rwinterp: error: --jobs must be between 1 and 4 x the {cpus} "
                                                  f"CPUs, got {jobs}: ")
    assert main(["reproduce", "all", "--list", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == "rwinterp: error: --list takes no figures, --out or --reduced"
    assert not (tmp_path / "o").exists()
    assert main(["reproduce", "--list"]) == 0 and " 13  random initialisation" in capsys.readouterr().out
    # (One process, --jobs 1, from here on: what is checked is the output folder's handling, not the workers.)
    # A folder nothing can be written into is named in the error, not the scratch folder inside it.
    assert main(["reproduce", "2", "--out", "/proc/rwinterp-o", "--jobs", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error: cannot write into /proc: ") and err.count("\n") == 1
    # A directory of something else is refused; a reproduction's is replaced whole, so no figure of an
    # earlier reproduction is left beside a report that no longer lists it.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep").write_text("x")
    assert main(["reproduce", "2", "--out", str(tmp_path / "other"), "--jobs", "1", "--no-progress"]) == 2
    assert "is not a reproduction directory" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["keep"]
    (tmp_path / "other" / "results.json").write_text("[]")
    assert main(["reproduce", "2", "--out", str(tmp_path / "other"), "--jobs", "1", "--no-progress"]) == 2
    assert "holds what a reproduction directory does not (keep)" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["keep", "results.json"]
    out = tmp_path / "repro"
    assert main(["reproduce", "2", "--out", str(out), "--jobs", "1", "--no-progress"]) == 0
    (out / "figXX.png").write_text("stale")
    assert main(["reproduce", "2", "--out", str(out), "--jobs", "1", "--no-progress"]) == 0
    assert not (out / "figXX.png").exists() and (out / "fig02.png").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no scratch left


@pytest.mark.parametrize("offset, slope, answers", [(0.3, 0.01, 1), (-0.3, 0.01, 1), (0.0, 0.2, 2), (0.1, 0.2, 2)])
def test_fig10_diagnostics_recover_the_fruit_margin_line(offset, slope, answers):
    """On scores whose margin f_apple - f_orange is exactly offset + slope (apples - 2.5), the least-squares
    line is recovered, and one answer is given to every list exactly when |offset| > 2.5 |slope|."""
    import torch

    from experiments.spec import RunResult, StepView
    from experiments.specs import fig10
    from rwinterp.qa import QAMajority

    task = QAMajority()
    slots = list(task.parent_positions())

    def model(tokens):
        apples = (tokens[:, slots] == 0).sum(-1).double()
        scores = torch.full((len(tokens), 1, task.n_states), -1.0, dtype=torch.float64)
        scores[:, 0, 0] = 5.0 + offset + slope * (apples - 2.5)
        scores[:, 0, 1] = 5.0
        return scores

    results = Results({"task1": RunResult(None, [], {}, model=model, task=task)})
    assert fig10.margin_line(fig10.list_scores(model, task), task) == pytest.approx((offset, slope), abs=1e-12)
    assert fig10.distinct_answers(results) == answers
    # The per-step quantity (the claim reads its last value) is above 1 exactly when one answer is given.
    dominance = fig10.margin_dominance(StepView(0, model, task, None))
    assert dominance == pytest.approx(abs(offset) / (2.5 * slope), rel=1e-9)
    assert (dominance >= 1) == (answers == 1)
    # Which answers: the fruit that answers more training sentences, or both if the counts are equal.
    for apples, oranges in ((3, 2), (2, 3), (2, 2)):
        results["task1"].train_data = SimpleNamespace(labels=torch.tensor([0] * apples + [1] * oranges))
        follows = answers == 2 if apples == oranges else answers == 1 and (apples > oranges) == (offset > 0)
        assert fig10.answers_follow_label_counts(results, "task1") == follows


@pytest.mark.parametrize("b", [0.5, 1.0])
def test_fig10_score_ratio_exponent_recovers_a_power_law(b):
    """Runs whose mean scores are in the ratio (n_apple / n_orange)^b give the fitted exponent b."""
    import torch

    from experiments.spec import RunResult
    from experiments.specs import fig10
    from rwinterp.qa import QAMajority

    task = QAMajority()

    def model_with(ratio):
        def model(tokens):
            scores = torch.full((len(tokens), 1, task.n_states), -1.0, dtype=torch.float64)
            scores[:, 0, 0], scores[:, 0, 1] = 2.0 * ratio, 2.0
            return scores
        return model

    runs = {}
    for i, (apples, oranges) in enumerate(((6, 4), (3, 5), (7, 2))):
        labels = torch.tensor([0] * apples + [1] * oranges)
        runs[f"r{i}"] = RunResult(None, [], {}, model=model_with((apples / oranges) ** b), task=task,
                                  train_data=SimpleNamespace(labels=labels))
    results = Results(runs)
    assert fig10.score_ratio_exponent(results, list(runs)) == pytest.approx(b, rel=1e-12)
    x, y = fig10.log_ratios(results, list(runs))
    assert list(x) == sorted(x) and y == pytest.approx(b * x, rel=1e-12)


def test_attention_off_the_parent_keeps_its_digits_below_float_resolution():
    """Theorem 3.1's exp(-Omega(N)) off-parent attention is summed term by term: 1 - parent attention
    would round it to 0."""
    from experiments.spec import RunResult
    from experiments.specs.theorem31 import off_parent_attention
    from rwinterp.tasks import CircleWalk

    task = CircleWalk(6, 0.7, 9)
    attention = np.full(9, 1e-40)
    attention[task.parent_positions()[0]] = 1.0 - 8e-40
    results = Results(run=RunResult(walk_run("run", 6, 0.7, 9), [{"step": 0}], {"attention": {0: attention}},
                                    task=task))
    assert 1.0 - results["run"].final["attention"][7] == 0.0
    assert off_parent_attention(results, "run") == pytest.approx(8e-40, rel=1e-12, abs=0)  # (approx's abs is 1e-12)


def test_a_panel_title_wider_than_its_panel_is_wrapped_to_fit():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import _title

    figure, ax = plt.subplots(figsize=(3.2, 2.4))
    _title(ax, "(a1) short", 3.2)
    assert ax.get_title() == "(a1) short"
    text = "(d'1) summed_tuned: variance over walks (step 100)"
    _title(ax, text, 3.2)
    assert ax.get_title().count("\n") == 1 and ax.get_title().replace("\n", " ") == text
    assert ax.title.get_window_extent(figure.canvas.get_renderer()).width <= 0.8 * 3.2 * figure.dpi
    plt.close(figure)


@pytest.mark.parametrize("anchor", [None, (1.2, 0.0)])
def test_a_legend_placed_beside_its_panel_leaves_the_grid_alone(anchor):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import _line
    from experiments.spec import Panel

    options = {"styles": {"b": "o"}} | ({"legend_anchor": anchor} if anchor else {})
    panel = Panel("line", series={"a": lambda r: ([0, 1], [0, 1]), "b": lambda r: ([0, 1], [1, 0])}, options=options)
    figure, ax = plt.subplots()
    _line(ax, panel, Results({}))
    assert ax.get_legend().get_in_layout() == (anchor is None)
    assert ax.get_lines()[1].get_linestyle() == "None" and ax.get_lines()[1].get_marker() == "o"
    plt.close(figure)


def test_tick_legend_and_bar_options():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import _bar, _line
    from experiments.spec import Panel

    figure, (left, right) = plt.subplots(1, 2)
    _line(left, Panel("line", series={"a": lambda r: ([0, 1], [0, 1])}, ylim=(0, 1.6),
                      options={"yticks": [0, 0.5, 1]}), Results({}))
    assert list(left.get_yticks()) == [0, 0.5, 1]
    assert left.get_legend() is None  # one line: no legend by default
    two = {"a": lambda r: ([0, 1], [0, 1]), "b": lambda r: ([0, 1], [1, 0])}
    for legend, drawn in ((None, True), (False, False)):  # the legend option overrides the default
        options = {} if legend is None else {"legend": legend}
        figure_b, ax = plt.subplots()
        _line(ax, Panel("line", series=two, options=options), Results({}))
        assert (ax.get_legend() is not None) == drawn
        plt.close(figure_b)
    _bar(right, Panel("bar", data=lambda r: {"first": 1.0, "second": 2.0}, options={"rotation": 45}), Results({}))
    labels = right.get_xticklabels()
    assert [t.get_text() for t in labels] == ["first", "second"]
    assert all(t.get_rotation() == 45 and t.get_horizontalalignment() == "right" for t in labels)
    plt.close(figure)
    # One bar per position (97): solid bars that touch, on an axis that counts positions from 1.
    figure, ax = plt.subplots()
    _bar(ax, Panel("bar", data=lambda r: np.full(97, 1 / 97)), Results({}))
    bars = ax.patches
    assert len(bars) == 97 and bars[0].get_x() + bars[0].get_width() / 2 == 1 and bars[-1].get_x() == 96.5
    assert all(b.get_width() == 1.0 and b.get_linewidth() == 0 for b in bars)
    plt.close(figure)


def test_a_panels_label_and_reference_lines_can_follow_its_runs():
    """Fig 11's attention panel takes N from its run, so that reduced mode (N = 13) shows 1..13 and a
    uniform line at 1/13, not the full run's 97."""
    from dataclasses import replace

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import _bar, resolved
    from experiments.specs._random_init import READINGS, attention_panel, run_name
    from rwinterp.tasks import CircleWalk

    reading = READINGS[0]
    panel = attention_panel(reading, 0.5, "a")
    results = Results({run_name(reading, 0.5): SimpleNamespace(task=CircleWalk(6, 0.5, 13))})
    assert resolved(panel.xlabel, results) == "position 1..13 (parent N-1 = 12)"
    figure, ax = plt.subplots()
    _bar(ax, replace(panel, data=lambda r: np.full(13, 1 / 13)), results)
    (line,) = ax.get_lines()
    assert list(line.get_ydata()) == [1 / 13, 1 / 13] and line.get_label() == "uniform 1/N"
    plt.close(figure)


def test_shared_scales_zero_based_colours_dashes_and_reference_styles():
    """Panels of one ``share`` group get one value range (a variance of 1e-11 no longer looks like one of
    0.03); ``zero`` puts 0 into a heatmap's colour scale; ``dashes`` lets a curve lying on another show;
    two reference lines differ in style; a 20 x 20 heatmap labels 1, 5, 10, 15, 20."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.plots import _bar, _heatmap, _line, shared_scales
    from experiments.spec import Panel

    tiny = Panel("bar", data=lambda r: np.array([1e-11, 2e-11]), options={"share": "row"})
    large = Panel("bar", data=lambda r: (400, np.array([0.01, 0.03])), options={"share": "row"})
    alone = Panel("bar", data=lambda r: np.array([5.0]))
    shared = shared_scales([tiny, large, alone], Results({}))
    assert shared[0].options["range"] == shared[1].options["range"] == (1e-11, 0.03)
    assert "range" not in shared[2].options
    figure, (left, middle, right) = plt.subplots(1, 3)
    _bar(left, shared[0], Results({}))
    assert left.get_ylim() == pytest.approx((0, 0.0315), rel=RTOL)  # the top, and 5% above it
    _heatmap(middle, Panel("heatmap", data=lambda r: np.full((20, 20), 1.6) + np.eye(20) * 0.01,
                           options={"zero": True}), Results({}))
    assert middle.collections[0].norm.vmin == 0 and middle.collections[0].norm.vmax == pytest.approx(1.61, rel=RTOL)
    assert [t.get_text() for t in middle.get_xticklabels()] == ["1", "5", "10", "15", "20"]
    same = {"a": lambda r: ([0, 1], [0.5, 0.5]), "b": lambda r: ([0, 1], [0.5, 0.5])}
    _line(right, Panel("line", series=same, ref={"x": 0.2, "y": 0.8}, options={"dashes": True, "style": ".-"}),
          Results({}))
    a, b, x, y = right.get_lines()
    assert a.get_linestyle() == "-" and b.get_linestyle() != "-" and b.get_marker() == "."
    assert x.get_linestyle() != y.get_linestyle()
    plt.close(figure)
    figure, ax = plt.subplots()  # ``colours``: a series drawn in another's colour (a seed in its reading's)
    _line(ax, Panel("line", series={**same, "c": same["a"]}, options={"colours": {"c": 0}}), Results({}))
    a, b, c = ax.get_lines()
    assert a.get_color() == c.get_color() != b.get_color()
    plt.close(figure)


def test_qa_seed_counts_tell_ending_at_100_from_passing_through():
    from experiments.spec import RunResult
    from experiments.specs import _qa, fig07, fig10

    def run(*accs):
        return RunResult(None, [{"step": i, "test_accuracy": a} for i, a in enumerate(accs)], {})

    results = Results({"through": run(0.5, 1.0, 1.0, 0.48), "ends": run(0.5, 0.9, 1.0), "never": run(0.5, 0.99)})
    assert _qa.ending_at_one(results, ["through", "ends", "never"]) == 1
    assert _qa.passing_through_one(results, ["through", "ends", "never"]) == 1
    assert _qa.passing_through_one(results, ["ends", "never"]) == 0
    # Every seed (Figs 7 and 10, and Fig 10's balanced seeds) and variant (Fig 10) is a run of the figure, with
    # seed 0 the main run.
    assert _qa.seed_run(0) == "task1"
    assert _qa.seed_run(0, "balanced_") == "balanced_task1" and _qa.seed_run(3, "balanced_") == "balanced_task1_seed3"
    fig10_extra = {fig10.variant_run(v) for v in fig10.VARIANTS} | set(fig10.BALANCED_SEED_RUNS)
    for spec, extra in ((fig07.SPEC, set()), (fig10.SPEC, fig10_extra)):
        names = {r.name for r in spec.runs}
        assert {_qa.seed_run(s) for s in _qa.SEEDS} | extra <= names and len(names) == len(spec.runs)


def test_readings_study_reruns_each_figures_stated_runs_with_one_change_to_the_loss():
    from experiments.specs import readings

    # Each figure's own claims of the paper: all of Figs 4, 5, 8, 9; the two task claims of Figs 7 and 10;
    # the [paper] claims of the random-initialisation figures (not their "why" diagnostics).
    counts = {f: len(fig.claims()) for f, fig in readings.FIGURES.items()}
    assert counts == {"4": 5, "5": 5, "6": 5, "7": 2, "8": 5, "9": 5, "10": 2, "11": 3, "12": 2, "13": 2}
    runs = {r.name: r for r in readings.SPEC.runs}
    assert len(runs) == 13 * len(readings.LOSS_READINGS)  # Figs 6, 7 and 10 train two runs each
    for fig_id, fig in readings.FIGURES.items():
        for original in (r for r in fig.spec.runs if r.name in fig.runs):
            for reading, (_, overrides) in readings.LOSS_READINGS.items():
                run = runs[readings.run_of(fig_id, reading, original.name)]
                for reduced in (False, True):  # reduced mode shrinks the run exactly as its own figure does
                    mine = run.resolved(reduced, readings.SPEC.reduced)
                    theirs = original.resolved(reduced, fig.spec.reduced)
                    assert (mine.task, mine.model) == (theirs.task, theirs.model)
                    assert mine.train == {**theirs.train, **overrides}
                    if not overrides:  # the stated reading is the figure's own run, trained once for both
                        assert mine.key() == theirs.key()


@pytest.mark.slow
def test_worker_processes_give_the_same_numbers_and_figures(tmp_path):
    """Runs trained in two worker processes give the same histories and recorded quantities as one
    process (Fig 13 records quantities that its spec module registers: the workers must know them too),
    and the same workers, drawing, give the same claims and the same PNG, byte for byte (Fig 5)."""
    import numpy as np

    from experiments.runner import draw_figures, execute, worker_pool

    runs, names = plan(select(discover(), ["13", "5"]), reduced=True)
    figures = select(discover(), ["5"])
    for label in ("one", "two"):
        (tmp_path / label).mkdir()
    one = execute(runs, progress=False, jobs=1)
    pool = worker_pool(2)
    try:
        two = execute(runs, progress=False, jobs=2, pool=pool)
        drawn = [draw_figures(figures, names, trained, True, tmp_path / label, p)
                 for label, trained, p in (("one", one, None), ("two", two, pool))]
    finally:
        pool.shutdown()
    assert list(one) == list(two) == [r.key for r in runs]
    for key in one:
        assert one[key].history == two[key].history
        for name, by_step in one[key].snapshots.items():
            for step, value in by_step.items():
                other = two[key].snapshots[name][step]
                if isinstance(value, dict):
                    assert all(np.array_equal(value[k], other[k]) for k in value)
                else:
                    assert np.array_equal(np.asarray(value), np.asarray(other))
    (serial,), (parallel,) = drawn
    assert serial.draw_errors == parallel.draw_errors == [] and serial.image == parallel.image == "fig05.png"
    assert [c.measured for c in serial.claims] == [c.measured for c in parallel.claims]
    assert (tmp_path / "one" / "fig05.png").read_bytes() == (tmp_path / "two" / "fig05.png").read_bytes()
    with pytest.raises(RwinterpError, match="jobs"):
        execute(runs, progress=False, jobs=0)


def test_the_drawing_workers_get_each_figures_results_pickled_before_claims_are_measured(tmp_path):
    """A process pool pickles its arguments later, in a thread of its own; measuring a claim meanwhile
    attaches hooks to the same models (a hook cannot be pickled). So the results go to the pool as bytes."""
    from concurrent.futures import Future

    from experiments.runner import draw_figures

    sent = []

    class Pool:
        def submit(self, fn, *args):
            sent.append(args)
            future = Future()
            future.set_result(fn(*args))
            return future

    figures = select(discover(), ["2"])
    outcomes = draw_figures(figures, {}, {}, True, tmp_path, Pool())
    assert len(sent) == 1 and isinstance(sent[0][1], bytes)
    assert outcomes[0].image == "fig02.png" and (tmp_path / "fig02.png").exists()


def _known_run(name: str, history: list[dict], **snapshots) -> "RunResult":
    from experiments.spec import RunResult
    from rwinterp.tasks import CircleWalk

    return RunResult(walk_run(name, 6, 1.0, 13), history, {k: {history[-1]["step"]: v} for k, v in snapshots.items()},
                     task=CircleWalk(6, 1.0, 13))


def test_fragility_and_lockin_measures_on_known_runs():
    """The studies' measures on runs whose answers are known: the first step above 1/2 accuracy, the
    learned shift of a broken deterministic walk, and the number of seeds locked off the parent."""
    from experiments.specs import fragility, lockin

    accs = [1 / 6, 1 / 6, 0.6, 1.0]
    history = [{"step": s, "test_accuracy": a} for s, a in enumerate(accs)]
    K, N = 6, 13  # two positions per residue class mod K
    attention = np.full(N, 0.01)
    attention[[2, 8]] = 0.45  # positions 3 and 9 (1-indexed), both 3 mod 6: s_N = s_3 + 10 = s_3 + 4 mod 6
    shift_V = np.zeros((K, K))
    shift_V[(np.arange(K) + 4) % K, np.arange(K)] = 1.0
    two_classes = attention.copy()
    two_classes[8], two_classes[9] = 0.01, 0.45  # positions 3 and 10: two residue classes
    results = Results(broke=_known_run("broke", history, attention=attention, V=shift_V),
                      other_shift=_known_run("other_shift", history, attention=attention, V=np.roll(shift_V, 1, 0)),
                      two_classes=_known_run("two_classes", history, attention=two_classes, V=shift_V),
                      never=_known_run("never", history[:2]))
    assert fragility.break_step(results, "broke") == 2 and math.isnan(fragility.break_step(results, "never"))
    assert fragility.learned_shift(results, "broke")
    assert not fragility.learned_shift(results, "other_shift") and not fragility.learned_shift(results, "two_classes")
    assert fragility.broken_runs(results) == ["broke", "other_shift", "two_classes"]
    # Lock-in: seeds whose final parent attention is below 1/2.
    finals = [0.9, 0.2, 0.49, 0.5, 0.99, 0.1]
    locked = Results({lockin.name(1000, s): _known_run(lockin.name(1000, s), [{"step": 6, "parent_attention": a}])
                      for s, a in zip(lockin.SEEDS, finals)})
    assert lockin.locked(locked, 1000) == 3


@pytest.mark.parametrize("rows, divided", [
    ([[0.8, 0.1, 0.1], [0.1, 0.7, 0.2]], True),   # one parent per layer
    ([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]], True),   # both in one layer, each at the threshold
    ([[0.4, 0.9, 0.0], [0.3, 0.2, 0.5]], False),  # s_{N-2} never gets half of a layer
])
def test_depth_order_division_of_the_parents(monkeypatch, rows, divided):
    from experiments.specs import depth_order

    monkeypatch.setattr(depth_order, "parent_rows", lambda results, runs: (np.array(rows), []))
    assert depth_order._divided(Results({}), "run") is divided


def test_recorded_means_over_a_population_weight_each_walk_by_its_probability():
    """On an enumerated population (the test data of population-mode runs) the recorded attention and
    averaged-token statistics are expectations over walks, not plain means over the list of walks."""
    import torch

    from experiments.quantities import averaged_token, averaged_tokens, mean_attention
    from experiments.spec import StepView
    from rwinterp.tasks import CircleWalk
    from tests.conftest import paper_model

    task = CircleWalk(5, 0.8, 7)
    model = paper_model(task, pos_dim=16, init="gaussian", init_sigma=0.5, seed=3)
    pop = task.population()
    w = pop.weights.to(torch.float64)
    assert float(w.max() / w.min()) > 100  # far from uniform
    view = StepView(0, model, task, pop)
    pattern = model.attention(pop.tokens).detach()[:, 0, 0].to(torch.float64)
    assert_close(mean_attention(view), (w[:, None] * pattern).sum(0))
    avg = averaged_tokens(view).to(torch.float64)
    mean = (w[:, None] * avg).sum(0)
    stats = averaged_token(view)
    assert_close(stats["mean"], mean)
    assert_close(stats["var"], (w[:, None] * (avg - mean) ** 2).sum(0), scale=avg**2)
    assert not np.allclose(stats["mean"], avg.mean(0).numpy(), atol=1e-6)  # the plain mean differs
    # Sampled walks (no weights): the plain mean, as before.
    sampled = StepView(0, model, task, task.sample(50, 1))
    assert np.array_equal(mean_attention(sampled), sampled.pattern.mean(0).to(torch.float64).numpy())
