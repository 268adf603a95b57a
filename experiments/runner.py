"""Execute figure specs: train their runs once each, draw the panels, check the claims, write the report.

:func:`reproduce` is the whole pipeline:

1. :func:`discover` imports every module of :mod:`experiments.specs` and collects its ``SPEC``.
2. :func:`plan` resolves the selected specs' runs (reduced mode applied) and merges runs with the
   same training configuration (task, model, training) across figures: each trains once, recording
   the union of what the figures asked for.
3. :func:`execute` trains them under one progress bar (in steps), recording the requested
   quantities through the training callback.
4. :func:`draw_figures` evaluates each figure's claims, in this process, and draws its panels
   (:mod:`experiments.plots`), in the training workers when there are several jobs; a claim whose
   measurement fails counts as not holding, with the error as its note. Nothing is dropped.
5. The PNGs, ``results.json`` (the list of claims), ``runs.json`` (what was trained, how long it
   took) and ``REPRODUCTION.md`` are written to a temporary directory and moved into place.

Runs are deterministic: model initialisation and data come from the seeds in the specs, so the same
specs give the same numbers.
"""

from __future__ import annotations

import importlib
import math
import os
import pickle
import pkgutil
import shutil
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np

from experiments.executors import Executor, Janitor, ProcessExecutor, make_executor, require_gpu_share
from experiments.spec import (QUANTITIES, Check, ClaimResult, FigureSpec, Results, RunResult, RunSpec,
                              StepView)
from rwinterp.atomic import check_target, publish, remove_stale, temporary_sibling
from rwinterp.errors import RwinterpError, require
from rwinterp.jsonable import jsonable

#: What a reproduction directory holds (its marker first): an existing --out is replaced only if it holds no more.
REPORT_FILES = ("results.json", "runs.json", "REPRODUCTION.md", "*.png")

SPEC_PACKAGE = "experiments.specs"


# ------------------------------------------------------------------------------------ discovery
def discover() -> dict[str, FigureSpec]:
    """Every ``SPEC`` in the modules of :mod:`experiments.specs`, by id, in module order."""
    import experiments.quantities  # noqa: F401  (registers the standard quantities)

    package = importlib.import_module(SPEC_PACKAGE)
    specs: dict[str, FigureSpec] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{SPEC_PACKAGE}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if spec is None:
            continue
        require(isinstance(spec, FigureSpec), f"{module.__name__}.SPEC is not a FigureSpec")
        require(spec.id not in specs, f"two specs share the id {spec.id!r}")
        specs[spec.id] = spec
    return dict(sorted(specs.items(), key=lambda kv: _order(kv[0])))


def _order(spec_id: str) -> tuple[int, Any]:
    return (0, int(spec_id)) if spec_id.isdigit() else (1, spec_id)


def select(specs: dict[str, FigureSpec], ids: Iterable[str]) -> list[FigureSpec]:
    """The specs named by ``ids`` ("all", "4", "fig4", "fig04", or an extra study's id)."""
    ids = list(ids)
    require(bool(ids), "name at least one figure, or 'all'")
    if "all" in ids:
        return list(specs.values())
    out = []
    for raw in ids:
        name = raw.lower().removeprefix("fig").lstrip("0") if raw.lower().removeprefix("fig").isdigit() else raw
        require(name in specs, f"unknown figure {raw!r}; known: {', '.join(specs)}, all")
        if specs[name] not in out:
            out.append(specs[name])
    return out


# ----------------------------------------------------------------------------------------- plan
@dataclass
class PlannedRun:
    key: str
    spec: RunSpec
    users: list[tuple[str, str]] = field(default_factory=list)  # (figure id, run name)


def plan(figures: list[FigureSpec], reduced: bool = False) -> tuple[list[PlannedRun], dict[tuple[str, str], str]]:
    """Distinct runs to train, and the map (figure id, run name) -> run key."""
    planned: dict[str, PlannedRun] = {}
    names: dict[tuple[str, str], str] = {}
    for fig in figures:
        for run in fig.resolved_runs(reduced):
            for q in run.record.quantities:
                require(q in QUANTITIES, f"figure {fig.id}, run {run.name}: unknown quantity {q!r}; "
                        f"known: {', '.join(sorted(QUANTITIES))}")
            key = run.key()
            if key in planned:
                merged = planned[key]
                merged.spec.record = merged.spec.record.merged(run.record)
            else:
                planned[key] = PlannedRun(key, run)
            planned[key].users.append((fig.id, run.name))
            names[(fig.id, run.name)] = key
    return list(planned.values()), names


# -------------------------------------------------------------------------------------- execute
def build(run: RunSpec) -> tuple[Any, Any, Any]:
    """(model, task, train config) of a run spec (:meth:`RunSpec.configs`)."""
    from rwinterp.runs import build_model

    task, kind, model_config, train_config = run.configs()
    return build_model(kind, model_config), task, train_config


