"""Scores across runs: ``rwinterp probe GROUP``, ``rwinterp compare GROUP_A GROUP_B`` and :mod:`probes.group`.

The group's numbers are checked against each run probed alone (the per-run values are the single-run probe's,
their mean is those values averaged), the intervals against a hand computation and their own properties.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil

import pytest
import torch
from transformer_lens.utilities.statistics import bootstrap_ci, derive_generator

from probes.config import ProbeConfig
from probes.group import compare_groups, score_group
from probes.scoring import compare_to_random, scorecard
from probes.stats import RUN_RESAMPLES, Estimate
from probes.targets import restrict, run_test_walks
from rwinterp.cli import main
from rwinterp.runs import load_group, load_run
from tests.conftest import assert_close

SMALL = ["--K", "5", "--N", "9", "--M", "16", "--n-train", "200", "--n-test", "60", "--no-progress"]
FAST = ["--walks", "30", "--bootstrap", "40", "--gradient-walks", "10", "--no-progress"]
HEADLINE = ["accuracy", "parent_attention", "parent_argmax_rate", "patching.parent_effect", "patching.localization",
            "transition.distance", "transition.cosine"]


def lookup(obj, dotted):
    head, _, rest = dotted.partition(".")
    return obj[head][rest] if rest else obj[head]


def probe_json(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(["probe", *map(str, args), "--json", *FAST]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys, args) -> str:
    capsys.readouterr()
    assert main([str(a) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error:") and err.count("\n") == 1, err
    return err


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("groups")
    assert main(["train", *SMALL, "--steps", "20", "--seeds", "0-2", "--out", str(root / "g")]) == 0
    assert main(["train", *SMALL, "--steps", "2", "--seeds", "3-4", "--out", str(root / "early")]) == 0
    assert main(["train", *SMALL, "--p", "0.7", "--steps", "2", "--out", str(root / "other")]) == 0
    return root


CONFIG = ProbeConfig(bootstrap=40, gradient_walks=10, progress=False)  # what FAST asks for


@pytest.fixture(scope="module")
def probed(root):
    """The group probed with a random baseline (as JSON), and each of its runs probed alone, as `rwinterp probe
    RUN` does it: its scorecard on its first 30 test walks."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["probe", str(root / "g"), "--out", str(root / "report"), "--baseline", "random",
                     "--baseline-models", "2", "--json", *FAST]) == 0
    group = json.loads(out.getvalue())
    singles = []
    for seed in (0, 1, 2):
        run = load_run(root / "g" / f"seed-{seed}")
        card = scorecard(run.model, run.task, restrict(run_test_walks(run), 30), CONFIG)
        singles.append((run, card))
    return group, singles


# ------------------------------------------------------------------------------ the statistics alone
def test_estimate_is_the_mean_with_a_seeded_interval_over_runs():
    values = [0.13, 0.52, 0.31, 0.77, 0.98, 0.24, 0.66, 1.49]
    e = Estimate.of(values)
    assert e.values == values and e.mean == math.fsum(values) / 8
    assert_close(e.mean, 5.1 / 8)
    lo, hi = bootstrap_ci(torch.tensor(values, dtype=torch.float64), n_resamples=RUN_RESAMPLES,
                          generator=derive_generator(0, "run-bootstrap"))
    assert e.interval == (float(lo), float(hi))
    assert min(values) <= e.interval[0] < e.mean < e.interval[1] <= max(values)
    assert Estimate.of(values).interval == e.interval  # deterministic
    assert Estimate.of(values, seed=1).interval != e.interval  # the seed matters
    assert Estimate.of(values, confidence=0.5).interval[1] < e.interval[1]


def test_undefined_values_are_left_out_and_one_run_has_no_interval():
    e = Estimate.of([0.5, math.nan, 1.0])
    assert e.mean == 0.75 and e.interval[0] < 0.75 < e.interval[1]
    one = Estimate.of([0.5, math.nan])
    assert one.mean == 0.5 and all(math.isnan(v) for v in one.interval)
    assert one.to_dict() == {"values": [0.5, math.nan], "mean": 0.5, "interval": [math.nan, math.nan]}
    assert math.isnan(Estimate.of([math.nan]).mean)


def test_paired_and_independent_differences():
    a, b = Estimate.of([1.0, 2.0, 4.0]), Estimate.of([0.5, 1.0, 3.0])
    d = Estimate.paired(a, b)
    assert d.values == [0.5, 1.0, 1.0] and d.mean == 2.5 / 3
    assert d.interval == Estimate.of([0.5, 1.0, 1.0]).interval and d.interval[0] <= d.mean <= d.interval[1]
    same = Estimate.difference(a, a)
    assert same.mean == 0.0 and same.interval[0] < 0.0 < same.interval[1]
    apart = Estimate.difference(Estimate.of([0.0, 0.125]), Estimate.of([1.0, 1.125]))
    assert apart.mean == 1.0 and 0.875 <= apart.interval[0] < 1.0 < apart.interval[1] <= 1.125
    assert math.isnan(Estimate.difference(a, Estimate.of([1.0])).interval[0])


