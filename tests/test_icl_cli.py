"""The in-context chain task from the command line: training a bridge, its reference losses, checkpoints, the
probe over training, and the one-line refusals."""

from __future__ import annotations

import json

import pytest

from rwinterp.cli import main
from rwinterp.runs import checkpoint_dirs, load_run

ICL = ["--task", "icl", "--K", "3", "--N", "16", "--model", "bridge", "--layers", "2", "--d-model", "8",
       "--optimizer", "adamw", "--lr", "5e-3", "--batch-size", "16", "--n-train", "32", "--n-test", "64"]


@pytest.fixture(scope="module")
def icl_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("icl") / "run"
    assert main(["train", *ICL, "--steps", "8", "--eval-every", "4", "--checkpoint-every", "4", "--json",
                 "--out", str(out)]) == 0
    return out


def test_training_reports_the_loss_beside_the_reference_predictors(icl_run, capsys):
    data = json.loads((icl_run / "history.json").read_text())["summary"]
    refs = data["reference_losses"]
    assert set(refs) == {"uniform", "unigram", "bigram"}
    assert refs["uniform"] == pytest.approx(1.0986122886681098, rel=1e-12)  # ln 3
    assert refs["uniform"] > refs["unigram"] > refs["bigram"] and data["test_loss"] > 0
    history = json.loads((icl_run / "history.json").read_text())["history"]
    assert [h["step"] for h in history] == [0, 4, 8]  # evaluated every 4 steps and at the end
    assert main(["train", *ICL, "--steps", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "test loss" in out and "references: uniform 1.0986" in out and "of the unigram-to-bigram gap" in out
    assert out.startswith("task "), out[:80]  # (nothing of TransformerLens' own printing before it)


def test_checkpoints_are_runs_and_the_probe_follows_them(icl_run, tmp_path, capsys):
    steps = [step for step, _ in checkpoint_dirs(icl_run)]
    assert steps == [0, 4, 8]
    first = load_run(checkpoint_dirs(icl_run)[0][1])
    assert first.history[-1]["step"] == 0 and first.task.to_dict()["kind"] == "icl"
    assert main(["probe", str(icl_run), "--out", str(tmp_path / "rep"), "--over-training", "--bootstrap", "0",
                 "--json", "--no-progress"]) == 0
    data = json.loads(capsys.readouterr().out)
    for head in ("L0H0", "L1H0"):
        assert {"previous_token", "induction", "self", "ablation_loss_increase"} <= set(data["heads"][head])
        assert len(data["over_training"]["heads"][head]["induction"]) == 3
    assert data["over_training"]["steps"] == [0, 4, 8]
    assert (tmp_path / "rep" / "over_training.png").is_file()


@pytest.mark.parametrize("args, message", [
    (["--order", "0"], "the order must be an integer >= 1, got 0"),
    (["--concentration", "-1"], "concentration"),
    (["--steps", "4", "--checkpoint-every", "5"], "checkpoint-every 5 is larger than the 4 steps"),
])
def test_bad_icl_input_is_one_line(args, message, tmp_path, capsys):
    assert main(["train", *ICL, "--steps", "4", *args, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_probe_over_training_needs_checkpoints(tmp_path, capsys):
    assert main(["train", *ICL, "--steps", "2", "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["probe", str(tmp_path / "run"), "--out", str(tmp_path / "rep"), "--over-training"]) == 2
    assert "--over-training needs a run with checkpoints" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
