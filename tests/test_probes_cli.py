"""``rwinterp probe`` and ``rwinterp compare``: files, JSON keys, one-line errors."""

from __future__ import annotations

import json

import pytest

from rwinterp.cli import main
from tests.conftest import RTOL

SMALL = ["--K", "5", "--N", "9", "--M", "16", "--n-train", "200", "--n-test", "80"]
FAST = ["--walks", "60", "--bootstrap", "40", "--gradient-walks", "10", "--no-progress"]
REQUIRED = ["parent_attention", "parent_argmax_rate", "patching.parent_effect", "patching.localization",
            "patching.necessity", "patching.sufficiency", "transition.distance", "transition.cosine",
            "accuracy", "bayes_accuracy"]


def lookup(obj, dotted):
    head, _, rest = dotted.partition(".")
    return obj[head][rest] if rest else obj[head]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe-runs")
    for name, p, steps in (("a", "0.7", "20"), ("b", "1.0", "2")):
        assert main(["train", *SMALL, "--p", p, "--steps", steps, "--no-progress", "--out", str(root / name)]) == 0
    return root


def test_probe_writes_a_report_and_prints_the_scores(runs, capsys):
    out = runs / "report"
    capsys.readouterr()
    assert main(["probe", str(runs / "a"), "--out", str(out), "--baseline", "random", "--baseline-models", "2",
                 "--json", *FAST]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in REQUIRED:
        assert isinstance(lookup(data, key), float), key
        assert key in {"bayes_accuracy"} or isinstance(lookup(data["baseline"], key), float), key
    assert data["bayes_accuracy"] == 0.7 and data["baseline_seeds"] == [1000, 1001]
    files = {p.name for p in out.iterdir()}
    assert files == {"scores.json", "report.md", "transition.png", "attention.png", "patching.png",
                     "trained_vs_random.png", "heads.png"}
    scores = json.loads((out / "scores.json").read_text())
    assert scores["scores"] == {k: v for k, v in data.items() if not k.startswith("baseline") and k != "report"}
    values = scores["baseline"]["values"]["transition"]["distance"]
    assert len(values) == 2 and scores["baseline"]["mean"]["transition"]["distance"] == pytest.approx(
        sum(values) / 2, rel=RTOL)
    # the random models' spread: sample standard deviation, and the interval of the mean between the two values
    assert scores["baseline"]["std"]["transition"]["distance"] == pytest.approx(abs(values[0] - values[1]) / 2 ** 0.5,
                                                                                rel=RTOL)
    low, high = scores["baseline"]["interval"]["transition"]["distance"]
    assert min(values) <= low <= high <= max(values)
    assert data["baseline_spread"]["transition"]["distance"]["interval"] == [low, high]
    report = (out / "report.md").read_text()
    for figure in ("transition.png", "attention.png", "patching.png", "trained_vs_random.png", "heads.png"):
        assert f"]({figure})" in report
    assert report.count("A model that learned the task") >= 2 and "test walks" in report
    assert not [p for p in runs.iterdir() if p.name.startswith(".")]  # no temporary left behind
    # Same command, same numbers; an existing report is replaced.
    assert main(["probe", str(runs / "a"), "--out", str(out), "--json", *FAST]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["patching"] == data["patching"] and "baseline" not in again


@pytest.mark.slow  # three compare reports, every figure drawn
def test_compare_two_runs(runs, capsys):
    out = runs / "ab"
    capsys.readouterr()
    assert main(["compare", str(runs / "a"), str(runs / "b"), "--out", str(out), "--json", *FAST]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["A"]["bayes_accuracy"] == 0.7 and data["B"]["bayes_accuracy"] == 1.0
    assert data["difference"]["accuracy"] == pytest.approx(data["B"]["accuracy"] - data["A"]["accuracy"], rel=RTOL)
    assert {"comparison.png", "a_attention.png", "b_patching.png", "report.md", "scores.json"} <= {
        p.name for p in out.iterdir()}
    # Printed: which run is A and which B, on which task; runs of different tasks are said to differ.
    quick = ["--walks", "20", "--bootstrap", "0", "--gradient-walks", "5", "--no-progress"]
    assert main(["compare", str(runs / "a"), str(runs / "b"), "--out", str(out), *quick]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"A           {runs / 'a'}  (") and "p=0.7" in lines[0] and "20 walks" in lines[0]
    assert lines[1].startswith(f"B           {runs / 'b'}  (") and "p=1" in lines[1]
    assert lines[2].strip() == "(the runs' tasks differ: each is scored on its own task's test data)"
    import shutil

    shutil.copytree(runs / "a", runs / "a-copy", dirs_exist_ok=True)
    assert main(["compare", str(runs / "a"), str(runs / "a-copy"), "--out", str(out), *quick]) == 0
    assert "tasks differ" not in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["probe", "{root}/missing", "--out", "{root}/r1"], "not a run directory"),
    (["probe", "{root}/a", "--out", "{root}/a"], "not a report directory"),
    (["probe", "{root}/a", "--out", "{root}/r2", "--walks", "1"], "--walks must be >= 2"),
    (["probe", "{root}/a", "--out", "{root}/r3", "--baseline-models", "0", "--baseline", "random"],
     "--baseline-models must be in [1, 1000], got 0"),
    (["probe", "{root}/a", "--out", "{root}/r3", "--baseline-models", "100000000", "--baseline", "random"],
     "--baseline-models must be in [1, 1000]"),
    (["probe", "{root}/a", "--out", "{root}/r3", "--seeds", "3", "--baseline", "random"],
     "the number of random models of a baseline is --baseline-models"),
    (["probe", "{root}/a", "--out", "{root}/r4", "--bootstrap", "1"],
     "bootstrap must be 0 (no intervals) or between 40 and 100000 resamples for a 95% interval, got 1"),
    (["probe", "{root}/a", "--out", "{root}/r4", "--bootstrap", "2000000"],
     "bootstrap must be 0 (no intervals) or between 40 and 100000 resamples for a 95% interval, got 2000000"),
    (["probe", "", "--out", "{root}/r5"], "not a run directory: the name is empty"),
    (["probe", "{root}/a", "--out", "{root}/a/report"], "--out {root}/a/report lies inside the run directory"),
    (["compare", "{root}/a", "{root}/b", "--out", "{root}/b/report"], "lies inside the run directory {root}/b"),
    (["probe", "{root}/a", "--out", "{root}/r6", "--gradient-walks", "81"],
     "--gradient-walks 81, but {root}/a is probed on 80 test walks"),
    (["probe", "{root}/a", "--out", "{root}/r6", "--walks", "20", "--gradient-walks", "21"],
     "--gradient-walks 21, but {root}/a is probed on 20 test walks"),
])
def test_bad_input_is_one_line_and_exit_2(runs, capsys, args, message):
    capsys.readouterr()
    assert main([a.format(root=runs) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error:") and message.format(root=runs) in err and err.count("\n") == 1


def test_gradient_walks_do_not_apply_to_a_population_run(tmp_path, capsys):
    """A population run's test data is attributed walk by walk in full: a --gradient-walks count would be
    recorded but not used, so it is refused."""
    run = tmp_path / "pop"
    assert main(["train", "--K", "5", "--N", "6", "--M", "10", "--p", "0.7", "--population", "--steps", "1",
                 "--no-progress", "--out", str(run)]) == 0
    capsys.readouterr()
    assert main(["probe", str(run), "--out", str(tmp_path / "r"), "--gradient-walks", "10", "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (f"rwinterp: error: --gradient-walks does not apply to {run}: its test "
                                               "data is the whole population, and every walk of it is attributed")
    assert main(["probe", str(run), "--out", str(tmp_path / "r"), "--no-progress", "--bootstrap", "0"]) == 0


@pytest.mark.parametrize("corrupt, message", [
    (lambda c: c.update(model=[1]), "'model' must be a JSON object"),
    (lambda c: c.update(train=None), "'train' must be a JSON object"),
    (lambda c: c["model"].update(n_states="5"), "model config field n_states must be a JSON int, got '5'"),
    (lambda c: c["model"].update(seed=-3), "seed must be an integer in [0, 2^63 - 1], got -3"),
    (lambda c: c["model"].update(dtype="float32"), "is torch.float64, the config says torch.float32"),
    ("nan", "non-finite weights in"),
    # The training keys a run records are checked, whatever else it records (a run of another trainer).
    (lambda c: c["train"].update(lr=float("nan"), other_trainer_key=1), "lr must be positive and finite, got nan"),
    (lambda c: c["train"].update(population="false"), "population must be a JSON bool"),
    (lambda c: c["train"].update(n_test=0), "n-test must be an integer >= 1, got 0"),
    # With the config that training saved beside the weights, any edit of config.json is refused.
    (("saved", lambda c: c["task"].update(p=0.5)),
     "config.json was changed after training: task.p is 0.5, the weights were trained with 0.7"),
    (("saved", lambda c: c["train"].update(seed=1)),
     "config.json was changed after training: train.seed is 1, the weights were trained with 0"),
    (("saved", lambda c: c["train"].update(population=0)),
     "config.json was changed after training: train.population is 0, the weights were trained with false"),
])
def test_a_corrupted_run_is_refused_in_one_line(runs, tmp_path, capsys, corrupt, message):
    """Hand-edited or damaged runs: wrong JSON types, seeds out of range, weights of another dtype or with
    NaN in them give a one-line error, never a traceback or plausible-looking scores. The config edits
    are checked on their own on weights without a saved config (as another trainer writes them), and
    with it, where the edit itself is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    run = tmp_path / "run"
    shutil.copytree(runs / "a", run)
    state = load_file(str(run / "model.safetensors"))
    if corrupt == "nan":
        state["blocks.0.attn.W_V"][0, 0, 0] = float("nan")
        save_file(state, str(run / "model.safetensors"))
    else:
        keep_saved, corrupt = corrupt if isinstance(corrupt, tuple) else (None, corrupt)
        if not keep_saved:
            save_file(state, str(run / "model.safetensors"))  # no metadata
        config = json.loads((run / "config.json").read_text())
        corrupt(config)
        (run / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["probe", str(run), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error:") and message in err and err.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_probe_prints_the_scorecard_table_with_the_random_column(runs, tmp_path, capsys):
    """Without --json: the run line, the findings, then one row per headline score with the trained
    value and the random models' mean, the same numbers as scores.json."""
    out = tmp_path / "table"
    capsys.readouterr()
    assert main(["probe", str(runs / "a"), "--out", str(out), "--baseline", "random", "--baseline-models", "2", *FAST]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"run         {runs / 'a'}  (circle(K=5, p=0.7, N=9), 60 walks)"
    findings = [line for line in lines if line.startswith("  - ")]
    assert findings and lines[1:1 + len(findings)] == findings
    rows = {line.split()[0]: line.split()[1:] for line in lines[1 + len(findings):-1]}
    assert lines[-1] == f"report      {out / 'report.md'}"
    saved = json.loads((out / "scores.json").read_text())
    for key in REQUIRED:
        value, label, base = rows[key]
        assert label == "random" and float(value) == pytest.approx(lookup(saved["scores"], key), abs=5e-5)
        values = lookup(saved["baseline"]["values"], key)
        assert float(base) == pytest.approx(sum(values) / len(values), abs=5e-5), key