# ------------------------------------------------------------------------------ probe GROUP
def test_group_values_are_the_single_run_probes_and_the_mean_their_average(probed):
    group, singles = probed
    assert group["baseline_seeds"] == [[1000, 1001], [1002, 1003], [1004, 1005]]  # every run its own random models
    assert group["n_runs"] == 3 and group["seeds"] == [0, 1, 2] and group["n_walks"] == [30, 30, 30]
    flats = [card.flat() for _, card in singles]
    for key in HEADLINE:
        score = lookup(group["scores"], key)
        assert score["values"] == [f[key] for f in flats], key
        assert score["mean"] == math.fsum(score["values"]) / 3, key
        assert_close(score["mean"], sum(f[key] for f in flats) / 3, what=key)
        lo, hi = score["interval"]  # a resample's mean of equal values may differ from them in the last bit
        slack = 1e-12 * max(abs(v) for v in score["values"])
        assert min(score["values"]) - slack <= lo <= score["mean"] <= hi <= max(score["values"]) + slack, key
    head = group["scores"]["heads"]["L0H0"]
    for name in ("previous_token", "induction", "self", "parent"):
        assert head[name]["values"] == [f[f"heads.L0H0.{name}"] for f in flats], name
    assert head["ablation_loss_increase"]["values"] == [card.scores()["heads"]["L0H0"]["ablation_loss_increase"]
                                                        for _, card in singles]
    assert len(set(group["scores"]["accuracy"]["values"])) > 1  # the runs do differ


def test_random_baseline_and_the_paired_difference(probed):
    group, singles = probed
    for key in HEADLINE:
        score = lookup(group["scores"], key)
        assert score["difference"]["values"] == [t - r for t, r in zip(score["values"], score["random"]["values"])]
        assert score["difference"]["mean"] == math.fsum(score["difference"]["values"]) / 3
    # Each run's random value: the mean over its own random models (seeds 1000 + 2i, 1001 + 2i) on its walks.
    for i, (run, card) in enumerate(singles):
        data = restrict(run_test_walks(run), 30)
        alone = compare_to_random(run.model, run.task, data, group["baseline_seeds"][i], CONFIG, trained=card)
        for key in HEADLINE:
            values = [c.flat()[key] for c in alone.baselines]
            assert_close(lookup(group["scores"], key)["random"]["values"][i], sum(values) / 2, what=key)
    # Trained against random: the attention on the parent is far above it in every run.
    d = group["scores"]["parent_attention"]["difference"]
    assert min(d["values"]) > 0.5 and d["interval"][0] > 0.5


def test_group_json_keys_and_report_files(probed, root):
    group, _ = probed
    assert set(group) == {"runs", "seeds", "task", "model", "kind", "n_runs", "n_walks", "confidence", "resamples",
                          "baseline_models", "baseline_seeds", "scores", "report"}
    assert group["runs"] == [str(root / "g" / f"seed-{s}") for s in (0, 1, 2)] and group["baseline_models"] == 2
    for key in HEADLINE:
        score = lookup(group["scores"], key)
        assert set(score) == {"values", "mean", "interval", "random", "difference"}, key
        assert set(score["random"]) == set(score["difference"]) == {"values", "mean", "interval"}
    assert set(group["scores"]["heads"]) == {"L0H0", "chance"}
    out = root / "report"
    files = {p.name for p in out.iterdir()}
    figures = {f"runs_{f}.png" for f in ("overview", "attention", "patching", "transition", "heads", "ablation")}
    assert files == {"scores.json", "report.md"} | figures
    saved = json.loads((out / "scores.json").read_text())
    assert saved["scores"] == group["scores"] and saved["findings"]
    report = (out / "report.md").read_text()
    assert all(f"]({f})" in report for f in figures) and "bootstrap over the runs" in report
    assert "trained - random [interval]" in report and "Each dot is one value of the score" in report
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_group_table_printed(root, capsys):
    capsys.readouterr()
    assert main(["probe", str(root / "early"), "--out", str(root / "early-report"), *FAST]) == 0
    text = capsys.readouterr().out
    assert "2 runs (seeds 3, 4), circle(K=5, p=0.5, N=9), 30 test walks each" in text
    assert "mean [95% interval]" in text and "random [95% interval]" not in text
    row = next(line for line in text.splitlines() if line.startswith("parent_attention ↑"))
    mean, lo, hi = (float(v.strip("[],")) for v in row.split()[2:5])
    assert lo <= mean <= hi


