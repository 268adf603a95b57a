"""The declarative description of one figure: the runs it needs, the panels it draws, the claims it checks.

A figure is data, not a script. :class:`FigureSpec` lists

* ``runs``: :class:`RunSpec` s, each a named training configuration (task dict, model config dict,
  :class:`~rwinterp.training.TrainConfig` dict) plus a :class:`Record` of what to keep beyond the
  per-step history (snapshots of V, the mean attention, the attention-averaged token, ...);
* ``panels``: :class:`Panel` s, each a panel kind (``line``, ``heatmap``, ``bar``, ``text``,
  ``table``, ``custom``) fed by *sources* that read the run results;
* ``claims``: :class:`Claim` s, each a sentence of the paper with the value it predicts, a source
  that measures it and a :class:`Check` that decides whether it holds.

Sources are small callables over :class:`Results` (the figure's runs by name):
:class:`History` (a per-step number), :class:`Final` (a recorded quantity at the last step),
:class:`Snapshot` (a quantity at a given step), :class:`Computed` (any function of the results).
The runner (:mod:`experiments.runner`) executes the runs (sharing identical ones between figures),
draws the panels, evaluates the claims and writes the report.

Reduced mode (for the CI test) applies ``FigureSpec.reduced`` and then ``RunSpec.reduced`` as
overrides ``{"task": {...}, "model": {...}, "train": {...}, "record": {...}}``: smaller N, M,
fewer steps and walks. Claims marked ``reduced=True`` must hold in reduced mode too.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np

from rwinterp.errors import RwinterpError, require

# ------------------------------------------------------------------------------------ quantities
#: Recordable quantities: name -> function(view) -> value; see :class:`StepView`.
QUANTITIES: dict[str, Callable[["StepView"], Any]] = {}


def quantity(name: str) -> Callable:
    """Register a recordable quantity ``fn(view: StepView) -> number | array | dict``."""

    def wrap(fn: Callable[["StepView"], Any]) -> Callable[["StepView"], Any]:
        QUANTITIES[name] = fn
        return fn

    return wrap


class StepView:
    """What a quantity sees at a step: the model (do not change it), the task, the test walks, and
    (computed on first use, once per step) the model's test scores ``[B, K]`` and attention ``[B, N]``."""

    def __init__(self, step: int, model: Any, task: Any, test: Any):
        self.step, self.model, self.task, self.test = step, model, task, test
        self._forward: Optional[tuple[Any, Any]] = None

    def _run(self) -> tuple[Any, Any]:
        if self._forward is None:
            import torch

            from rwinterp.training import logits_and_pattern

            with torch.no_grad():
                logits, heads = logits_and_pattern(self.model, self.test.tokens)
            self._forward = (logits[:, -1, :].detach(), heads[0][:, 0])
        return self._forward

    @property
    def scores(self) -> Any:
        return self._run()[0]

    @property
    def pattern(self) -> Any:
        return self._run()[1]


# -------------------------------------------------------------------------------------- runs
@dataclass
class Record:
    """What to keep of a run beyond its history.

    ``quantities`` are names in :data:`QUANTITIES` (``V``, ``attention``, ``averaged_token``,
    ``v_column_spread``, ...). They are taken at every step in ``at`` (``None``: every step),
    and always at the last step. The trained model is always kept for :class:`Computed` sources.
    """

    quantities: tuple[str, ...] = ("V", "attention")
    at: Optional[tuple[int, ...]] = ()

    def __post_init__(self) -> None:
        self.quantities = tuple(self.quantities)
        self.at = None if self.at is None else tuple(int(s) for s in self.at)

    def merged(self, other: "Record") -> "Record":
        at = None if self.at is None or other.at is None else tuple(sorted(set(self.at) | set(other.at)))
        qs = tuple(dict.fromkeys(self.quantities + other.quantities))
        return Record(qs, at)

    def wants(self, step: int, last: int) -> bool:
        return step == last or self.at is None or step in self.at


