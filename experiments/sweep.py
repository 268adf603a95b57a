"""``rwinterp sweep``: train (and probe) a grid of settings, a group of seeds at each point, into one table.

A sweep is the product of its grid (``--grid p=0.1,0.5,0.9 --grid K=5,7``, or a TOML file, ``--spec``)
times its seeds (``--seeds 0-4``). Every other option is ``rwinterp train``'s and applies to every run; a
setting's name is its ``train`` option (``p``, ``K``, ``N``, ``M``, ``d-model``, ``layers``, ``lr``,
``steps`` ...), its type and default come from :mod:`rwinterp.config` through that option.

Each grid point is one job: its seeds train in one batched computation
(:func:`rwinterp.cli.train_seed_group`) and are saved as a seed group, ``OUT/runs/POINT/seed-S`` beside its
``group.json`` (written atomically); with ``--probe`` each seed's scorecard adds its headline scores. Jobs
run on an executor (:mod:`experiments.executors`: this machine's processes, or Ray), which does not change
the numbers. The outcome:

* ``OUT/table.csv``, ``OUT/table.jsonl`` (and ``OUT/table.parquet`` where pyarrow is installed): a row
  per run, with the point, its settings, the seed, the status (``ok``, ``failed`` or ``reused``), the
  error, the final scores of training and, with ``--probe``, the probes' scores;
* ``OUT/SCORE.png``: a score against a swept setting, the mean over seeds with its 95% bootstrap interval;
* ``OUT/sweep.json`` (what was asked) and ``OUT/rows/POINT.json`` (each finished point's rows).

A job that fails (an error, its worker killed) is a ``failed`` row with its error; the other jobs go on.
Running the same sweep into the same ``OUT`` again reuses every point whose runs are complete and whose
settings are the same (``reused`` rows), and trains only the others.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from experiments.executors import add_executor_options
from rwinterp.cli import TRAIN, Command, build_train_setup, check_train_options
from rwinterp.atomic import atomic_file
from rwinterp.config import parse_seeds
from rwinterp.errors import RwinterpError, require

#: What a sweep directory holds (its marker first).
SWEEP_FILES = ("sweep.json", "table.csv", "table.jsonl", "table.parquet", "*.png", "runs/", "rows/")
#: ``train`` options that are not settings of a run.
NOT_SETTINGS = {"help", "seeds", "seed", "out", "device", "threads", "json", "no_progress"}
#: The columns of a run's final training record (:func:`rwinterp.cli.run_summary`), in the table's order.
SUMMARY_COLUMNS = ("test_accuracy", "train_accuracy", "bayes_accuracy", "parent_attention", "v_distance", "loss",
                   "test_loss", "final_step", "train_seconds")
STATUSES = ("ok", "failed", "reused")
#: The error of a job whose worker died: such a job runs again alone before it is reported failed.
WORKER_DIED = "its worker process died (killed, or out of memory)"


# ---------------------------------------------------------------------------------------- settings
def settings_of(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every setting a grid may sweep, by name: ``train``'s options (``--d-model`` is ``d-model``)."""
    out = {}
    for action in parser._actions:  # (argparse keeps no public list)
        if action.dest in NOT_SETTINGS or not action.option_strings:
            continue
        for flag in action.option_strings:
            if flag.startswith("--") and not flag.startswith("--no-"):
                out[flag[2:]] = action
    return out


def find_setting(settings: dict[str, argparse.Action], name: str) -> tuple[str, argparse.Action]:
    """The setting ``name`` names (hyphens and underscores alike), or a one-line error."""
    key = name.strip().replace("_", "-")
    if key not in settings:
        key = next((k for k in settings if k.lower() == key.lower() and
                    sum(j.lower() == key.lower() for j in settings) == 1), key)
    if key in ("seed", "seeds"):
        raise RwinterpError("the seeds are not a grid setting: give them with --seeds (0-4, 0,3,7)")
    require(key in settings, f"unknown setting {name!r}: a setting is a train option without its dashes (p, K, N, "
                             "M, d-model, layers, lr, steps, ...; see rwinterp train --help)")
    return key, settings[key]


