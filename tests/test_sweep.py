"""``rwinterp sweep``: a grid of train jobs into one table, on any executor with the same numbers; reuse,
failures, bad input; nothing left behind by a command killed outright."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rwinterp.atomic import proc_stat
from rwinterp.cli import main
from tests.conftest import assert_close

TINY = ["--N", "9", "--M", "16", "--steps", "5", "--n-train", "60", "--n-test", "60", "--no-progress"]
#: The columns that depend on the numbers alone (not on timing or on whether a run was reused).
NUMBERS = ("point", "p", "K", "seed", "test_accuracy", "train_accuracy", "bayes_accuracy", "parent_attention",
           "v_distance", "loss", "test_loss", "final_step", "error", "run")


def table(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "table.jsonl").read_text().splitlines()]


def numbers(out: Path) -> list[dict]:
    return [{k: r.get(k) for k in NUMBERS} for r in table(out)]


def sweep(out: Path, *extra: str, grid=("p=0.1,0.9", "K=5,7"), seeds="0-1", jobs="1") -> int:
    args = ["sweep", *TINY, "--seeds", seeds, "--jobs", jobs, "--out", str(out), *extra]
    for g in grid:
        args += ["--grid", g]
    return main(args)


@pytest.fixture(scope="module")
def inline(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "s"
    assert sweep(out) == 0
    return out


def test_a_tiny_grid_gives_a_row_per_run_equal_to_training_it_alone(inline, capsys):
    rows = table(inline)
    assert [(r["point"], r["p"], r["K"], r["seed"]) for r in rows] == [
        (f"p={p}_K={K}", p, K, s) for p in (0.1, 0.9) for K in (5, 7) for s in (0, 1)]
    assert all(r["status"] == "ok" and r["error"] is None for r in rows)
    header = next(csv.reader(open(inline / "table.csv")))
    assert header[:6] == ["point", "p", "K", "task", "N", "model"]
    assert {"seed", "status", "error", "test_accuracy", "loss", "v_distance", "run"} <= set(header)
    assert (inline / "test_accuracy.png").stat().st_size > 1000
    # Every run is a run like train's, and its numbers are train's for the same setting and seed, alone.
    row = rows[5]  # p=0.9, K=5, seed 1
    assert (inline / row["run"] / "model.safetensors").is_file()
    capsys.readouterr()
    assert main(["train", *TINY, "--p", "0.9", "--K", "5", "--seed", "1", "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    for key in ("test_accuracy", "train_accuracy", "bayes_accuracy", "final_step"):
        assert row[key] == alone[key], key
    for key in ("loss", "test_loss", "parent_attention", "v_distance"):
        assert_close(row[key], alone[key], what=key)


def test_rerunning_the_same_sweep_reuses_its_runs(inline, tmp_path, capsys):
    import shutil

    out = tmp_path / "s"
    shutil.copytree(inline, out)
    before = numbers(out)
    capsys.readouterr()
    assert sweep(out) == 0
    assert capsys.readouterr().out.startswith("8 runs: 0 ok, 8 reused, 0 failed")
    assert numbers(out) == before and {r["status"] for r in table(out)} == {"reused"}
    # A point whose runs are not complete, and one more seed, train again; the others are reused.
    (out / "runs" / "p=0.1_K=7" / "seed-0" / "model.safetensors").unlink()
    assert sweep(out, seeds="0-1", grid=("p=0.1,0.9", "K=5,7", "lr=1.0")) == 0  # another setting: all again
    assert {r["status"] for r in table(out)} == {"ok"}
    assert sweep(out) == 0
    statuses = {(r["point"], r["status"]) for r in table(out)}
    assert statuses == {("p=0.1_K=5", "reused"), ("p=0.1_K=7", "ok"), ("p=0.9_K=5", "reused"),
                        ("p=0.9_K=7", "reused")}
    assert numbers(out) == before


def test_a_failed_job_is_a_row_and_the_rest_of_the_sweep_completes(tmp_path, monkeypatch, capsys):
    import experiments.sweep as sw

    real = sw.run_point

    def fails_at_p01(job):
        if job.values["p"] == 0.1:
            raise RuntimeError("no such luck")
        return real(job)

    monkeypatch.setattr(sw, "run_point", fails_at_p01)
    out = tmp_path / "s"
    assert sweep(out, grid=("p=0.1,0.9",)) == 1
    printed = capsys.readouterr().out
    assert printed.startswith("4 runs: 2 ok, 0 reused, 2 failed\nfailed  p=0.1 seed 0: RuntimeError: no such luck")
    rows = table(out)
    assert [(r["p"], r["status"], r["error"]) for r in rows] == [
        (0.1, "failed", "RuntimeError: no such luck")] * 2 + [(0.9, "ok", None)] * 2
    # A diverging seed is a failed row too (train's message), beside the seeds that trained.
    out = tmp_path / "d"
    assert sweep(out, "--init", "gaussian", "--sigma", "0.1", "--n-train", "50", "--n-test", "50",
                 grid=("p=0.7", "K=5"), seeds="1-3") == 1
    rows = table(out)
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"]
    assert "undefined at initialisation" in rows[1]["error"] and rows[1]["run"] is None
    # The failed job runs again next time; the finished point is reused.
    monkeypatch.setattr(sw, "run_point", real)
    assert sweep(tmp_path / "s", grid=("p=0.1,0.9",)) == 0
    assert [r["status"] for r in table(tmp_path / "s")] == ["ok", "ok", "reused", "reused"]


def test_a_spec_file_is_the_same_sweep(inline, tmp_path):
    spec = tmp_path / "sweep.toml"
    spec.write_text('seeds = "0-1"\n[grid]\np = [0.1, 0.9]\nK = [5, 7]\n'
                    '[settings]\nN = 9\nM = 16\nsteps = 5\nn-train = 60\nn_test = 60\n')
    out = tmp_path / "s"
    assert main(["sweep", "--spec", str(spec), "--jobs", "1", "--out", str(out), "--no-progress"]) == 0
    assert numbers(out) == numbers(inline)


@pytest.mark.parametrize("extra, message", [
    ([], "the grid is empty: give at least one --grid NAME=V1,V2"),
    (["--grid", "p"], "--grid must be NAME=V1,V2,..., got 'p'"),
    (["--grid", "=1"], "--grid must be NAME=V1,V2,..., got '=1'"),
    (["--grid", "p=0.1,,0.5"], "--grid p: an empty value"),
    (["--grid", "p=0.1,0.1"], "--grid p: a value is listed twice"),
    (["--grid", "K=five"], "--grid K: 'five' is not an integer"),
    (["--grid", "p=0.1", "--grid", "p=0.5"], "--grid p is given twice"),
    (["--grid", "nope=1,2"], "unknown setting 'nope': a setting is a train option without its dashes"),
    (["--grid", "seed=1,2"], "the seeds are not a grid setting: give them with --seeds"),
    (["--grid", "p=0.5", "--seeds", "5-2"], "--seeds 5-2: a range runs from its lower seed to its higher one"),
    (["--grid", "p=0.5,1.5"], "grid point p=1.5: "),
    (["--grid", "pe=orthogonal,sine", "--grid", "M=9"], "grid point pe=sine, M=9: sine positional embeddings"),
    (["--grid", "p=0.5", "--address", "127.0.0.1:1"], "--address applies to --executor ray"),
    (["--grid", "p=0.5", "--gpus-per-job", "0.5"], "--gpus-per-job applies to --executor ray"),
    (["--grid", "p=0.5", "--plot", "nope"], "--plot nope: not a score of this sweep"),
    (["--grid", "p=0.5", "--against", "K"], "--against K: not a swept setting (p)"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, extra, message):
    out = tmp_path / "s"
    assert main(["sweep", *TINY, "--jobs", "1", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rwinterp: error: " + message) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_no_gpu_no_ray_cluster_and_a_bad_spec_are_one_line_errors(tmp_path, capsys):
    import torch

    out = tmp_path / "s"
    if not torch.cuda.is_available():
        assert main(["sweep", *TINY, "--grid", "p=0.5", "--device", "cuda", "--out", str(out)]) == 2
        assert capsys.readouterr().err.startswith("rwinterp: error: --device cuda: there is no CUDA GPU here")
    assert main(["sweep", *TINY, "--grid", "p=0.5", "--executor", "ray", "--address", "127.0.0.1:1",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (err.startswith("rwinterp: error: --address 127.0.0.1:1: nothing answers there")
            or err.startswith("rwinterp: error: --executor ray needs Ray")) and err.count("\n") == 1, err
    spec = tmp_path / "bad.toml"
    spec.write_text("[grid\np = 1")
    assert main(["sweep", *TINY, "--spec", str(spec), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"rwinterp: error: --spec {spec} is not TOML: ")
    spec.write_text("[grid]\np = 0.5\n")
    assert main(["sweep", *TINY, "--spec", str(spec), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith(f"rwinterp: error: --spec {spec}: grid.p must be a list of values")
    spec.unlink()
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert main(["sweep", *TINY, "--grid", "p=0.5", "--out", str(tmp_path / "mine")]) == 2
    assert "is not a sweep directory" in capsys.readouterr().err


def test_stale_temporary_directories_of_dead_processes_are_removed(tmp_path):
    from rwinterp.atomic import remove_stale, remove_stale_in

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    for name in (f".a.tmp-{dead}-0123abcd", f".b.tmp-{os.getpid()}-0123abcd", "c", f".d.old-{dead}-89abcdef"):
        (tmp_path / name).mkdir()
    (tmp_path / f".table.csv.tmp-{dead}-0123abcd").write_text("half")
    remove_stale(tmp_path / "a")  # (the siblings of one target only)
    assert not (tmp_path / f".a.tmp-{dead}-0123abcd").exists() and (tmp_path / f".d.old-{dead}-89abcdef").exists()
    remove_stale_in(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".b.tmp-{os.getpid()}-0123abcd", "c"]


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads a zombie's state from /proc")
def test_the_temporary_directory_of_an_ended_process_not_yet_reaped_is_stale(tmp_path):
    """A command killed outright is a zombie until its caller waits for it; the janitor may clean up before that."""
    from rwinterp.atomic import remove_stale_in

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while proc_stat(f"/proc/{child.pid}/stat")[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc_stat(f"/proc/{child.pid}/stat")[0] == "Z"
        (tmp_path / f".a.tmp-{child.pid}-0123abcd").mkdir()
        remove_stale_in(tmp_path)
        assert list(tmp_path.iterdir()) == []
    finally:
        child.wait()


# ---------------------------------------------------------------------------------------- slow tier
@pytest.mark.slow
def test_the_process_pool_gives_the_same_table_as_one_process(inline, tmp_path):
    out = tmp_path / "s"
    assert sweep(out, jobs="2") == 0
    assert numbers(out) == numbers(inline)


@pytest.mark.slow
def test_ray_gives_the_same_table_as_the_process_pool(tmp_path):
    pytest.importorskip("ray")
    grid = ("p=0.1,0.5,0.9", "K=5,7")
    assert sweep(tmp_path / "pool", grid=grid, seeds="0-2", jobs="2") == 0
    assert sweep(tmp_path / "ray", "--executor", "ray", grid=grid, seeds="0-2", jobs="2") == 0
    assert len(table(tmp_path / "ray")) == 18
    assert numbers(tmp_path / "ray") == numbers(tmp_path / "pool")


def _descendants(pid: int, seen: set) -> set:
    """Every process started by ``pid`` so far, added to ``seen`` (children are found through /proc)."""
    from experiments.executors import _process_table

    table = _process_table()
    grown = True
    while grown:
        grown = False
        for child, (parent, _) in table.items():
            if (parent == pid or parent in seen) and child not in seen:
                seen.add(child)
                grown = True
    return seen


def _alive(pids: set) -> set:
    out = set()
    for pid in pids:
        try:
            if proc_stat(f"/proc/{pid}/stat")[0] != "Z":
                out.add(pid)
        except OSError:
            pass
    return out


def _kill_and_check(command: list[str], tmp_path: Path, ready, hidden_in: list[Path],
                    signum: int = signal.SIGKILL) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "rwinterp.cli", *command], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    seen: set = set()
    deadline = time.monotonic() + 180
    while not ready(seen) and time.monotonic() < deadline:
        _descendants(proc.pid, seen)
        time.sleep(0.1)
    assert ready(seen), "the command never got going"
    _descendants(proc.pid, seen)
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == (-signum if signum == signal.SIGKILL else 128 + signum)
    deadline = time.monotonic() + 60
    while _alive(seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80] for pid in _alive(seen)}
    assert left == {}
    for folder in hidden_in:
        assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [] if folder.exists() else True


@pytest.mark.slow
@pytest.mark.parametrize("executor, signum", [("process", signal.SIGKILL), ("ray", signal.SIGKILL),
                                              ("process", signal.SIGTERM), ("ray", signal.SIGTERM)])
def test_a_killed_sweep_leaves_no_process_nor_hidden_directory(tmp_path, executor, signum):
    if executor == "ray":
        pytest.importorskip("ray")
    out = tmp_path / "s"
    command = ["sweep", "--N", "9", "--M", "16", "--steps", "100000", "--grid", "p=0.1,0.5,0.9", "--seeds", "0-1",
               "--jobs", "2", "--executor", executor, "--out", str(out), "--no-progress"]
    # Killed once its workers train (two or more processes besides the janitor).
    _kill_and_check(command, tmp_path, lambda seen: len(seen) >= 3 and (out / "runs").exists(),
                    [tmp_path, out, out / "runs", out / "rows"], signum)
    assert sorted(p.name for p in out.iterdir()) == ["rows", "runs", "sweep.json"]


@pytest.mark.slow
def test_a_killed_reproduction_leaves_no_process_nor_hidden_directory(tmp_path):
    out = tmp_path / "rr"
    command = ["reproduce", "6", "11", "--jobs", "2", "--out", str(out), "--no-progress"]
    _kill_and_check(command, tmp_path, lambda seen: len(seen) >= 3 and any(tmp_path.iterdir()), [tmp_path])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_reproduction_on_ray_gives_the_same_results_and_figure(tmp_path):
    pytest.importorskip("ray")
    from experiments.runner import reproduce

    reproduce(["4"], tmp_path / "one", reduced=True, progress=False, jobs=1)
    reproduce(["4"], tmp_path / "ray", reduced=True, progress=False, jobs=2, executor="ray")
    assert (json.loads((tmp_path / "one" / "results.json").read_text())
            == json.loads((tmp_path / "ray" / "results.json").read_text()))
    assert (tmp_path / "one" / "fig04.png").read_bytes() == (tmp_path / "ray" / "fig04.png").read_bytes()


def test_probe_adds_the_scorecard_of_each_run(tmp_path):
    from probes.scoring import scorecard
    from probes.targets import restrict, run_test_walks
    from rwinterp.runs import load_run

    out = tmp_path / "s"
    assert sweep(out, "--probe", "--walks", "20", "--plot", "score.parent_attention", grid=("p=0.9",), seeds="1") == 0
    (row,) = table(out)
    run = load_run(out / row["run"])
    card = scorecard(run.model, run.task, restrict(run_test_walks(run), 20)).headline()
    assert {k: row[f"score.{k}"] for k in card} == pytest.approx(card, rel=1e-12, nan_ok=True)
    assert (out / "score.parent_attention.png").is_file()


def test_memory_is_checked_for_the_jobs_that_run_side_by_side(tmp_path, monkeypatch, capsys):
    """Two points at once, two seeds each: four models in memory together, refused before anything is written."""
    from rwinterp.config import DeepOptions

    options = DeepOptions(n_states=6, n_ctx=9, pos_dim=16)
    weights, per_sample = (8 * n for n in options.element_counts())
    one = weights + 60 * per_sample  # what one model of TINY needs
    monkeypatch.setattr("rwinterp.training.available_memory", lambda device: 3 * one)
    out = tmp_path / "s"
    assert sweep(out, grid=("p=0.1,0.9",), jobs="2") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rwinterp: error: grid point p=0.1: not enough memory: this run needs about "
                          f"{4 * one / 2**30:.3g} GiB for 4 models, more than the {3 * one / 2**30:.3g} GiB"), err
    assert list(tmp_path.iterdir()) == []
    assert sweep(out, grid=("p=0.1,0.9",), jobs="1") == 0  # one job at a time: two models


@pytest.mark.slow
def test_a_job_whose_worker_is_killed_runs_again_alone_and_is_reported_if_killed_again(tmp_path):
    """A worker that dies breaks the whole process pool: its jobs run again, one at a time in a fresh pool, and
    a job whose worker dies then too is a failed row; the other points of the sweep complete."""
    out = tmp_path / "s"
    proc = subprocess.Popen([sys.executable, "-m", "rwinterp.cli", "sweep", *TINY, "--grid", "steps=5,200000",
                             "--jobs", "2", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    killed: set = set()
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        if (out / "rows" / "steps=5.json").exists():  # the short point is done: kill every worker from now on
            for pid in _alive(_descendants(proc.pid, set())):
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_text()
                except OSError:
                    continue
                if "spawn_main" in cmdline and pid not in killed:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
        time.sleep(0.1)
    printed, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert len(killed) >= 2  # the first pool's and the one the lost job ran in alone
    rows = table(out)
    assert [(r["steps"], r["status"], r["error"]) for r in rows] == [
        (5, "ok", None), (200000, "failed", "its worker process died (killed, or out of memory)")]
    assert "failed  steps=200000 seed 0: its worker process died" in printed
    assert [p.name for p in (out / "runs").iterdir()] == ["steps=5"]


def test_reproduce_refuses_a_missing_gpu_and_options_of_another_executor(tmp_path, capsys):
    import torch

    out = tmp_path / "rr"
    if not torch.cuda.is_available():
        assert main(["reproduce", "4", "--reduced", "--device", "cuda", "--out", str(out), "--no-progress"]) == 2
        assert capsys.readouterr().err.startswith("rwinterp: error: --device cuda: there is no CUDA GPU here")
    assert main(["reproduce", "4", "--address", "127.0.0.1:1", "--out", str(out), "--no-progress"]) == 2
    assert capsys.readouterr().err == "rwinterp: error: --address applies to --executor ray\n"
    assert main(["reproduce", "4", "--executor", "ray", "--gpus-per-job", "2", "--out", str(out)]) == 2
    assert capsys.readouterr().err == "rwinterp: error: --gpus-per-job must be in (0, 1], got 2.0\n"
    assert list(tmp_path.iterdir()) == []