@dataclass
class RunSpec:
    """One named training run.

    ``task``: a task dict for :func:`rwinterp.tasks.task_from_dict` (``{"kind": "circle", "K": 6,
    "p": 0.5, "N": 97}``). ``model``: :class:`~rwinterp.config.DeepOptions` fields (the paper's model by default);
    ``n_states`` and ``n_ctx`` default to the task's. ``train``: :class:`TrainConfig` fields.
    ``reduced``: overrides for reduced mode, merged after the figure's.
    """

    name: str
    task: dict[str, Any]
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    record: Record = field(default_factory=Record)
    reduced: dict[str, dict[str, Any]] = field(default_factory=dict)
    label: str = ""

    def resolved(self, reduced: bool, figure_reduced: Mapping[str, Mapping[str, Any]]) -> "RunSpec":
        """A copy with the reduced-mode overrides applied (unchanged when ``reduced`` is false)."""
        out = copy.deepcopy(self)
        if not reduced:
            return out
        for overrides in (figure_reduced, self.reduced):
            for part, values in overrides.items():
                require(part in ("task", "model", "train", "record"),
                        f"run {self.name}: unknown reduced-mode part {part!r}")
                if part == "record":
                    out.record = Record(**{**{f.name: getattr(out.record, f.name) for f in fields(Record)},
                                           **values})
                elif part == "task" and not _task_has_fields(out.task, values):
                    continue
                else:
                    getattr(out, part).update(values)
        return out

    def configs(self) -> tuple[Any, str, dict[str, Any], Any]:
        """(task, model kind, model config dict, :class:`TrainConfig`) of the run, every default filled in.

        The model dict's optional ``"kind"`` names a registered model kind (default ``"deep"``, the library's
        model, whose defaults are the paper's); ``n_states`` and ``n_ctx`` default to the task's.
        """
        from rwinterp.runs import full_model_config
        from rwinterp.tasks import task_from_dict
        from rwinterp.training import TrainConfig

        task = task_from_dict(self.task)
        model = {"n_states": task.n_states, "n_ctx": task.seq_len, **self.model}
        kind = model.pop("kind", "deep")
        # A figure records its quantities at the steps it asks for: its runs evaluate every step.
        return task, kind, full_model_config(kind, model), TrainConfig.from_dict({"eval_every": 1, **self.train})

    def key(self) -> str:
        """Identity of the training run (not of what is recorded): equal keys train once.

        Built from :meth:`configs`, so two runs that differ only in spelling (a default written out or
        left off, ``1`` or ``1.0``) are one run.
        """
        task, kind, model, train = self.configs()
        blob = json.dumps(_numbers_as_floats({"task": task.to_dict(), "kind": kind, "model": model,
                                              "train": train.to_dict()}), sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:16]

    def steps(self) -> int:
        return self.configs()[3].steps


def _numbers_as_floats(x: Any) -> Any:
    """``x`` with every int (not bool) inside it as a float, so that ``1`` and ``1.0`` hash alike."""
    if isinstance(x, dict):
        return {k: _numbers_as_floats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_numbers_as_floats(v) for v in x]
    return float(x) if isinstance(x, int) and not isinstance(x, bool) else x


def _task_has_fields(task: dict[str, Any], values: Mapping[str, Any]) -> bool:
    """Reduced task overrides apply only to tasks that have those fields (e.g. N for walks)."""
    return all(k in task for k in values)


