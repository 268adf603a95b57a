"""``rwinterp probe`` and ``rwinterp compare``: files, JSON keys, one-line errors."""

from __future__ import annotations

import json

import pytest

from rwinterp.cli import main

SMALL = ["--K", "5", "--N", "9", "--M", "16", "--n-train", "200", "--n-test", "80"]
FAST = ["--walks", "60", "--bootstrap", "20", "--gradient-walks", "10", "--no-progress"]
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
    assert main(["probe", str(runs / "a"), "--out", str(out), "--baseline", "random", "--seeds", "2",
                 "--json", *FAST]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in REQUIRED:
        assert isinstance(lookup(data, key), float), key
        assert key in {"bayes_accuracy"} or isinstance(lookup(data["baseline"], key), float), key
    assert data["bayes_accuracy"] == 0.7 and data["baseline_seeds"] == [1000, 1001]
    files = {p.name for p in out.iterdir()}
    assert files == {"scores.json", "report.md", "transition.png", "attention.png", "patching.png",
                     "trained_vs_random.png"}
    scores = json.loads((out / "scores.json").read_text())
    assert scores["scores"] == {k: v for k, v in data.items() if not k.startswith("baseline") and k != "report"}
    assert len(scores["baseline"]["values"]["accuracy"]) == 2
    report = (out / "report.md").read_text()
    for figure in ("transition.png", "attention.png", "patching.png", "trained_vs_random.png"):
        assert f"]({figure})" in report
    assert report.count("A model that learned the task") >= 2 and "test walks" in report
    assert not [p for p in runs.iterdir() if p.name.startswith(".")]  # no temporary left behind
    # Same command, same numbers; an existing report is replaced.
    assert main(["probe", str(runs / "a"), "--out", str(out), "--json", *FAST]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["patching"] == data["patching"] and "baseline" not in again


def test_compare_two_runs(runs, capsys):
    out = runs / "ab"
    capsys.readouterr()
    assert main(["compare", str(runs / "a"), str(runs / "b"), "--out", str(out), "--json", *FAST]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["A"]["bayes_accuracy"] == 0.7 and data["B"]["bayes_accuracy"] == 1.0
    assert data["difference"]["accuracy"] == pytest.approx(data["B"]["accuracy"] - data["A"]["accuracy"])
    assert {"comparison.png", "a_attention.png", "b_patching.png", "report.md", "scores.json"} <= {
        p.name for p in out.iterdir()}


@pytest.mark.parametrize("args, message", [
    (["probe", "{root}/missing", "--out", "{root}/r1"], "not a run directory"),
    (["probe", "{root}/a", "--out", "{root}/a"], "not a report directory"),
    (["probe", "{root}/a", "--out", "{root}/r2", "--walks", "1"], "--walks must be >= 2"),
    (["probe", "{root}/a", "--out", "{root}/r3", "--seeds", "0", "--baseline", "random"], "--seeds must be >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(runs, capsys, args, message):
    capsys.readouterr()
    assert main([a.format(root=runs) for a in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error:") and message in err and err.count("\n") == 1
