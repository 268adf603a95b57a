"""Saved runs and the command line: round trips, JSON output, one-line errors."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rwinterp.cli import main
from rwinterp.errors import RwinterpError
from rwinterp.runs import load_run, save_run
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, train
from tests.conftest import paper_model

SMALL = ["--K", "5", "--N", "9", "--M", "16", "--steps", "3", "--n-train", "50", "--n-test", "50"]
#: The same on the whole population (which is both the training and the test set: no --n-train, --n-test).
POPULATION = [*SMALL[:-4], "--population"]


def test_save_and_load_give_identical_outputs(tmp_path):
    task = CircleWalk(5, 0.7, 9)
    model = paper_model(task, pos_dim=16, init="gaussian", mlp_width=4, seed=2)
    cfg = TrainConfig(steps=3, lr=0.1, eps=1.0, n_train=40, n_test=40)
    result = train(model, task, cfg, progress=False)
    save_run(tmp_path / "run", model, task, cfg.to_dict(), result.history, {"x": 1})
    run = load_run(tmp_path / "run")
    tokens = task.sample(30, 5).tokens
    assert torch.equal(run.model(tokens), model(tokens))
    assert torch.equal(run.model.W, model.W)
    assert run.history == result.history and run.task.to_dict() == task.to_dict()
    assert not run.model.training
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left
    # Converted after training (as TransformerLens's ``to`` does, cfg.dtype follows): it saves and loads as it is.
    model.to(torch.float32)
    assert model.cfg.dtype == torch.float32
    save_run(tmp_path / "run32", model, task, cfg.to_dict(), result.history, {})
    assert torch.equal(load_run(tmp_path / "run32").model(tokens), model(tokens))


def test_cli_train_json_and_run_directory(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *POPULATION, "--p", "0.7", "--json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("test_accuracy", "bayes_accuracy", "parent_attention", "V", "history", "train_seconds"):
        assert key in data
    assert data["bayes_accuracy"] == 0.7
    assert len(data["V"]) == 5 and len(data["V"][0]) == 5
    assert [h["step"] for h in data["history"]] == [0, 1, 2, 3]
    assert {"loss", "test_accuracy", "parent_attention"} <= set(data["history"][0])
    run = load_run(out)
    assert torch.equal(run.model.V.detach(), torch.tensor(data["V"], dtype=torch.float64))  # JSON keeps every digit
    # Population accuracy is exact: recompute it from the loaded model.
    pop = run.task.population()
    from rwinterp.metrics import accuracy

    assert accuracy(run.model(pop.tokens)[:, 0].detach(), pop.labels, pop.weights) == data["test_accuracy"]
    # Same command, same numbers.
    assert main(["train", *POPULATION, "--p", "0.7", "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["history"] == data["history"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--p", "1.5"], "p must be a number in [0, 1], got 1.5"),
        (["--K", "2"], "a circle needs K >= 3 states (with 2 the +1 and -1 steps coincide), got 2"),
        (["--N", "1"], "N must be an integer >= 2"),
        (["--M", "5"], "M >= N"),
        (["--lr", "0"], "lr must be positive"),
        (["--lr", "inf"], "lr must be positive and finite, got inf"),
        (["--eps", "-1"], "eps must be positive"),
        (["--N", "40", "--M", "64", "--population"], "population mode would enumerate"),
        (["--steps", "x"], "invalid int value"),
        (["--token-norm", "3"], "--token-norm needs --normalize-tokens"),
        (["--no-normalize-query"], "--normalize-query needs --normalize-tokens"),
        (["--normalize-tokens", "--token-norm", "0"], "token norm must be a positive number"),
        (["--act-fn", "linear"], "--act-fn needs --mlp-width"),
        (["--mlp-width", "4"], "an FC layer (mlp width) initialised at zero never trains"),
        (["--model", "deep", "--mlp-width", "4"], "an FC layer (mlp width) initialised at zero never trains"),
        (["--seed", "-1"], "seed must be an integer in [0, 2^63 - 1], got -1"),
        (["--seed", str(2**64)], "seed must be an integer in [0, 2^63 - 1]"),
        (["--task", "lazy", "--initial", "nan"], "--initial values must be finite numbers"),
        (["--task", "regular", "--K", "6", "--graph-seed", "-1"], "the graph seed must be an integer"),
        (["--sigma", "0.1"], "--sigma needs --init gaussian"),
        (["--init", "gaussian", "--sigma", "inf"], "sigma must be a non-negative number, got inf"),
        (["--weight-decay", "inf"], "weight decay must be a non-negative number"),
        (["--batch-size", "10"], "a batch size needs --optimizer sgd or adamw"),
        (["--pe", "learned"], "--pe learned needs --model deep"),
        (["--n-test", "20", "--population"], "--n-test does not apply to --population"),
        (["--n-train", "20", "--population"], "--n-train does not apply to --population"),
        (["--M", "0"], "M (pos_dim) must be an integer >= 1, got 0"),
        (["--steps", str(10**20)], "steps must be an integer in [0, 100000000]"),
        (["--optimizer", "sgd", "--batch-size", "51"], "batch size 51 is larger than the 50 training samples"),
        (["--out", ""], "--out must name a directory"),
        (["--model", "deep", "--d-model", "16"], "d_model applies to added positions"),
        (["--init", "gaussian", "--sigma", "5"], "the loss -log(f_y + eps) is undefined at initialisation"),
        (["--K", "100000000"], "not enough memory"),
        (["--K", "2000", "--M", "100000", "--n-train", "100000"], "not enough memory: this run needs about"),
        (["--unknown"], "unrecognized arguments: --unknown (see rwinterp train --help)"),
    ],
)
def test_cli_bad_input_is_one_line(args, message, capsys):
    argv = ["train", *(POPULATION[:-1] if "--population" in args else SMALL), *args]
    parse_error = "x" in args or "--unknown" in args
    code = pytest.raises(SystemExit, main, argv).value.code if parse_error else main(argv)
    err = capsys.readouterr().err
    assert code == (1 if "undefined" in message else 2)
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_sizes_too_large_to_compute_are_one_line(capsys):
    """A transition matrix whose size overflows torch's storage arithmetic (10^10 x 10^10 states)."""
    argv = ["train", "--task", "torus", "--rows", "100000", "--cols", "100000", "--N", "8", "--M", "16"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error: not enough memory") and err.count("\n") == 1


def test_an_out_that_is_a_link_replaces_the_directory_it_names(tmp_path, capsys):
    assert main(["train", *SMALL, "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    (tmp_path / "link").symlink_to("run")
    assert main(["train", *SMALL, "--steps", "2", "--out", str(tmp_path / "link")]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run"]  # nothing left beside them
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == "run"
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["steps"] == 2


def test_a_bad_out_is_refused_before_the_work(tmp_path, capsys):
    """Nothing is trained or probed, and nothing written, when --out could not take the result."""
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep").write_text("x")
    assert main(["train", *SMALL, "--out", str(tmp_path / "other")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "is not a run directory" in captured.err
    assert main(["train", *SMALL, "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    assert main(["train", *SMALL, "--seed", "1", "--out", str(tmp_path / "run1")]) == 0
    capsys.readouterr()
    for command in (["probe", str(tmp_path / "run")], ["compare", str(tmp_path / "run"), str(tmp_path / "run1")]):
        assert main([*command, "--out", str(tmp_path / "other"), "--no-progress"]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "is not a report directory" in captured.err
    # A folder that merely holds the marker file beside other things is not a run or report: nothing in it is
    # deleted.
    (tmp_path / "other" / "config.json").write_text("{}")
    (tmp_path / "other" / "scores.json").write_text("{}")
    for command, kind in ((["train", *SMALL], "run"), (["probe", str(tmp_path / "run"), "--no-progress"], "report")):
        assert main([*command, "--out", str(tmp_path / "other")]) == 2
        captured = capsys.readouterr()
        assert f"holds what a {kind} directory does not (" in captured.err and captured.out == ""
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["config.json", "keep", "scores.json"]
    assert main(["probe", str(tmp_path / "run"), "--out", str(tmp_path / "r"), "--walks", "51"]) == 2
    assert "--walks 51, but" in capsys.readouterr().err and not (tmp_path / "r").exists()
    # A run the user may not modify (a read-only folder, whose files could not be deleted) is not replaced.
    import rwinterp.atomic

    run = tmp_path / "run"
    real_access = rwinterp.atomic.os.access
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rwinterp.atomic.os, "access", lambda path, mode: Path(path) != run and real_access(path, mode))
        assert main(["train", *SMALL, "--out", str(run)]) == 2
    assert capsys.readouterr().err.strip() == f"rwinterp: error: cannot replace {run}: permission denied"
    assert main(["probe", str(tmp_path / "run"), "--out", str(tmp_path / "r"), "--baseline-models", "3"]) == 2
    assert "--baseline-models needs --baseline random" in capsys.readouterr().err
    # A folder that permissions say is writable but where nothing can be created (root passes os.access
    # everywhere; /proc takes no new folders) is refused before the training, not after it.
    import rwinterp.training

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rwinterp.training, "train", lambda *args, **kwargs: pytest.fail("trained"))
        for command in (["train", *SMALL], ["probe", str(tmp_path / "run"), "--no-progress"]):
            assert main([*command, "--out", "/proc/rwinterp-out"]) == 2
            captured = capsys.readouterr()
            assert captured.out == "" and captured.err.count("\n") == 1
            assert captured.err.startswith("rwinterp: error: cannot write into /proc: ")
    # Nor is anything left of that try where a run was written (tmp_path, for tmp_path / "run").
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


def test_cli_prints_a_huge_V_in_columns_of_fixed_width(capsys):
    """A learning rate that blows V up to 1e299 still prints V as a K x K table (scientific notation),
    the same width as a small V's, not as 300-digit numbers."""
    widths = []
    for lr in ("1", "1e300"):
        assert main(["train", *SMALL, "--lr", lr, "--no-progress"]) == 0
        out = capsys.readouterr().out
        rows = out[out.index("V (f = V X S"):].splitlines()[1:6]
        assert all(len(row.split()) == 5 for row in rows)
        widths.append(max(len(row) for row in rows))
    assert "e+" in rows[0] and widths[1] <= widths[0] + 10


def test_cli_normalisation_and_reduction_reach_the_run(tmp_path, capsys):
    """The random-init readings' options (docs/model.md) go from the flags into the saved run,
    and the run equals the same training done through the library."""
    flags = ["--init", "gaussian", "--normalize-tokens", "--no-normalize-query", "--token-norm", "3", "--reduction", "sum",
             "--lr", "0.01"]
    assert main(["train", *SMALL, *flags, "--json", "--out", str(tmp_path / "run")]) == 0
    data = json.loads(capsys.readouterr().out)
    run = load_run(tmp_path / "run")
    cfg = run.model.cfg
    assert (cfg.normalize_tokens, cfg.normalize_query, cfg.token_norm) == (True, False, 3.0)
    assert data["train"]["reduction"] == "sum"
    task = CircleWalk(5, 0.5, 9)
    model = paper_model(task, pos_dim=16, init="gaussian", normalize_tokens=True, normalize_query=False,
                        token_norm=3.0)
    cfg = TrainConfig(steps=3, lr=0.01, n_train=50, n_test=50, reduction="sum")
    result = train(model, task, cfg, progress=False)
    assert result.history == data["history"]
    assert torch.equal(model.W, run.model.W)
    assert main(["train", *SMALL, *flags, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "init=gaussian(0.01), x~ normalised to length 3 (keys only)" in text and "loss=log (summed)" in text


def test_cli_trains_the_qa_tasks_as_the_library_does(capsys):
    """``--task qa_majority`` / ``qa_order`` are the paper's QA tasks (K = 19, N = 17 / 19), trained exactly as
    the library trains them; options of the walks do not apply to them."""
    from rwinterp.qa import QAMajority

    flags = ["--init", "gaussian", "--normalize-tokens", "--mlp-width", "7", "--M", "40", "--steps", "4",
             "--n-train", "64", "--n-test", "64", "--loss", "xent"]
    assert main(["train", "--task", "qa_majority", *flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["task"] == {"kind": "qa_majority"} and data["bayes_accuracy"] == 1.0
    assert (data["model"]["n_states"], data["model"]["n_ctx"], data["model"]["mlp_width"]) == (19, 17, 7)
    task = QAMajority()
    model = paper_model(task, pos_dim=40, init="gaussian", normalize_tokens=True, mlp_width=7)
    result = train(model, task, TrainConfig(steps=4, n_train=64, n_test=64, loss="xent"), progress=False)
    assert result.history == data["history"]
    assert main(["train", "--task", "qa_order", *flags, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "task        qa_order()" in text and "K=19 N=19" in text and "f = A ReLU(V X S)" in text
    assert "Pi^T" not in text  # no transition matrix to compare V with
    assert main(["train", "--task", "qa_order", *flags, "--act-fn", "linear", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert " mlp=7 linear " in text and "f = A V X S" in text
    # Population mode trains on the two sentences of task 2 with weight 1/2 each: a model that averages
    # tokens (zero init: uniform attention) cannot tell them apart and is exactly at chance.
    assert main(["train", "--task", "qa_order", "--M", "40", "--steps", "2", "--population", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["train"]["population"] and data["test_accuracy"] == 0.5


@pytest.mark.parametrize("args, message", [
    (["--task", "qa_order", "--K", "5"], "--K does not apply to --task qa_order"),
    (["--task", "qa_majority", "--N", "9"], "--N does not apply to --task qa_majority"),
    (["--task", "persistent", "--p", "0.7"], "--p does not apply to --task persistent"),
])
def test_cli_options_that_a_task_does_not_read_are_refused(args, message, capsys):
    assert main(["train", "--steps", "1", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_cli_diverging_loss(capsys):
    code = main(["train", *POPULATION, "--lr", "1e200", "--loss", "squared"])
    err = capsys.readouterr().err
    assert code == 1 and "at step 1" in err and err.count("\n") == 1


def test_unreadable_and_mismatched_runs(tmp_path):
    with pytest.raises(RwinterpError, match="not a run directory"):
        load_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RwinterpError, match="missing config.json"):
        load_run(tmp_path / "empty")
    task = CircleWalk(5, 0.7, 9)
    model = paper_model(task, pos_dim=16)
    run = save_run(tmp_path / "run", model, task, {}, [], {})
    config = json.loads((run / "config.json").read_text())
    config["task"]["K"] = 6
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(RwinterpError, match="mismatched run"):
        load_run(run)
    config["task"]["K"] = 5
    config["model"]["pos_dim"] = 20
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(RwinterpError, match="bad model config in .*: d_model applies to added positions"):
        load_run(run)
    config["model"]["pos_dim"], config["model"]["d_model"] = 20, 25
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(RwinterpError, match="mismatched weights"):
        load_run(run)
    config["model"]["pos_dim"], config["model"]["d_model"] = 16, 21
    (run / "config.json").write_text("{not json")
    with pytest.raises(RwinterpError, match="unreadable"):
        load_run(run)
    run = save_run(tmp_path / "run", model, task, {}, [], {})
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(run / "model.safetensors")), str(run / "model.safetensors"),
              metadata={"rwinterp_config": "{not json"})
    with pytest.raises(RwinterpError, match="its saved config is not JSON"):
        load_run(run)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(RwinterpError, match="not a run directory"):
        save_run(tmp_path / "other", model, task, {}, [], {})


def test_console_module_reports_one_line_errors():
    proc = subprocess.run([sys.executable, "-m", "rwinterp.cli", "train", "--p", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip() == "rwinterp: error: p must be a number in [0, 1], got 2.0"


@pytest.mark.slow  # a fresh Python process imports torch and TransformerLens
def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """Output piped into a reader that has closed the pipe (``| head``) ends the command with status 1
    and nothing on stderr, not with an error about the pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "rwinterp.cli", "train", *SMALL, "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() == 1 and err == ""


def test_signals_ignored_at_start_stay_ignored(capsys):
    """A program started in the background inherits SIGINT ignored (``cmd &`` in a script, ``nohup``) and
    stays immune to Ctrl-C, as every Unix tool does: the command line leaves an ignored signal ignored, and
    a SIGTERM handler someone else installed in place."""
    import signal

    before = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        assert main(["train", *SMALL, "--steps", "1", "--no-progress"]) == 0
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    capsys.readouterr()


@pytest.mark.slow  # a fresh Python process imports torch and TransformerLens
def test_a_command_started_with_ctrl_c_ignored_runs_through_it_to_completion(tmp_path):
    """The command line started with SIGINT ignored, as a shell starts a background job, and sent SIGINT
    every 20 ms from start to end (start-up, imports, training, saving): it finishes as if nothing came."""
    import signal
    import time

    out = tmp_path / "run"
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the child, as from a shell
    try:
        proc = subprocess.Popen([sys.executable, "-m", "rwinterp.cli", "train", *SMALL, "--p", "0.7", "--json",
                                 "--no-progress", "--out", str(out)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    sent = 0
    while proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        sent += 1
        time.sleep(0.02)
    stdout, stderr = proc.communicate()
    assert (proc.returncode, stderr) == (0, "")
    assert sent >= 10  # the interpreter's start alone takes longer than 10 x 20 ms
    assert [h["step"] for h in json.loads(stdout)["history"]] == [0, 1, 2, 3]
    assert load_run(out).history == json.loads(stdout)["history"]


def test_version_and_unknown_top_level_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and re.fullmatch(r"rwinterp \d+\.\d+\.\d+\n", capsys.readouterr().out)
    with pytest.raises(SystemExit) as exit_:
        main(["--bogus"])
    captured = capsys.readouterr()
    assert exit_.value.code == 2 and captured.out == ""
    assert captured.err.strip() == "rwinterp: error: unrecognized arguments: --bogus (see rwinterp --help)"


@pytest.mark.parametrize("args, message", [
    (["--loss", "xent", "--eps", "0.5"], "--eps applies to the paper's loss -log(f_y + eps) (--loss log), "
                                         "not to --loss xent"),
    (["--population", "--optimizer", "adamw", "--batch-size", "8"],
     "population mode trains on the exact expectation, in one full batch: a batch size does not apply"),
])
def test_options_the_training_would_ignore_are_refused(capsys, args, message):
    assert main(["train", "--K", "5", "--N", "6", "--M", "10", "--steps", "1", *args]) == 2
    assert capsys.readouterr().err.strip() == f"rwinterp: error: {message}"