def parse_value(name: str, action: argparse.Action, text: str) -> Any:
    """A setting's value from its text, typed as its ``train`` option types it (a one-line error otherwise)."""
    text = text.strip()
    require(text != "", f"--grid {name}: an empty value")
    if isinstance(action, argparse.BooleanOptionalAction):
        words = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
        require(text.lower() in words, f"--grid {name}: {text!r} is not true or false")
        return words[text.lower()]
    value: Any = text
    kind = action.type or task_type(action)
    if kind is not None:
        try:
            value = kind(text)
        except ValueError:
            kind = getattr(kind, "__name__", "value")
            raise RwinterpError(f"--grid {name}: {text!r} is not {'an' if kind == 'int' else 'a'} "
                                f"{ {'int': 'integer', 'float': 'number'}.get(kind, kind)}") from None
        if isinstance(value, float):
            require(math.isfinite(value), f"--grid {name}: {text!r} is not a finite number")
    if action.choices is not None:
        require(value in action.choices, f"--grid {name}: {text!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def task_type(action: argparse.Action) -> Optional[type]:
    """The type of a numeric task parameter (``train`` reads them as text and parses them later)."""
    from rwinterp.config import TASK_PARAMETERS

    param = action.dest.removeprefix("task_")
    kind = TASK_PARAMETERS.get(param, (None,))[0] if action.dest.startswith("task_") else None
    return kind if kind in (int, float) else None


def parse_grid(items: Sequence[str], settings: dict[str, argparse.Action]) -> dict[str, list[Any]]:
    """``["p=0.1,0.5", "K=5,7"]`` as ``{"p": [0.1, 0.5], "K": [5, 7]}``, in order (one-line errors for a
    malformed item, an unknown or repeated setting, an empty or repeated value)."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, eq, values = item.partition("=")
        require(eq == "=" and name.strip() != "", f"--grid must be NAME=V1,V2,..., got {item!r}")
        add_axis(grid, name, values.split(","), settings)
    return grid


def add_axis(grid: dict[str, list[Any]], name: str, texts: Sequence[Any], settings: dict[str, argparse.Action]) -> None:
    key, action = find_setting(settings, name)
    require(key not in grid, f"--grid {key} is given twice")
    values = [parse_value(key, action, _text(t)) for t in texts]
    require(len(values) >= 1, f"--grid {key}: no values")
    require(len({json.dumps(v) for v in values}) == len(values), f"--grid {key}: a value is listed twice")
    grid[key] = values


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def read_spec(path: str, settings: dict[str, argparse.Action]) -> tuple[dict[str, list[Any]], dict[str, Any],
                                                                         Optional[str]]:
    """A TOML sweep file: ``seeds = "0-4"``, a ``[grid]`` table (``p = [0.1, 0.5, 0.9]``) and a ``[settings]``
    table of values every run shares (``N = 9``). Returns (grid, settings, seeds)."""
    import tomllib

    try:
        with open(path, "rb") as f:
            spec = tomllib.load(f)
    except OSError as exc:
        raise RwinterpError(f"--spec {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise RwinterpError(f"--spec {path} is not TOML: {exc}") from None
    unknown = sorted(set(spec) - {"seeds", "grid", "settings"})
    require(not unknown, f"--spec {path}: unknown keys {', '.join(unknown)} (it holds seeds, [grid] and [settings])")
    grid: dict[str, list[Any]] = {}
    require(isinstance(spec.get("grid", {}), dict), f"--spec {path}: grid must be a table")
    for name, values in spec.get("grid", {}).items():
        require(isinstance(values, list), f"--spec {path}: grid.{name} must be a list of values")
        add_axis(grid, name, values, settings)
    fixed = {}
    require(isinstance(spec.get("settings", {}), dict), f"--spec {path}: settings must be a table")
    for name, value in spec.get("settings", {}).items():
        key, action = find_setting(settings, name)
        fixed[key] = parse_value(key, action, _text(value))
    seeds = spec.get("seeds")
    if isinstance(seeds, list):
        seeds = ",".join(map(str, seeds))
    require(seeds is None or isinstance(seeds, (str, int)), f"--spec {path}: seeds must be a string such as '0-4'")
    return grid, fixed, None if seeds is None else str(seeds)


def point_name(values: dict[str, Any]) -> str:
    """The folder of a grid point: ``p=0.1_K=5``."""
    parts = [f"{k}={_text(v)}" for k, v in values.items()]
    return re.sub(r"[^A-Za-z0-9=.+_-]", "_", "_".join(parts)) or "point"


# ---------------------------------------------------------------------------------------- jobs
@dataclass
class PointJob:
    """One grid point: its settings, the ``train`` options they give, its seeds and where its runs go."""

    point: str
    values: dict[str, Any]
    args: dict[str, Any]
    seeds: list[int]
    out: str
    device: str
    probe: bool = False
    walks: Optional[int] = None

    def fingerprint(self) -> dict[str, Any]:
        """What makes two runs of this point the same (a finished one is then reused)."""
        from rwinterp.jsonable import jsonable

        return jsonable({"args": self.args, "seeds": self.seeds, "probe": self.probe, "walks": self.walks})


def run_point(job: PointJob) -> list[dict[str, Any]]:
    """Train a grid point's seeds in one batch, save them as a seed group, probe them if asked: a row per seed."""
    from rwinterp.cli import train_seed_group
    from rwinterp.runs import save_group, seed_run_name
    from rwinterp.training import held_out_data, resolve_device

    args = argparse.Namespace(**job.args)
    params, config = check_train_options(args)
    task, kind, options = build_train_setup(args, params, config)
    device = resolve_device(job.device)
    start = time.perf_counter()
    members, _ = train_seed_group(kind, options.to_dict(), task, config, job.seeds, device, progress=False)
    seconds = time.perf_counter() - start
    if any(m.model is not None for m in members):
        save_group(job.out, task, members)
    rows = []
    for m in members:
        row: dict[str, Any] = {"seed": m.seed, "status": "ok" if m.model is not None else "failed",
                               "error": m.error, "run": None if m.model is None else
                               f"runs/{job.point}/{seed_run_name(m.seed)}"}
        row.update({k: m.summary.get(k) for k in SUMMARY_COLUMNS})
        if job.probe and m.model is not None:
            from probes.scoring import scorecard
            from probes.targets import restrict

            # (on the CPU, as ``rwinterp probe`` does: the test walks of the seed's own training config)
            data = restrict(held_out_data(task, config.replace(seed=m.seed)), job.walks)
            card = scorecard(m.model.to("cpu"), task, data)
            row.update({f"score.{k}": v for k, v in card.headline().items()})
        row["job_seconds"] = round(seconds, 3)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------- the sweep
@dataclass
class SweepResult:
    """The rows of a sweep (one per run) and where its table and figure were written."""

    rows: list[dict[str, Any]]
    columns: list[str]
    out: Path
    figure: Optional[Path] = None
    counts: dict[str, int] = field(default_factory=dict)


def plan_sweep(args: argparse.Namespace, parser_settings: dict[str, argparse.Action], grid: dict[str, list[Any]],
               fixed: dict[str, Any], seeds: list[int], out: Path) -> list[PointJob]:
    """The job of every grid point, each checked as ``train`` checks its options (a one-line error naming the
    point otherwise); nothing heavy is imported."""
    base = dict(vars(args))
    for key, value in fixed.items():
        dest = parser_settings[key].dest
        if base.get(dest) is None:
            base[dest] = value if parser_settings[key].type is not None or isinstance(value, bool) else _text(value)
    jobs = []
    names = list(grid)
    for combo in itertools.product(*(grid[n] for n in names)):
        values = dict(zip(names, combo))
        point_args = dict(base)
        for key, value in values.items():
            action = parser_settings[key]
            point_args[action.dest] = value if action.type is not None or isinstance(value, bool) else _text(value)
        point = point_name(values)
        where = ", ".join(f"{k}={_text(v)}" for k, v in values.items())
        try:
            check_train_options(argparse.Namespace(**point_args))
        except RwinterpError as exc:
            raise RwinterpError(f"grid point {where}: {exc}") from None
        keep = {k: v for k, v in point_args.items() if k in {a.dest for a in parser_settings.values()}}
        keep.update(seed=None, seeds=None, out=None, threads=None, json=False, no_progress=True, device=args.device)
        jobs.append(PointJob(point, values, keep, seeds, str(out / "runs" / point), args.device,
                             args.probe, args.walks))
    require(len({j.point for j in jobs}) == len(jobs), "two grid points share a folder name; give distinct values")
    return jobs


def check_points(jobs: list[PointJob], slots: int) -> None:
    """Build every point's task and model options (refusing what ``train`` would refuse) and check that the
    jobs that run side by side fit in memory (:func:`rwinterp.training.check_memory`)."""
    from rwinterp.training import check_memory, resolve_device

    for job in jobs:
        where = ", ".join(f"{k}={_text(v)}" for k, v in job.values.items())
        try:
            args = argparse.Namespace(**job.args)
            params, config = check_train_options(args)
            task, kind, options = build_train_setup(args, params, config)
            check_memory(options, task, config, resolve_device(job.device), len(job.seeds) * min(slots, len(jobs)))
        except RwinterpError as exc:
            raise RwinterpError(f"grid point {where}: {exc}") from None


def finished_rows(job: PointJob, out: Path) -> Optional[list[dict[str, Any]]]:
    """The rows of a point that a previous run of the same sweep finished (its runs complete), or None."""
    from rwinterp.runs import CONFIG_FILE, GROUP_FILE, HISTORY_FILE, WEIGHTS_FILE

    path = out / "rows" / f"{job.point}.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("fingerprint") != job.fingerprint():
        return None
    rows = saved.get("rows")
    if not isinstance(rows, list) or [r.get("seed") for r in rows] != job.seeds:
        return None
    group = Path(job.out)
    if any(r.get("status") == "ok" for r in rows) and not (group / GROUP_FILE).is_file():
        return None
    for r in rows:
        if r.get("status") == "ok" and not all((out / r["run"] / f).is_file()
                                               for f in (CONFIG_FILE, WEIGHTS_FILE, HISTORY_FILE)):
            return None
    return [{**r, "status": "reused" if r.get("status") == "ok" else r.get("status")} for r in rows]


def write_json_atomic(path: Path, obj: Any) -> None:
    from rwinterp.jsonable import jsonable

    atomic_file(path, lambda tmp: tmp.write_text(json.dumps(jsonable(obj), indent=1)))


def sweep(args: argparse.Namespace, settings: dict[str, argparse.Action]) -> SweepResult:
    """Run the sweep the command line describes (see the module docstring)."""
    from experiments.executors import (InlineExecutor, Janitor, check_executor_options, make_executor,
                                       require_gpu_share)
    from rwinterp.atomic import check_target, remove_stale_in

    # ---- everything is checked before anything is written
    require(args.threads is None, "--threads does not apply to sweep: every job trains with one thread")
    require(not args.json, "--json does not apply to sweep: its table is OUT/table.jsonl")
    require(args.seed is None, "--seed does not apply to sweep: give the seeds with --seeds (0-4, 0,3,7)")
    require(bool(args.out), "--out DIR is required")
    check_executor_options(args.executor, args.address, args.gpus_per_job)
    cpus = os.cpu_count() or 1
    require(args.jobs is None or 1 <= args.jobs <= 4 * cpus, f"--jobs must be between 1 and 4 x the {cpus} CPUs, "
                                                             f"got {args.jobs}")
    require(args.walks is None or (args.probe and args.walks >= 2), "--walks needs --probe and at least 2 walks")
    grid = parse_grid(args.grid or [], settings)
    fixed: dict[str, Any] = {}
    seeds_text = args.seeds
    if args.spec is not None:
        spec_grid, fixed, spec_seeds = read_spec(args.spec, settings)
        for name, values in spec_grid.items():
            require(name not in grid, f"--grid {name} is also in {args.spec}")
            grid[name] = values
        seeds_text = seeds_text if seeds_text is not None else spec_seeds
    require(bool(grid), "the grid is empty: give at least one --grid NAME=V1,V2 (or a --spec file with a [grid])")
    seeds = parse_seeds(seeds_text if seeds_text is not None else "0")
    out = check_target(args.out, "sweep", SWEEP_FILES).absolute()  # (workers may start elsewhere)
    jobs = plan_sweep(args, settings, grid, fixed, seeds, out)
    if args.plot is not None:
        require(args.plot in plottable(args.probe), f"--plot {args.plot}: not a score of this sweep; choose one of "
                                                    f"{', '.join(plottable(args.probe))}")
    if args.against is not None:
        args.against = find_setting(settings, args.against)[0]
        require(args.against in grid, f"--against {args.against}: not a swept setting ({', '.join(grid)})")

    from rwinterp.training import resolve_device

    device = resolve_device(args.device)  # --device cuda without a GPU: refused here
    require_gpu_share(device.type, args.executor, args.gpus_per_job)
    reused = {job.point: finished_rows(job, out) for job in jobs}
    todo = [job for job in jobs if reused[job.point] is None]
    slots = min(len(todo), args.jobs or min(cpus, 8)) or 1
    if args.executor == "process" or args.address is None:
        check_points(todo, slots)
    else:  # the cluster's nodes have their own memory: each job alone
        check_points(todo, 1)

    def open_executor() -> Any:
        if args.executor == "process" and slots == 1:
            return InlineExecutor()
        return make_executor(args.executor, slots, args.address, args.gpus_per_job or 0.0)

    janitor = Janitor([out, out / "runs", out / "rows"])  # (before any worker starts)
    try:
        return _run(args, out, jobs, grid, fixed, seeds, settings, reused, todo, open_executor)
    finally:
        janitor.close()
        for folder in (out, out / "runs", out / "rows"):  # what stopped workers were writing
            remove_stale_in(folder)


def _run(args: argparse.Namespace, out: Path, jobs: list[PointJob], grid: dict[str, list[Any]],
         fixed: dict[str, Any], seeds: list[int], settings: dict[str, argparse.Action],
         reused: dict[str, Optional[list[dict[str, Any]]]], todo: list[PointJob], open_executor: Any) -> SweepResult:
    from rwinterp.atomic import remove_stale_in

    executor = open_executor() if todo else None  # (Ray is started, or its cluster joined, before any writing)

    # ---- the work
    (out / "runs").mkdir(parents=True, exist_ok=True)
    (out / "rows").mkdir(exist_ok=True)
    for folder in (out, out / "runs", out / "rows"):
        remove_stale_in(folder)
    write_json_atomic(out / "sweep.json", {"grid": grid, "settings": fixed, "seeds": seeds,
                                           "points": [j.point for j in jobs], "device": args.device,
                                           "probe": args.probe})
    shared = dict(fixed)  # the settings every run shares: from the spec file and the command line
    for key, action in settings.items():
        if key not in grid and getattr(args, action.dest, None) is not None and action.dest not in (
                settings[k].dest for k in shared):
            value = getattr(args, action.dest)
            shared[key] = parse_value(key, action, value) if isinstance(value, str) and task_type(action) else value
    results: dict[str, list[dict[str, Any]]] = {p: rows for p, rows in reused.items() if rows is not None}
    progress = None if not args.no_progress else False
    if todo:
        run_jobs(todo, results, out, executor, open_executor, progress)

    # ---- the table and the figure
    rows = []
    for job in jobs:
        for r in results[job.point]:
            rows.append({"point": job.point, **{k: job.values[k] for k in grid}, **shared, **r})
    columns = table_columns(rows, list(grid) + list(shared))
    write_table(out, rows, columns)
    score = args.plot or ("score.accuracy" if args.probe else "test_accuracy")
    against = args.against or next(iter(grid))
    figure = plot(out, rows, score, against, [k for k in grid if k != against])
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    return SweepResult(rows, columns, out, figure, counts)


def run_jobs(todo: list[PointJob], results: dict[str, list[dict[str, Any]]], out: Path, executor: Any,
             open_executor: Any, progress: Optional[bool]) -> None:
    """Run the jobs on ``executor``; a job that fails is ``failed`` rows saying why. A worker process that dies
    breaks a process pool, and every job in it fails with it: those jobs run again, in a fresh pool, one at a
    time, so that a job that kills its worker again is the only one reported failed."""
    from concurrent.futures import as_completed
    from concurrent.futures.process import BrokenProcessPool

    from tqdm.auto import tqdm

    def finish(job: PointJob, future: Any, retry: bool) -> bool:
        """Record the job's rows (False: its pool broke and it is to run again)."""
        try:
            rows = future.result()
        except BrokenProcessPool:
            if retry:
                return False
            rows = failed_rows(job, WORKER_DIED)
        except Exception as exc:  # noqa: BLE001  (a failed job is a row of the table)
            exc = getattr(exc, "cause", None) or exc  # (Ray's error wraps the job's own)
            text = str(exc).strip().splitlines()
            rows = failed_rows(job, f"{type(exc).__name__}: {text[0] if text else ''}".strip())
        else:
            write_json_atomic(out / "rows" / f"{job.point}.json", {"fingerprint": job.fingerprint(), "rows": rows})
        results[job.point] = rows
        bar.update(1)
        return True

    waiting, one_at_a_time = list(todo), False
    with tqdm(total=len(todo), desc="sweep", unit="point", disable=(None if progress is None else not progress)) as bar:
        while waiting:
            executor = executor or open_executor()
            lost: list[PointJob] = []
            with executor:
                if one_at_a_time:
                    for i, job in enumerate(waiting):
                        finish(job, executor.submit(run_point, job), retry=False)
                        if results[job.point][0]["error"] == WORKER_DIED:
                            lost = waiting[i + 1:]  # (the pool is broken: the rest go to a fresh one)
                            break
                else:
                    futures = {executor.submit(run_point, job): job for job in waiting}
                    lost = [futures[f] for f in as_completed(futures) if not finish(futures[f], f, retry=True)]
            waiting, executor, one_at_a_time = lost, None, True


def failed_rows(job: PointJob, error: str) -> list[dict[str, Any]]:
    return [{"seed": s, "status": "failed", "error": error, "run": None, **{k: None for k in SUMMARY_COLUMNS}}
            for s in job.seeds]


def plottable(probe: bool) -> list[str]:
    from_probe = []
    if probe:
        from probes.scoring import HEADLINE

        from_probe = [f"score.{k}" for k in HEADLINE]
    return [c for c in SUMMARY_COLUMNS if c not in ("final_step",)] + from_probe


def table_columns(rows: list[dict[str, Any]], settings: list[str]) -> list[str]:
    """The table's columns: the point, its settings, the seed, the status and error, then the results."""
    first = ["point", *settings, "seed", "status", "error"]
    rest: list[str] = []
    for r in rows:
        rest += [k for k in r if k not in first and k not in rest]
    results = [c for c in SUMMARY_COLUMNS if c in rest]
    scores = sorted(c for c in rest if c.startswith("score."))
    return first + results + scores + [c for c in rest if c not in results and c not in scores]


def write_table(out: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    """``table.csv``, ``table.jsonl`` and, where pyarrow is installed, ``table.parquet``, each written whole."""
    from rwinterp.jsonable import jsonable

    def csv_file(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            for r in rows:
                writer.writerow({c: "" if r.get(c) is None else r.get(c) for c in columns})

    atomic_file(out / "table.csv", csv_file)
    atomic_file(out / "table.jsonl", lambda tmp: tmp.write_text(
        "".join(json.dumps(jsonable({c: r.get(c) for c in columns})) + "\n" for r in rows)))
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        return
    table = pyarrow.Table.from_pylist([jsonable({c: r.get(c) for c in columns}) for r in rows])
    atomic_file(out / "table.parquet", lambda tmp: pyarrow.parquet.write_table(table, str(tmp)))


def plot(out: Path, rows: list[dict[str, Any]], score: str, against: str, others: list[str]) -> Optional[Path]:
    """``OUT/SCORE.png``: the mean of ``score`` over seeds against ``against``, a line per combination of the
    ``others`` swept settings, with the bootstrap 95% interval of the mean (:class:`probes.stats.Estimate`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from probes.stats import Estimate

    groups: dict[tuple, dict[Any, list[float]]] = {}
    for r in rows:
        value = r.get(score)
        if r["status"] == "failed" or value is None:
            continue
        key = tuple(r[o] for o in others)
        groups.setdefault(key, {}).setdefault(r[against], []).append(float(value))
    if not groups:
        return None
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for g in groups.values() for x in g)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    order = sorted({x for g in groups.values() for x in g}, key=lambda x: (x if numeric else str(x)))
    for key, by_x in groups.items():
        xs = [x for x in order if x in by_x]
        estimates = [Estimate.of(by_x[x]) for x in xs]
        pos = xs if numeric else [order.index(x) for x in xs]
        label = ", ".join(f"{o}={k}" for o, k in zip(others, key)) or None
        line, = ax.plot(pos, [e.mean for e in estimates], marker="o", label=label)
        lows, highs = zip(*(e.interval for e in estimates))
        ax.fill_between(pos, lows, highs, color=line.get_color(), alpha=0.2, linewidth=0)
    if not numeric:
        ax.set_xticks(range(len(order)), [str(x) for x in order])
    ax.set_xlabel(against)
    ax.set_ylabel(score)
    seeds = max(len(v) for g in groups.values() for v in g.values())
    ax.set_title(f"{score}: mean over seeds (up to {seeds}), 95% interval", fontsize=9)
    if any(k for k in groups):
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', score)}.png"
    atomic_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- the command
def _configure(parser: argparse.ArgumentParser) -> None:
    TRAIN.configure(parser)
    for action in parser._actions:
        if action.dest == "seeds":
            action.help = "the seeds of every grid point (0-4, 0,3,7), trained in one batch per point (default 0)"
        elif action.dest == "out":
            action.help = "the sweep's directory: runs/POINT/seed-S, table.csv, table.jsonl, SCORE.png"
        elif action.dest == "device":
            action.help = "where every job trains: cpu (default), cuda (an error without a GPU) or auto"
    g = parser.add_argument_group("sweep")
    g.add_argument("--grid", action="append", metavar="NAME=V1,V2",
                   help="a swept setting and its values (repeat for a product); NAME is a train option without "
                        "its dashes: p, K, N, M, d-model, layers, lr, steps, ...")
    g.add_argument("--spec", metavar="FILE.toml", help="a TOML file with seeds, a [grid] and shared [settings]")
    g.add_argument("--jobs", type=int, default=None, help="jobs at once (default: the CPUs, at most 8; 1: in this "
                                                          "process)")
    add_executor_options(g, "jobs")
    g.add_argument("--probe", action="store_true", help="probe every run (scorecard) and add its scores to the table")
    g.add_argument("--walks", type=int, default=None, help="with --probe: probe on the first N test walks")
    g.add_argument("--plot", default=None, metavar="SCORE",
                   help="the score to draw (default test_accuracy, with --probe score.accuracy)")
    g.add_argument("--against", default=None, metavar="SETTING", help="the swept setting on the x axis "
                                                                      "(default the first)")


def _sweep(args: argparse.Namespace) -> int:
    from rwinterp.cli import build_parser

    _, parsers = build_parser()
    result = sweep(args, settings_of(parsers["train"]))
    c = result.counts
    print(f"{len(result.rows)} runs: {c['ok']} ok, {c['reused']} reused, {c['failed']} failed")
    for r in result.rows:
        if r["status"] == "failed":
            print(f"failed  {r['point']} seed {r['seed']}: {r['error']}")
    print(f"table   {result.out / 'table.csv'}  ({len(result.columns)} columns)")
    if result.figure is not None:
        print(f"figure  {result.figure}")
    return 0 if c["failed"] == 0 else 1


SWEEP = Command("sweep", "train (and probe) a grid of settings x seeds on local processes or Ray: one table, one "
                         "figure", _configure, _sweep)
