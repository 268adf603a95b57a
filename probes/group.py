"""Scores across a group of runs: every seed probed alike, each score as a mean with an interval over seeds.

One trained model is one draw from its training procedure: another seed gives other weights, other
test walks and other scores. :func:`score_group` probes every run of a group (the runs ``rwinterp train
--seeds`` writes, or any runs of one task and architecture) with the one scorecard
(:func:`probes.scoring.scorecard`, each run on its own test walks), and reduces each scalar score to an
:class:`probes.stats.Estimate`: the per-run values, their mean and a 95% bootstrap interval of the mean
over runs (the runs are resampled, not the walks).

With a random baseline each run gets its own random-initialised models (``baseline_models`` of them, seeds
that no other run of the group uses, probed on that run's test walks), and the score's ``random`` value of a
run is the mean over its random models. The ``difference`` trained - random is then paired run by run, and
its interval resamples the pairs: a score that beats random in every seed by a similar margin has a narrow
interval above 0 even when the scores themselves vary a lot across seeds.

:func:`compare_groups` sets two groups side by side: per score both groups' estimates and the difference of
their means (B - A), whose interval resamples each group on its own (the runs of two groups are not paired).

A score undefined for a run (NaN, e.g. a patching ratio whose denominator vanishes) is left out of that
score's mean and interval; with fewer than two runs left, the interval is undefined, never a point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from tqdm.auto import tqdm

from probes.config import ProbeConfig
from probes.heads import SCORES
from probes.scoring import HEADLINE, Comparison, Scorecard, compare_to_random, nest_scores, scorecard
from probes.stats import RUN_RESAMPLES, Estimate, finite_mean
from rwinterp.errors import RwinterpError, require
from rwinterp.runs import first_difference, model_config, model_kind_of
from rwinterp.tasks import Batch

#: The key of a head's ablation score (the loss increase, in nats, of mean-ablating it).
ABLATION = "ablation_loss_increase"


def run_values(card: Scorecard) -> dict[str, float]:
    """Every scalar score of one run's scorecard under its flat key (:meth:`Scorecard.flat`), with each head's
    ablation loss increase as ``heads.L{l}H{h}.ablation_loss_increase``."""
    out = dict(card.flat())
    for label, value in (card.head_ablation or {}).items():
        out[f"heads.{label}.{ABLATION}"] = float(value[0] if isinstance(value, (tuple, list)) else value)
    return out


@dataclass
class GroupScore:
    """One score over a group: the trained runs and, with a baseline, the random models (each run's value the
    mean over its own random models) and the paired difference trained - random."""

    trained: Estimate
    random: Optional[Estimate] = None
    difference: Optional[Estimate] = None

    def to_dict(self) -> dict[str, Any]:
        out = self.trained.to_dict()
        if self.random is not None:
            out["random"] = self.random.to_dict()
            out["difference"] = self.difference.to_dict()
        return out


@dataclass
class GroupScores:
    """The scores of a group of runs (:func:`score_group`).

    ``scores`` is keyed as :meth:`Scorecard.flat` (plus each head's ablation score, :func:`run_values`); ``cards``
    holds each run's scorecard, ``baselines`` each run's comparison with its random models (with a baseline),
    ``random_values`` each run's random models' values of every score (for figures)."""

    sources: list[str]
    seeds: list[Optional[int]]
    task: dict[str, Any]
    model: str
    kind: str
    sample_name: str
    n_walks: list[int]
    config: ProbeConfig
    cards: list[Scorecard]
    scores: dict[str, GroupScore]
    resamples: int = RUN_RESAMPLES
    baselines: Optional[list[Comparison]] = None
    baseline_seeds: Optional[list[list[int]]] = None
    random_values: Optional[list[list[dict[str, float]]]] = field(default=None, repr=False)
    #: The task in words (``Task.describe()``).
    description: str = ""

    @property
    def n_runs(self) -> int:
        return len(self.cards)

    def keys(self, headline: bool = True) -> list[str]:
        """The headline scores and every head's scores (``headline=False``: every score)."""
        if not headline:
            return list(self.scores)
        heads = [k for k in self.scores if k.startswith("heads.L") and k.rsplit(".", 1)[1] in (*SCORES, ABLATION)]
        return [k for k in HEADLINE if k in self.scores] + heads

    def to_json(self) -> dict[str, Any]:
        """``{"runs", "seeds", "task", "model", "kind", "n_runs", "n_walks", "confidence", "resamples",
        "scores"}`` (and ``"baseline_models"``, ``"baseline_seeds"`` with a baseline): ``scores`` nested as the
        single-run probe's JSON (per head under ``heads.L{l}H{h}``), each score ``{"values", "mean",
        "interval"}`` and, with a baseline, ``"random"`` and ``"difference"`` of the same form."""
        out = {"runs": self.sources, "seeds": self.seeds, "task": self.task, "model": self.model, "kind": self.kind,
               "n_runs": self.n_runs, "n_walks": self.n_walks, "confidence": self.config.confidence,
               "resamples": self.resamples}
        if self.baseline_seeds is not None:
            out["baseline_models"] = len(self.baseline_seeds[0])
            out["baseline_seeds"] = self.baseline_seeds
        out["scores"] = nest_scores({k: s.to_dict() for k, s in self.scores.items()})
        return out


def check_comparable(models: Sequence[Any], tasks: Sequence[Any], names: Sequence[str]) -> None:
    """Refuse, with a one-line error, runs that are not draws of one setting: another task, model kind or
    model configuration (beyond the seed) than the first run's."""
    require(len(models) >= 1, "a group needs at least one run")

    def setting(model: Any, task: Any) -> dict[str, Any]:
        return {"task": task.to_dict(), "model_kind": model_kind_of(model),
                "model": {k: v for k, v in model_config(model).items() if k != "seed"}}

    first = setting(models[0], tasks[0])
    for model, task, name in zip(models[1:], tasks[1:], names[1:]):
        found = first_difference(first, setting(model, task))
        if found is not None:
            key, theirs, this = found
            raise RwinterpError(f"the runs are not comparable: {key} is {this!r} in {name} but {theirs!r} in "
                                f"{names[0]}")


def group_baseline_seeds(models: Sequence[Any], n: int, start: int = 1000) -> list[list[int]]:
    """``n`` random-model seeds per run, no seed used twice nor equal to any run's own seed."""
    own = {getattr(m.cfg, "seed", None) for m in models}
    seeds, s = [], start
    while len(seeds) < n * len(models):
        if s not in own:
            seeds.append(s)
        s += 1
    return [seeds[i * n:(i + 1) * n] for i in range(len(models))]


def score_group(
    models: Sequence[Any],
    tasks: Sequence[Any],
    data: Sequence[Batch],
    config: ProbeConfig = ProbeConfig(),
    baseline_models: int = 0,
    sources: Optional[Sequence[str]] = None,
    resamples: int = RUN_RESAMPLES,
) -> GroupScores:
    """Probe every run (``models[i]`` on ``tasks[i]``'s walks ``data[i]``) with :func:`probes.scoring.scorecard`
    and reduce each score over the runs (see the module docstring). ``baseline_models``: random models per
    run (0: no baseline). The intervals over runs are seeded by ``config.seed`` and use ``resamples`` draws;
    every score is resampled with the same draws of the runs."""
    n = len(models)
    require(n >= 1 and len(tasks) == n and len(data) == n, "a group needs a task and test data for every run")
    sources = list(sources) if sources is not None else [f"run {i}" for i in range(n)]
    check_comparable(models, tasks, sources)
    require(baseline_models >= 0, f"baseline_models must be >= 0, got {baseline_models}")
    quiet = None if config.progress is None else not config.progress
    cards, comparisons, random_values = [], [], []
    seed_lists = group_baseline_seeds(models, baseline_models) if baseline_models else None
    for i in tqdm(range(n), desc="runs", leave=False, disable=quiet):
        card = scorecard(models[i], tasks[i], data[i], config)
        cards.append(card)
        if seed_lists is not None:
            comparison = compare_to_random(models[i], tasks[i], data[i], seed_lists[i], config, trained=card)
            comparisons.append(comparison)
            random_values.append([run_values(c) for c in comparison.baselines])
    per_run = [run_values(c) for c in cards]
    keys = list(dict.fromkeys(k for values in per_run for k in values))
    est = dict(confidence=config.confidence, resamples=resamples, seed=config.seed)
    scores = {}
    for key in keys:
        trained = Estimate.of([v.get(key, math.nan) for v in per_run], **est)
        if seed_lists is None:
            scores[key] = GroupScore(trained)
            continue
        random = Estimate.of([finite_mean([r.get(key, math.nan) for r in run]) for run in random_values], **est)
        scores[key] = GroupScore(trained, random, Estimate.paired(trained, random, **est))
    first = cards[0]
    return GroupScores(
        sources=sources, seeds=[getattr(m.cfg, "seed", None) for m in models], task=first.task, model=first.model,
        kind=first.kind, sample_name=first.sample_name, n_walks=[c.n_walks for c in cards], config=first.config,
        cards=cards, scores=scores, resamples=resamples, baselines=comparisons or None, baseline_seeds=seed_lists,
        random_values=random_values or None, description=tasks[0].describe())


@dataclass
class GroupComparison:
    """Two groups' scores side by side (:func:`compare_groups`): per score both estimates and ``B - A``."""

    names: tuple[str, str]
    a: GroupScores
    b: GroupScores
    difference: dict[str, Estimate]

    def keys(self) -> list[str]:
        """The headline and per-head scores both groups have."""
        return [k for k in self.a.keys() if k in self.b.scores]

    def to_json(self) -> dict[str, Any]:
        """``{"A": group JSON, "B": group JSON, "difference": {score: {"mean", "interval"}}}`` (nested as
        :meth:`GroupScores.to_json`'s scores)."""
        na, nb = self.names
        return {na: self.a.to_json(), nb: self.b.to_json(),
                "difference": nest_scores({k: {"mean": d.mean, "interval": list(d.interval)}
                                           for k, d in self.difference.items()})}


def compare_groups(a: GroupScores, b: GroupScores, names: tuple[str, str] = ("A", "B")) -> GroupComparison:
    """Per score both groups' estimates and the difference of means ``B - A``, its interval from resampling
    each group's runs independently (seeded by ``a``'s probe seed)."""
    est = dict(confidence=a.config.confidence, resamples=a.resamples, seed=a.config.seed)
    diff = {k: Estimate.difference(a.scores[k].trained, b.scores[k].trained, **est) for k in a.scores if k in b.scores}
    return GroupComparison(names, a, b, diff)


def families(keys: Sequence[str]) -> dict[str, list[str]]:
    """The scores drawn together, by family: ``overview`` (accuracy and the chosen head's attention on the
    parents), ``attention``, ``patching`` (and attribution patching), ``transition``, ``heads`` (each head's
    attention scores) and ``ablation`` (each head's ablation loss increase, in nats)."""
    out: dict[str, list[str]] = {}
    for key in keys:
        if key.startswith("heads."):
            name = "ablation" if key.endswith(ABLATION) else "heads"
        elif "." not in key:
            name = "overview"
        else:
            name = key.split(".")[0].replace("attribution_patching", "patching")
        out.setdefault(name, []).append(key)
    return out


def score_label(key: str) -> str:
    """A score's name for tables and figures: ``L0H1 previous_token`` for a head's score, the key otherwise."""
    if key.startswith("heads."):
        _, head, name = key.split(".", 2)
        return f"{head} {name}"
    return key