# ------------------------------------------------------------------------------------ results
@dataclass
class RunResult:
    """A finished run: history, recorded quantities per step, the model, task and test walks."""

    spec: RunSpec
    history: list[dict[str, Any]]
    snapshots: dict[str, dict[int, Any]]
    model: Any = None
    task: Any = None
    test: Any = None
    train_data: Any = None
    seconds: float = 0.0
    error: Optional[str] = None
    derived: dict[str, Any] = field(default_factory=dict)

    def memo(self, key: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per run and key (for analyses shared by several panels and claims)."""
        if key not in self.derived:
            self.derived[key] = compute()
        return self.derived[key]

    @property
    def final(self) -> dict[str, Any]:
        """The last history record and the last snapshot of every quantity."""
        out = dict(self.history[-1]) if self.history else {}
        for name, by_step in self.snapshots.items():
            if by_step:
                out[name] = by_step[max(by_step)]
        return out

    def series(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values) of a history key, or of a scalar quantity recorded at every step."""
        if self.history and key in self.history[0]:
            steps = np.array([h["step"] for h in self.history])
            vals = np.array([np.nan if h[key] is None else h[key] for h in self.history], dtype=float)
            return steps, vals
        require(key in self.snapshots, f"run {self.spec.name}: nothing recorded under {key!r}")
        by_step = self.snapshots[key]
        steps = np.array(sorted(by_step))
        return steps, np.array([float(by_step[s]) for s in steps])

    def first_step(self, key: str, where: Callable[[Any], bool], never: float = math.inf) -> float:
        """The first step whose value of ``key`` satisfies ``where`` (``never`` if none does): a key of the
        history (every step), else a recorded quantity (the steps it was recorded at)."""
        if self.history and key in self.history[0]:
            return float(next((h["step"] for h in self.history if where(h[key])), never))
        require(key in self.snapshots, f"run {self.spec.name}: nothing recorded under {key!r}")
        by_step = self.snapshots[key]
        return float(next((s for s in sorted(by_step) if where(by_step[s])), never))

    def at(self, key: str, step: int) -> tuple[int, Any]:
        """(actual step, value): the recorded snapshot at the largest step <= ``step``."""
        require(key in self.snapshots, f"run {self.spec.name}: nothing recorded under {key!r}")
        recorded = [s for s in self.snapshots[key] if s <= step]
        require(bool(recorded), f"run {self.spec.name}: no {key} recorded at or before step {step}")
        s = max(recorded)
        return s, self.snapshots[key][s]


class Results(dict):
    """The figure's runs by name (``results["p05"]`` is a :class:`RunResult`), plus ``reduced``."""

    reduced: bool = False


# ------------------------------------------------------------------------------------ sources
Source = Callable[[Results], Any]


@dataclass(frozen=True)
class History:
    """Per-step values of a history key (or of a scalar quantity recorded every step): (steps, values)."""

    run: str
    key: str

    def __call__(self, results: Results) -> tuple[np.ndarray, np.ndarray]:
        return results[self.run].series(self.key)


@dataclass(frozen=True)
class Final:
    """A history key or recorded quantity at the last step."""

    run: str
    key: str

    def __call__(self, results: Results) -> Any:
        final = results[self.run].final
        require(self.key in final, f"run {self.run}: no final {self.key!r}")
        return final[self.key]


@dataclass(frozen=True)
class Snapshot:
    """A recorded quantity at ``step`` (the largest recorded step not after it): (step, value)."""

    run: str
    key: str
    step: int

    def __call__(self, results: Results) -> tuple[int, Any]:
        return results[self.run].at(self.key, self.step)


@dataclass(frozen=True)
class Computed:
    """Any function of the results; ``fn(results) -> value``."""

    fn: Callable[[Results], Any]
    description: str = ""

    def __call__(self, results: Results) -> Any:
        return self.fn(results)


# -------------------------------------------------------------------------------------- panels
@dataclass
class Panel:
    """One panel of a figure.

    ``kind``:
      * ``line``: ``series`` maps a legend label to a source giving (x, y) or a 1-D y;
        ``ref`` draws horizontal reference lines {label: value}; ``logx``/``logy``.
        (``ref`` values and ``xlabel`` may also be sources, for what depends on the runs, such as
        their N in reduced mode.)
      * ``heatmap``: ``data`` gives a 2-D array (or (step, array) from :class:`Snapshot`).
      * ``bar``: ``data`` gives a 1-D array, or a dict label -> value.
      * ``text``: ``data`` gives a string (``$...$`` is rendered as mathtext).
      * ``table``: ``data`` gives a :class:`Table`.
      * ``custom``: ``draw(ax, results)`` does the drawing.

    ``options`` holds drawing details, for lines: ``style`` (a matplotlib format such as ``"o-"``),
    ``styles`` (the same per series label), ``palette`` (a seaborn palette name, by default
    ``colorblind``; a sequential one such as ``flare`` for series ordered by a swept value),
    ``colours`` (series label -> index into the palette, by default the series' place), ``legend``
    (True or False: drawn or not; by default drawn when there is more than one line),
    ``legend_loc``, ``legend_columns`` and ``legend_anchor`` (axes coordinates: the legend is drawn
    there, beside the panel, without shrinking the grid), ``yticks``, ``dashes`` (True: the series
    after the first are dashed, so that a curve lying on an earlier one still shows); for bars
    ``rotation`` of the labels; for heatmaps ``zero`` (True: the colour scale includes 0, so that a
    near-constant matrix looks constant); for heatmaps and bars ``range`` (a fixed (low, high) value
    scale) and ``share`` (a group name: the figure's panels of one group share one value scale); for
    the other kinds see :mod:`experiments.plots`.
    """

    kind: str
    title: str = ""
    series: dict[str, Source] = field(default_factory=dict)
    data: Optional[Source] = None
    draw: Optional[Callable[[Any, Results], None]] = None
    xlabel: str | Source = ""
    ylabel: str = ""
    ref: dict[str, float | Source] = field(default_factory=dict)
    logx: bool = False
    logy: bool = False
    ylim: Optional[tuple[float, float]] = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(self.kind in PANEL_KINDS, f"panel kind must be one of {', '.join(PANEL_KINDS)}, got {self.kind!r}")


PANEL_KINDS = ("line", "heatmap", "bar", "text", "table", "custom")


@dataclass
class Table:
    """What a ``table`` panel shows: column headings, rows of cells, and a note under it."""

    columns: list[str]
    rows: list[list[Any]]
    note: str = ""


# -------------------------------------------------------------------------------------- claims
@dataclass(frozen=True)
class Check:
    """How a measured value is compared with what the paper says.

    ``op``: ``near`` (|x - target| <= tol), ``at_least``, ``at_most``, ``between`` (lo <= x <= hi),
    ``true`` (x is truthy). Build with the helpers :func:`near`, :func:`at_least`, ...
    """

    op: str
    target: Any = None
    tol: float = 0.0
    hi: Any = None

    def holds(self, x: Any) -> bool:
        if self.op == "true":
            return bool(x)
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return False
        x = float(x)
        if self.op == "near":
            return abs(x - self.target) <= self.tol
        if self.op == "at_least":
            return x >= self.target
        if self.op == "at_most":
            return x <= self.target
        if self.op == "between":
            return self.target <= x <= self.hi
        raise RwinterpError(f"unknown check {self.op!r}")

    def describe(self) -> str:
        if self.op == "near":
            return f"{format_measured(self.target)} ± {format_measured(self.tol)}"
        if self.op == "at_least":
            return f"≥ {format_measured(self.target)}"
        if self.op == "at_most":
            return f"≤ {format_measured(self.target)}"
        if self.op == "between":
            return f"in [{format_measured(self.target)}, {format_measured(self.hi)}]"
        return "yes"


def near(target: float, tol: float) -> Check:
    return Check("near", float(target), float(tol))


def at_least(x: float) -> Check:
    return Check("at_least", float(x))


def at_most(x: float) -> Check:
    return Check("at_most", float(x))


def between(lo: float, hi: float) -> Check:
    return Check("between", float(lo), 0.0, float(hi))


def is_true() -> Check:
    return Check("true")


def binomial_tol(p: float, n: int, k: float = 3.0) -> float:
    """``k`` standard errors of an accuracy estimated from ``n`` test samples at true value ``p``."""
    return k * math.sqrt(max(p * (1 - p), 1e-12) / n)


def accuracy_near(run: str, target: float, k: float = 3.0) -> Callable[[Results], Check]:
    """``near(target, k standard errors)`` with the standard error of ``run``'s test-set size."""

    def check(results: Results) -> Check:
        return near(target, binomial_tol(target, len(results[run].test), k))

    return check


def format_measured(x: Any) -> str:
    """A value as the report shows it (4 significant digits, yes/no, n/a for none)."""
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, list):
        text = json.dumps(x)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(x)