def test_one_run_has_an_undefined_interval(tmp_path, capsys):
    assert main(["train", *SMALL, "--steps", "2", "--seeds", "7", "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    assert main(["probe", str(tmp_path / "one"), "--out", str(tmp_path / "r"), *FAST]) == 0
    text = capsys.readouterr().out
    assert "1 run (seed 7)" in text and "intervals undefined: one run" in text and "[undefined]" in text
    saved = json.loads((tmp_path / "r" / "scores.json").read_text())
    assert saved["n_runs"] == 1 and saved["scores"]["accuracy"]["interval"] == [None, None]
    assert saved["scores"]["accuracy"]["mean"] == saved["scores"]["accuracy"]["values"][0]
    assert "intervals: undefined (one run" in (tmp_path / "r" / "report.md").read_text()


# ------------------------------------------------------------------------------ compare GROUP_A GROUP_B
def test_compare_a_group_with_itself_gives_zero(root):
    runs = load_group(root / "g")
    group = score_group([r.model for r in runs], [r.task for r in runs],
                        [restrict(run_test_walks(r), 30) for r in runs], CONFIG)
    result = compare_groups(group, group)
    assert set(result.difference) == set(group.scores)
    for key in result.keys():
        d = result.difference[key]
        assert d.mean == 0.0, key
        lo, hi = d.interval
        assert lo <= 0.0 <= hi, key
    lo, hi = result.difference["accuracy"].interval
    assert lo < 0.0 < hi  # the two resamplings differ: the interval has a width
    assert result.to_json()["difference"]["heads"]["L0H0"]["previous_token"]["mean"] == 0.0


def test_compare_two_groups(root, capsys):
    capsys.readouterr()
    assert main(["compare", str(root / "g"), str(root / "early"), "--out", str(root / "ge"), "--json", *FAST]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"A", "B", "difference", "report"}
    assert data["A"]["n_runs"] == 3 and data["B"]["seeds"] == [3, 4]
    for key in HEADLINE:
        a, b, d = (lookup(data[k] if k == "difference" else data[k]["scores"], key) for k in ("A", "B", "difference"))
        assert set(d) == {"mean", "interval"} and d["mean"] == b["mean"] - a["mean"], key
    d = data["difference"]["parent_attention"]
    assert d["interval"][0] <= d["mean"] <= d["interval"][1] < 0  # 20 steps attend to the parent, 2 do not
    assert json.loads((root / "ge" / "scores.json").read_text())["difference"] == data["difference"]
    assert {p.name for p in (root / "ge").iterdir()} >= {"scores.json", "report.md", "runs_overview.png"}
    assert "B - A [interval]" in (root / "ge" / "report.md").read_text()


# ------------------------------------------------------------------------------ refused
def test_bad_groups_are_refused_in_one_line(root, tmp_path, capsys):
    g = root / "g"
    err = refused(capsys, ["probe", g / "seed-0", root / "other", "--out", tmp_path / "x", *FAST])
    assert "the runs are not comparable: task.p is 0.7 in" in err
    assert main(["train", *SMALL, "--M", "12", "--steps", "2", "--out", str(tmp_path / "m12")]) == 0
    err = refused(capsys, ["probe", g, tmp_path / "m12", "--out", tmp_path / "x", *FAST])
    assert f"the runs are not comparable: model.d_model is 17 in {tmp_path / 'm12'} but 21 in" in err
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    err = refused(capsys, ["probe", tmp_path / "junk", "--out", tmp_path / "x"])
    assert "not a run directory nor a group of runs" in err and "group.json" in err
    assert "named twice" in refused(capsys, ["probe", g, g / "seed-1", "--out", tmp_path / "x"])
    err = refused(capsys, ["probe", g, "--out", tmp_path / "x", "--seeds", "3", "--baseline", "random"])
    assert "--baseline-models" in err
    assert "--over-training" in refused(capsys, ["probe", g, "--over-training", "--out", tmp_path / "x"])
    assert "share runs" in refused(capsys, ["compare", g, g / "seed-0", "--out", tmp_path / "x"])
    err = refused(capsys, ["compare", g, tmp_path / "junk", "--out", tmp_path / "x"])
    assert "not a run directory nor a group of runs" in err
    assert not (tmp_path / "x").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_seed_that_did_not_finish_is_left_out_and_said_so(root, tmp_path, capsys):
    group = tmp_path / "g"
    shutil.copytree(root / "early", group)
    index = json.loads((group / "group.json").read_text())
    shutil.rmtree(group / "seed-4")
    index["runs"][1] = {"seed": 4, "run": None, "error": "the loss diverged at step 2"}
    (group / "group.json").write_text(json.dumps(index))
    capsys.readouterr()
    assert main(["probe", str(group), "--out", str(tmp_path / "r"), "--json", *FAST]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["seeds"] == [3] and json.loads(out)["runs"] == [str(group / "seed-3")]
    assert err == f"rwinterp: seed 4 of {group} did not finish training (the loss diverged at step 2); it is left out\n"