def execute_run(run: RunSpec, on_step: Optional[Callable[[int], None]] = None, device: Any = None) -> RunResult:
    """Train one run, recording its quantities; a diverging run keeps its history and an error. ``device``:
    where it trains (``"cuda"``, ``"auto"``; default the CPU); the trained model comes back on the CPU, where
    the claims are measured and the figures drawn."""
    from rwinterp.tasks import Batch
    from rwinterp.training import TrainingDiverged, make_data, resolve_device, train

    model, task, config = build(run)
    device = resolve_device(device)
    model.to(device)
    data = make_data(task, config)
    test = data[1]
    if device.type != "cpu":  # the quantities are recorded from the test walks on the model's device
        test = Batch(*(None if t is None else t.to(device) for t in (test.tokens, test.labels, test.weights,
                                                                     test.states)))
    snapshots: dict[str, dict[int, Any]] = {q: {} for q in run.record.quantities}
    last = config.steps

    def record(step: int, model: Any, rec: dict) -> None:
        if snapshots and run.record.wants(step, last):
            _snapshot(step, model, task, test, run.record.quantities, snapshots)
        if on_step is not None:
            on_step(1)

    start = time.perf_counter()
    error = None
    try:
        result = train(model, task, config, data=data, progress=False, callback=record)
        history = result.history
    except TrainingDiverged as exc:
        history = exc.result.history
        error = str(exc)
        if history and snapshots:  # record the last good state as the final one
            _snapshot(history[-1]["step"], model, task, test, run.record.quantities, snapshots)
        if on_step is not None:
            on_step(max(0, last + 1 - len(history)))
    if device.type != "cpu":
        model.to("cpu")
        test = data[1]
    return RunResult(run, history, snapshots, model, task, test, data[0], time.perf_counter() - start, error)


def _snapshot(step: int, model: Any, task: Any, test: Any, names: tuple[str, ...], out: dict) -> None:
    view = StepView(step, model, task, test)
    for name in names:
        out[name][step] = QUANTITIES[name](view)


def execute(runs: list[PlannedRun], progress: Optional[bool] = None, jobs: int = 1,
            threads: int = 1, pool: Optional[Executor] = None, device: Any = None) -> dict[str, RunResult]:
    """Train every planned run under one progress bar counting gradient steps.

    ``jobs`` > 1 trains that many runs at once in worker processes (:func:`worker_pool`), or ``pool`` (any
    :class:`experiments.executors.Executor`) if given, each with ``threads`` torch threads (the bar then
    advances by whole runs). Every run is seeded by its spec alone, so the results are the same whichever
    process trains it. ``device``: where every run trains (:func:`execute_run`).
    """
    from concurrent.futures import as_completed

    from tqdm.auto import tqdm

    require(isinstance(jobs, int) and jobs >= 1, f"jobs must be a positive integer, got {jobs!r}")
    total = sum(r.spec.steps() + 1 for r in runs)
    out: dict[str, RunResult] = {}
    with tqdm(total=total, desc="reproduce", unit="step",
              disable=(None if progress is None else not progress)) as bar:
        if pool is None and (jobs == 1 or len(runs) <= 1):
            for r in runs:
                bar.set_postfix_str(f"{r.users[0][0]}:{r.spec.name}")
                out[r.key] = execute_run(r.spec, bar.update, device)
            return out

        def cost(r: PlannedRun) -> int:
            config = r.spec.configs()[3]
            return config.steps * config.n_train

        with worker_pool(jobs, threads) if pool is None else nullcontext(pool) as pool:
            # Longest first (steps x training walks), so that no long run starts last.
            futures = {pool.submit(execute_run, r.spec, None, device): r for r in sorted(runs, key=cost, reverse=True)}
            for future in as_completed(futures):
                r = futures[future]
                out[r.key] = future.result()
                bar.set_postfix_str(f"{r.users[0][0]}:{r.spec.name}")
                bar.update(r.spec.steps() + 1)
    return {r.key: out[r.key] for r in runs}


def worker_pool(jobs: int, threads: int = 1) -> ProcessExecutor:
    """A pool of ``jobs`` worker processes (:class:`experiments.executors.ProcessExecutor`), each with
    ``threads`` torch threads and every spec module imported (so the quantities and figures they define are
    known there). Use it in a ``with`` block."""
    return ProcessExecutor(jobs, threads, setup=discover)