@dataclass
class Claim:
    """One statement of the paper, checked on the runs.

    ``claim``: the sentence. ``measure``: a source returning the measured value (a number or a
    bool). ``check``: the comparison. ``expected``: text for the report (default: the check's).
    ``reduced``: the claim must also hold in reduced mode (asserted by the CI test).
    ``note``: why it may not hold and what was tried (shown in the report when it fails),
    or context for the measured number. ``why``: a measured account of what the runs did instead,
    appended to the note when the claim does not hold (a sentence built from the results, so the
    explanation of a failure cannot drift from the numbers).
    """

    claim: str
    measure: Source
    check: Union[Check, Callable[[Results], Check]]
    expected: str = ""
    reduced: bool = False
    note: str = ""
    why: Optional[Callable[[Results], str]] = None


@dataclass
class ClaimResult:
    figure: str
    claim: str
    expected: str
    measured: Any
    holds: bool
    note: str = ""
    error: Optional[str] = None

    def to_dict(self) -> dict[str, Any]:
        return {"figure": self.figure, "claim": self.claim, "expected": self.expected,
                "measured": self.measured, "holds": self.holds, "note": self.note, "error": self.error}


# -------------------------------------------------------------------------------------- figure
@dataclass
class FigureSpec:
    """A figure of the paper (``id`` "4", "fig4"), or an extra study (``id`` "fragility").

    ``caption``: the sentence saying what to see. ``layout``: (rows, cols) of the panel grid
    (default: one row). ``reduced``: overrides for reduced mode applied to every run. ``shortfall``: one
    sentence on why the claims that do not hold do not (the opening table of ``REPRODUCTION.md``; each
    claim's note and ``docs/discussion.md`` say more).
    """

    id: str
    title: str
    caption: str
    runs: list[RunSpec] = field(default_factory=list)
    panels: list[Panel] = field(default_factory=list)
    claims: list[Claim] = field(default_factory=list)
    layout: Optional[tuple[int, int]] = None
    reduced: dict[str, dict[str, Any]] = field(default_factory=dict)
    panel_size: tuple[float, float] = (4.0, 3.2)
    shortfall: str = ""

    def __post_init__(self) -> None:
        names = [r.name for r in self.runs]
        require(len(names) == len(set(names)), f"figure {self.id}: run names must be unique")

    def resolved_runs(self, reduced: bool) -> list[RunSpec]:
        return [r.resolved(reduced, self.reduced) for r in self.runs]


def walk_run(name: str, K: int, p: float, N: int, *, model: Optional[dict] = None,
             train: Optional[dict] = None, record: Optional[Record] = None,
             reduced: Optional[dict] = None, label: str = "") -> RunSpec:
    """Shorthand for a circle-walk run (paper defaults: M 1000, zero init, lr 1, 50 steps)."""
    return RunSpec(name, {"kind": "circle", "K": K, "p": float(p), "N": N}, dict(model or {}),
                   dict(train or {}), record or Record(), dict(reduced or {}), label)