# --------------------------------------------------------------------------------------- claims
def evaluate_claims(fig: FigureSpec, results: Results) -> list[ClaimResult]:
    """Measure and check every claim; a failing measurement is a claim that does not hold."""
    out = []
    for claim in fig.claims:
        expected = claim.expected
        try:
            check = claim.check if isinstance(claim.check, Check) else claim.check(results)
            expected = expected or check.describe()
            measured = jsonable(claim.measure(results))
            holds = bool(check.holds(measured))
            error = None
        except Exception as exc:  # noqa: BLE001  (a broken measurement is reported, not raised)
            measured, holds, error = None, False, f"{type(exc).__name__}: {exc}"
        note = claim.note
        if error:
            note = f"measurement failed ({error}). {note}".strip()
        elif not holds and claim.why is not None:
            try:
                note = f"{note} {claim.why(results)}".strip()
            except Exception as exc:  # noqa: BLE001  (as a measurement: reported, not raised)
                note = f"{note} (its explanation failed: {type(exc).__name__}: {exc})".strip()
        out.append(ClaimResult(fig.id, claim.claim, expected, measured, holds, note, error))
    return out


# -------------------------------------------------------------------------------------- pipeline
@dataclass
class FigureOutcome:
    spec: FigureSpec
    claims: list[ClaimResult]
    image: Optional[str]
    draw_errors: list[str]
    seconds: float


@dataclass
class Report:
    figures: list[FigureOutcome]
    runs: list[dict[str, Any]]
    seconds: float
    reduced: bool
    load: Optional[tuple[float, float]] = None
    jobs: int = 1

    @property
    def claims(self) -> list[ClaimResult]:
        return [c for f in self.figures for c in f.claims]


def figure_results(fig: FigureSpec, names: dict[tuple[str, str], str], trained: dict[str, RunResult],
                   reduced: bool) -> Results:
    results = Results()
    results.reduced = reduced
    for run in fig.runs:
        results[run.name] = trained[names[(fig.id, run.name)]]
    return results


def reproduce(ids: Iterable[str], out: str | os.PathLike, reduced: bool = False,
              progress: Optional[bool] = None, write: bool = True, threads: int = 1, jobs: int = 1,
              executor: str = "process", address: Optional[str] = None, device: Any = None,
              gpus_per_job: float = 0.0) -> Report:
    """Run the named figures and write their PNGs, ``results.json``, ``runs.json`` and ``REPRODUCTION.md``.

    ``out`` is written whole at the end: a previous reproduction there is replaced, figures of other
    ids included; a directory holding anything else is refused before any training.

    ``threads``: torch CPU threads per training process. The runs are tiny tensor programs; one
    thread is fastest, and on a busy machine several threads are many times slower (they wait for
    each other). ``jobs``: runs trained at once, in worker processes (see :func:`execute`); ``executor``:
    where they run, ``"process"`` (this machine's processes) or ``"ray"`` (a local Ray instance, or the
    cluster at ``address``, each job with ``gpus_per_job`` of a GPU: :mod:`experiments.executors`). The
    numbers depend on neither. ``device``: where the runs train (``"cpu"``, ``"cuda"``, ``"auto"``).

    Nothing outlives the call, however it ends: its workers and scratch folder go with it, a SIGKILL
    included (:class:`experiments.executors.Janitor`).
    """
    import torch

    from experiments import report

    start = time.perf_counter()
    load_before = _load()
    from rwinterp.training import resolve_device

    device = str(resolve_device(device))  # (no GPU for --device cuda: refused now)
    require_gpu_share(device, executor, gpus_per_job)
    figures = select(discover(), ids)
    runs, names = plan(figures, reduced)
    out = Path(out)
    # The report is built beside its target (the whole directory is replaced at the end) in a folder named
    # after this process, so that the next reproduction removes it if this one is killed outright.
    if write:  # refused now, not after the training
        out = check_target(out, "reproduction", REPORT_FILES)
        remove_stale(out)
    tmp = temporary_sibling(out if write else Path(tempfile.gettempdir()) / "rwinterp-reproduce")
    janitor = Janitor([tmp.parent])  # (before the folder is made: a SIGKILL from then on is cleaned up after)
    try:
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            raise RwinterpError(f"cannot write into {tmp.parent}: {exc.strerror or exc}") from None
        previous = torch.get_num_threads()
        # One pool of workers trains the runs and then draws the figures. It is shut down (about a second)
        # before publishing, so that a stop meanwhile leaves nothing behind.
        if executor == "process" and jobs == 1:
            pool = nullcontext(None)
        elif executor == "process":
            pool = worker_pool(jobs, threads)
        else:
            pool = make_executor(executor, jobs, address, gpus_per_job, setup=discover)
        with pool as pool:
            torch.set_num_threads(threads)
            try:
                trained = execute(runs, progress, jobs=jobs, threads=threads, pool=pool, device=device)
            finally:
                torch.set_num_threads(previous)
            outcomes = draw_figures(figures, names, trained, reduced, tmp, pool,
                                    in_flight=jobs if pool is None else pool.slots)
        run_rows = [_run_row(r, trained[r.key]) for r in runs]
        rep = Report(outcomes, run_rows, time.perf_counter() - start, reduced, load_before, jobs)
        if write:
            report.write(rep, tmp)
            publish(tmp, check_target(out, "reproduction", REPORT_FILES))
        return rep
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        janitor.close()


def draw_figures(figures: list[FigureSpec], names: dict[tuple[str, str], str], trained: dict[str, RunResult],
                 reduced: bool, out_dir: Path, pool: Any = None, in_flight: int = 2) -> list[FigureOutcome]:
    """Check every figure's claims and draw its PNG into ``out_dir``.

    The claims are measured here, in this process, so the numbers never depend on how the work is
    shared. Given a ``pool`` (:func:`worker_pool`, or any executor), its workers draw meanwhile, figures with the most
    panels first (drawing takes most of the time), ``in_flight`` figures at a time (one per worker).

    Each figure's results go to the pool pickled here, between two claims: the pool would otherwise
    pickle them in a thread of its own, while measuring a claim attaches hooks to the same models (and
    a hook cannot be pickled). Only ``in_flight`` of them are pickled at once (each holds its figure's
    models and walks, in shared memory), without the analyses the claims have memoised
    (:meth:`RunResult.memo`): a worker computes again what its panels need.
    """
    from concurrent.futures import FIRST_COMPLETED, wait

    results = {fig.id: figure_results(fig, names, trained, reduced) for fig in figures}
    waiting = sorted((fig for fig in figures if fig.panels), key=lambda fig: len(fig.panels), reverse=True)
    futures: dict[str, Any] = {}

    def submit_more() -> None:
        while pool is not None and waiting and sum(not f.done() for f in futures.values()) < in_flight:
            fig = waiting.pop(0)
            shared = getattr(pool, "shares_memory", True)
            futures[fig.id] = pool.submit(_draw_pickled, fig.id, _pickled(results[fig.id], shared), out_dir)

    submit_more()
    outcomes = []
    for fig in figures:
        t0 = time.perf_counter()
        claims = evaluate_claims(fig, results[fig.id])
        outcomes.append(FigureOutcome(fig, claims, None, [], time.perf_counter() - t0))
        submit_more()
    while pool is not None and waiting:
        wait([f for f in futures.values() if not f.done()], return_when=FIRST_COMPLETED)
        submit_more()
    for outcome in outcomes:
        fig = outcome.spec
        if fig.panels:
            outcome.image, outcome.draw_errors, seconds = (futures[fig.id].result() if pool
                                                           else _draw(fig, results[fig.id], out_dir))
            outcome.seconds += seconds
    return outcomes


def _pickled(results: Results, shared: bool = True) -> bytes:
    """``results`` pickled as a process pool itself would (``shared``: tensors travel through shared memory,
    not inside the pickle: a plain pickle copies every model and walk into it; a Ray worker, another
    machine's perhaps, gets a plain pickle), without the runs' memoised analyses."""
    from multiprocessing.reduction import ForkingPickler

    bare = Results({name: replace(run, derived={}) for name, run in results.items()})
    bare.reduced = results.reduced
    return bytes(ForkingPickler.dumps(bare)) if shared else pickle.dumps(bare)


def _draw_pickled(fig_id: str, results: bytes, out_dir: Path) -> tuple[Optional[str], list[str], float]:
    """:func:`_draw` in a worker process, from a discovered figure's id and its pickled results."""
    return _draw(fig_id, pickle.loads(results), out_dir)


def _draw(fig: FigureSpec | str, results: Results, out_dir: Path) -> tuple[Optional[str], list[str], float]:
    """Draw ``fig`` (in a worker process, a discovered figure's id): (file name, panel errors, seconds)."""
    from experiments import plots

    t0 = time.perf_counter()
    image, errors = plots.render(discover()[fig] if isinstance(fig, str) else fig, results, out_dir)
    return image, errors, time.perf_counter() - t0


def _run_row(planned: PlannedRun, result: RunResult) -> dict[str, Any]:
    final = result.history[-1] if result.history else {}
    return jsonable({
        "key": planned.key, "used_by": [f"{f}:{n}" for f, n in planned.users],
        "task": planned.spec.task, "model": planned.spec.model, "train": planned.spec.train,
        "seconds": round(result.seconds, 3), "error": result.error,
        "final": {k: final.get(k) for k in ("step", "loss", "train_accuracy", "test_accuracy",
                                           "parent_attention", "v_distance")},
    })


def _load() -> Optional[tuple[float, float]]:
    try:
        one, five, _ = os.getloadavg()
        return (one, five)
    except OSError:
        return None
