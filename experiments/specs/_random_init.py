"""Shared runs, quantities and measurements for the random-initialisation figures (6, 11, 12, 13).

The paper trains its model from a small Gaussian initialisation with x~_i normalised to unit length
inside the attention, at p = 0.5 (Figs 6a,b and 11) and p = 1 (Figs 6c,d, 12 and 13), and leaves
details unstated: how the loss is reduced over the walks, which vectors are normalised, and how the
model's output becomes a distribution for the KL. Every figure therefore trains the same few
*readings* of those details side by side (:data:`READINGS`), each at p = 0.5 and p = 1, and checks
every claim on every reading; both ``f+/sum f+`` (negative scores clipped to 0) and ``softmax(f)``
are recorded for the KL. Side studies (:class:`Sweep`) change one detail at a time: the learning
rate, the length x~ is normalised to and the optimiser (Fig 6), and the initialisation scale
(Fig 13, which also trains seeds 1 and 2 of the summed readings). The runs are seeded (seed 0);
another seed by changing ``seed`` in a run's model and train dicts.

What the runs show, with the reproduction's numbers, is in ``docs/discussion.md`` (Figures 6, 11,
12 and 13).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from experiments.spec import (Claim, Computed, FigureSpec, Final, History, Panel, Record, Results, RunSpec, StepView,
                              accuracy_near, at_least, at_most, between, is_true, quantity, walk_run)
from experiments.specs._walk import first_step_within, neighbours_dominate
from rwinterp.errors import require

K, N = 6, 97
#: The paper's random-initialisation setting (Figs 6 and 11 to 13; ``docs/model.md`` section 5).
MODEL = {"pos_dim": 1000, "init": "gaussian", "init_sigma": 0.01, "normalize_tokens": True}
TRAIN = {"lr": 0.01, "eps": 0.1, "steps": 1000, "n_train": 1000, "n_test": 1000}
#: The steps at which the paper shows V and the averaged token (Figs 12, 13).
SHOWN = (100, 400, 700, 1000)
#: Every how many steps the per-step quantities (KL, V, averaged token) are recorded.
EVERY = 10
#: The averaged token counts as walk-dependent (symmetry broken) once its largest per-coordinate
#: variance over the test walks exceeds this (a one-hot token under uniform labels has 5/36 = 0.14;
#: uniform attention on a deterministic walk gives exactly 0).
BROKEN_VARIANCE = 0.01
#: V counts as "proportional to all-ones" while max|V[:, j] - V[:, 0]| / max|V| stays below this
#: (the N(0, 0.01^2) initial noise alone leaves about 0.06 after 1000 steps of the literal reading).
ONES_SPREAD = 0.1
#: Reduced mode (CI): a short walk (N = 2K + 1), small embeddings, few steps and walks; snapshots every 5 steps.
REDUCED = {"task": {"N": 2 * K + 1}, "model": {"pos_dim": 200}, "train": {"steps": 20, "n_train": 200, "n_test": 200},
           "record": {"at": tuple(range(0, 21, 5))}}
QUANTITIES = ("V", "attention", "averaged_token", "v_column_spread", "kl_normalised", "kl_softmax")
#: The initialisation scale of the ``summed_tuned`` reading, found with :data:`SIGMA_SWEEP` on seed 0.
TUNED_SIGMA = 4e-6
#: Seeds of the p = 1 runs that test whether a reading's symmetry-breaking step is one seed's (0 is every figure's).
SEEDS = (0, 1, 2)
#: "Roughly 400 steps" for p = 0.5 to reach about 0.5 accuracy, read as this range.
ROUGHLY_400 = (200, 600)
#: "About step 700" for the p = 1 symmetry break (the paper shows 700 still symmetric, 1000 broken), read as this range.
ABOUT_700 = (600, 1000)
#: "Much more weight" for one token of the example walk's averaged token at step 1000 (uniform: 1/K).
MUCH_MORE_WEIGHT = 0.5


@dataclass(frozen=True)
class Reading:
    """One reading of the paper's under-specified random-initialisation setting."""

    name: str
    label: str
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    about: str = ""


READINGS = (
    Reading("paper", "as stated: mean loss, x~ and query normalised",
            about="the natural reading of the paper's text: mean loss over the 1000 walks, every x~_i and the "
                  "query x~_N divided by its norm inside the attention"),
    Reading("summed", "loss summed over the walks",
            train={"reduction": "sum"},
            about="the loss summed, not averaged, over the 1000 training walks: gradient descent at "
                  "lr 0.01 on the sum is gradient descent at lr 10 on the mean"),
    Reading("keys", "only the keys normalised",
            model={"normalize_query": False},
            about="mean loss; the keys x~_i are normalised but the query x~_N keeps its norm sqrt(M/2), "
                  "so the attention parameters learn M/2 = 500 times faster"),
    Reading("summed_tuned", "summed loss, sigma 4e-6 (tuned, not the paper's)",
            model={"init_sigma": TUNED_SIGMA}, train={"reduction": "sum"},
            about="the summed loss with sigma 4e-6, 2500 times smaller than the paper's N(0, 0.01^2): NOT the "
                  "paper's setting, but the value of the sigma sweep (Fig 13 g) at which seed 0's p = 1 symmetry "
                  "breaks late enough to be visible and still below 100% at step 1000; whether that survives "
                  "another seed is a claim of Fig 13"),
)


def reading_named(name: str) -> Reading:
    return next(r for r in READINGS if r.name == name)


def p_tag(p: float) -> str:
    """``p05`` or ``p1``: the p part of a run name."""
    return f"p{'05' if p == 0.5 else '1'}"


def run_name(reading: Reading, p: float) -> str:
    return f"{reading.name}_{p_tag(p)}"


def make_run(reading: Reading, p: float) -> RunSpec:
    record = Record(QUANTITIES, at=tuple(range(0, TRAIN["steps"] + 1, EVERY)))
    return walk_run(run_name(reading, p), K, p, N, model={**MODEL, **reading.model},
                    train={**TRAIN, **reading.train}, record=record, label=reading.label)


def runs(ps: tuple[float, ...] = (0.5, 1.0)) -> list[RunSpec]:
    """Every reading's run at every p in ``ps`` (identical runs are trained once across figures)."""
    return [make_run(r, p) for r in READINGS for p in ps]


def seed_run_name(reading: Reading, seed: int) -> str:
    return f"{run_name(reading, 1.0)}_s{seed}"


def seed_runs(reading: Reading) -> list[RunSpec]:
    """p = 1 under ``reading`` with the other seeds of :data:`SEEDS` (initialisation and walks), recording
    the averaged token, to tell whether its symmetry-breaking step is one seed's."""
    record = Record(("averaged_token",), at=tuple(range(0, TRAIN["steps"] + 1, EVERY)))
    return [walk_run(seed_run_name(reading, seed), K, 1.0, N, model={**MODEL, **reading.model, "seed": seed},
                     train={**TRAIN, **reading.train, "seed": seed}, record=record,
                     label=f"{reading.label}, seed {seed}") for seed in SEEDS[1:]]


def seed_run_names(reading: Reading) -> list[str]:
    """The p = 1 runs of ``reading`` for every seed of :data:`SEEDS` (seed 0 is the figures' run)."""
    return [run_name(reading, 1.0)] + [seed_run_name(reading, s) for s in SEEDS[1:]]


def break_steps(results: Results, reading: Reading) -> list[float]:
    """The symmetry-breaking step at p = 1 for each seed of :data:`SEEDS` (inf where it never breaks)."""
    return [breaking_step(results, name) for name in seed_run_names(reading)]


@dataclass(frozen=True)
class Sweep:
    """One option of the paper's setting varied over ``values``, at every p in ``ps``.

    ``setting(v)`` gives the (model, train) overrides for value ``v`` (on top of :data:`MODEL` and
    :data:`TRAIN`; ``loss`` names the loss they amount to, for labels); ``known`` maps values whose
    runs the readings already train (the paper's value, or one a reading equals) to those readings.
    ``quantities`` are recorded every :data:`EVERY` steps as well.
    """

    key: str
    what: str
    values: tuple[float, ...]
    setting: Callable[[float], tuple[dict[str, Any], dict[str, Any]]]
    known: tuple[tuple[float, str], ...]
    ps: tuple[float, ...] = (0.5,)
    loss: str = "mean loss"
    quantities: tuple[str, ...] = ()

    def run_name(self, value: float, p: float) -> str:
        return f"{self.key}{value:g}_{p_tag(p)}"

    def runs(self) -> list[RunSpec]:
        record = Record(self.quantities, at=tuple(range(0, TRAIN["steps"] + 1, EVERY))) if self.quantities else None
        out = []
        for value in self.values:
            model, train = self.setting(value)
            out += [walk_run(self.run_name(value, p), K, p, N, model={**MODEL, **model}, train={**TRAIN, **train},
                             record=record, label=f"{self.loss}, {self.what} {value:g}") for p in self.ps]
        return out

    def runs_by_value(self, p: float) -> dict[float, str]:
        """Every value's run at ``p``, the readings' runs included, by value."""
        named = {v: run_name(reading_named(name), p) for v, name in self.known}
        named.update({v: self.run_name(v, p) for v in self.values})
        return dict(sorted(named.items()))

    def series(self, p: float) -> dict[str, Any]:
        """Test accuracy by step at ``p``, one curve per value."""
        known = dict(self.known)
        return {f"{self.what} {v:g}" + (f" ({known[v]})" if v in known else ""): History(run, "test_accuracy")
                for v, run in self.runs_by_value(p).items()}

    def all_values(self) -> list[float]:
        return sorted({*self.values, *(v for v, _ in self.known)})


#: The learning rate of the mean loss (Fig 6 (i)); lr 10 is the ``summed`` reading (0.01 x 1000 walks).
LR_SWEEP = Sweep("lr", "lr", (1.0, 3.0, 30.0), lambda lr: ({}, {"lr": lr}), ((0.01, "paper"), (10.0, "summed")))
#: The length r that x~ and the query are normalised to, as r^2 (every attention logit scales by r^2;
#: Fig 6 (j, k)); r^2 = 1 is the paper's unit length.
NORM_SWEEP = Sweep("norm", "r^2", (10.0, 30.0, 100.0), lambda r2: ({"token_norm": math.sqrt(r2)}, {}),
                   ((1.0, "paper"),), ps=(0.5, 1.0))
#: Steps of the AdamW runs: enough to show whether p = 1 reaches 100% (it does at both learning rates).
ADAM_STEPS = 600
#: AdamW (no weight decay) instead of gradient descent, p = 1 only (Fig 6 (l)): the paper says gradient
#: descent, Adam is the usual unstated alternative; does it keep p = 1 below 100%?
ADAM_SWEEP = Sweep("adamw", "AdamW lr", (0.001, 0.01),
                   lambda lr: ({}, {"optimizer": "adamw", "lr": lr, "steps": ADAM_STEPS}), (), ps=(1.0,))
SWEEPS = (LR_SWEEP, NORM_SWEEP, ADAM_SWEEP)
#: The initialisation scale under the summed loss, p = 1 only (Fig 13 (f, g)): a smaller sigma delays the
#: symmetry break; can it put the break near step 700 and keep p = 1 below 100% up to step 1000?
SIGMA_SWEEP = Sweep("sigma", "sigma", (1e-4, 1e-5, 1e-6), lambda s: ({"init_sigma": s}, {"reduction": "sum"}),
                    ((0.01, "summed"), (TUNED_SIGMA, "summed_tuned")), ps=(1.0,), loss="summed loss",
                    quantities=("averaged_token",))


def sweep_matches(results: Results, sweep: Sweep) -> list[float]:
    """The values of ``sweep`` at which p = 0.5 reaches about 0.5 accuracy after roughly 400 steps
    (and, if the sweep runs p = 1, p = 1 stays below 100%, as Fig 6 shows)."""
    lo, hi = ROUGHLY_400
    p1 = sweep.runs_by_value(1.0) if 1.0 in sweep.ps else {}
    return [v for v, run in sweep.runs_by_value(0.5).items()
            if lo <= first_step_within(results, run, 0.5) <= hi
            and (v not in p1 or max_accuracy(results, p1[v]) <= 0.999)]


def only_match(results: Results, sweep: Sweep) -> float:
    """The one matching value of ``sweep`` (:func:`sweep_matches`); NaN if none or several."""
    matching = sweep_matches(results, sweep)
    return matching[0] if len(matching) == 1 else math.nan


def attention_ceiling(model: Any) -> float:
    """The most attention any one position can get when keys and query are unit vectors.

    Every logit is ``k_i . u`` with ``|k_i| = 1`` and ``u = W q``, ``|q| = 1``, so it lies in
    ``[-|u|, |u|]``; one position's softmax weight is then at most ``1 / (1 + (N-1) e^{-2|u|})``.
    """
    cfg = model.cfg
    require(cfg.normalize_tokens and cfg.normalize_query, "the ceiling needs unit-norm keys and query")
    norm = float(model.u.detach().norm())
    return 1.0 / (1.0 + (cfg.n_ctx - 1) * math.exp(-2.0 * norm))


# ----------------------------------------------------------------------------------- quantities
def kl_to_truth(task: Any, tokens: torch.Tensor, scores: torch.Tensor,
                to_distribution: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Mean over walks of KL(P(y | x_{N-1}) || q), q the model's scores ``[B, K]`` made a distribution.

    Terms with P = 0 contribute 0; q is floored at 1e-12 so a zero where P > 0 costs about 27 nats
    rather than infinity.
    """
    scores = scores.detach().to(torch.float64)
    truth = task.conditional(tokens).to(torch.float64)
    q = to_distribution(scores).clamp_min(1e-12)
    terms = torch.where(truth > 0, truth * (truth.clamp_min(1e-300).log() - q.log()), torch.zeros_like(truth))
    return float(terms.sum(-1).mean())


def clipped_normalised(scores: torch.Tensor) -> torch.Tensor:
    """``f+ / sum f+`` with ``f+ = max(f, 0)``; uniform where every score is <= 0."""
    pos = scores.clamp_min(0)
    total = pos.sum(-1, keepdim=True)
    uniform = torch.full_like(pos, 1 / pos.shape[-1])
    return torch.where(total > 0, pos / total.clamp_min(1e-300), uniform)


def softmax(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores, -1)


@quantity("kl_normalised")
def kl_normalised(view: StepView) -> float:
    """KL from the true next-state distribution to the scores normalised as ``f+/sum f+``."""
    return kl_to_truth(view.task, view.test.tokens, view.scores, clipped_normalised)


@quantity("kl_softmax")
def kl_softmax(view: StepView) -> float:
    """KL from the true next-state distribution to ``softmax(f)``."""
    return kl_to_truth(view.task, view.test.tokens, view.scores, softmax)


# --------------------------------------------------------------------------------- measurements
def accuracy_at(results: Results, run: str, step: int) -> float:
    """Test accuracy at ``step`` (the last step if training was shorter)."""
    history = results[run].history
    return float(next((h for h in history if h["step"] == step), history[-1])["test_accuracy"])


def max_accuracy(results: Results, run: str) -> float:
    return float(max(h["test_accuracy"] for h in results[run].history))


def max_variance(avg: dict[str, Any]) -> float:
    """Largest per-coordinate variance of the averaged token over the test walks."""
    return float(np.max(avg["var"]))


def breaking_step(results: Results, run: str) -> float:
    """First recorded step at which the averaged token depends on the walk (variance > threshold)."""
    return results[run].first_step("averaged_token", lambda a: max_variance(a) > BROKEN_VARIANCE)


def full_step(results: Results, run: str) -> float:
    """First step at which the test accuracy exceeds 0.999 (inf if never)."""
    return results[run].first_step("test_accuracy", lambda a: a > 0.999)


def broken_below_full(results: Results, run: str) -> bool:
    """p = 1 at step 1000 as Figs 6 c, 12 and 13 show it: the symmetry broke after about step 700 (first
    step with variance > :data:`BROKEN_VARIANCE` in :data:`ABOUT_700`), one token of the example walk has
    more than :data:`MUCH_MORE_WEIGHT` at step 1000, and the test accuracy never exceeded 0.999."""
    lo, hi = ABOUT_700
    return (lo <= breaking_step(results, run) <= hi and top_token_weight(results, run, 1000) > MUCH_MORE_WEIGHT
            and math.isinf(full_step(results, run)))


def longest_gap(results: Results, names: Any) -> float:
    """The most steps from the symmetry break to 100% test accuracy over the runs ``names`` that reach
    both (NaN if none does)."""
    gaps = [full_step(results, run) - breaking_step(results, run) for run in names]
    finite = [g for g in gaps if math.isfinite(g)]
    return max(finite) if finite else math.nan


def sigma_timeline(results: Results, event: Callable[[Results, str], float]) -> tuple[list[float], list[float]]:
    """``event`` (:func:`breaking_step` or :func:`full_step`) of p = 1 against the sigma of
    :data:`SIGMA_SWEEP`, for the sigmas at which it happens within the run."""
    points = [(v, event(results, run)) for v, run in SIGMA_SWEEP.runs_by_value(1.0).items()]
    finite = [(v, step) for v, step in points if math.isfinite(step)]
    return [v for v, _ in finite], [step for _, step in finite]


def kl_half_step(results: Results, run: str, key: str) -> float:
    """First recorded step at which the KL is at most half that of the uniform prediction (inf if none)."""
    r = results[run]
    uniform = kl_uniform(r)
    return r.first_step(key, lambda v: v <= uniform / 2)


def kl_uniform(run: Any) -> float:
    """KL from the true distribution to the uniform one: log K - H(P(y | x_{N-1}))."""
    truth = run.task.conditional(run.test.tokens).to(torch.float64)
    entropy = -(truth * truth.clamp_min(1e-300).log()).sum(-1).mean()
    return float(math.log(truth.shape[-1]) - entropy)


def kl_speedup(results: Results, reading: Reading, key: str) -> float:
    """How many times sooner the KL halves at p = 0.5 than at p = 1 (a lower bound if p = 1 never
    halves; NaN if p = 0.5 never does)."""
    t05 = kl_half_step(results, run_name(reading, 0.5), key)
    run1 = run_name(reading, 1.0)
    t1 = kl_half_step(results, run1, key)
    if math.isinf(t05):
        return math.nan
    if math.isinf(t1):  # p = 1 never halves: a lower bound, as if it halved just after the last step
        t1 = results[run1].history[-1]["step"] + EVERY
    return t1 / max(t05, 1.0)


def kl_steps(results: Results, reading: Reading, key: str) -> str:
    """When the KL ``key`` halves at p = 0.5 and at p = 1 under ``reading``, as a sentence."""
    steps = [kl_half_step(results, run_name(reading, p), key) for p in (0.5, 1.0)]
    at = [f"at step {t:g}" if math.isfinite(t) else "never" for t in steps]
    return f"The KL halves for p = 0.5 {at[0]} and for p = 1 {at[1]}."


def ones_and_transition(V: Any, Pi: Any) -> tuple[float, float]:
    """(c, beta) of the least-squares fit ``V ~ c 11^T + beta Pi^T``: V's all-ones part and its Pi^T part
    (the probes' affine fit of V^T against Pi, :func:`probes.transition.compare_to_transition`)."""
    from probes.transition import compare_to_transition

    fit = compare_to_transition(torch.as_tensor(np.asarray(V, dtype=float)).T,
                                torch.as_tensor(np.asarray(Pi, dtype=float)))
    return fit.affine_b, fit.affine_a


def v_parts(results: Results, run: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, c, beta) of :func:`ones_and_transition` at every recorded V (computed once per run)."""
    r = results[run]

    def compute():
        Pi = r.task.transition_matrix().numpy()
        steps = sorted(r.snapshots["V"])
        c, beta = np.array([ones_and_transition(r.snapshots["V"][s], Pi) for s in steps]).T
        return np.array(steps), c, beta

    return r.memo("v_parts", compute)


def halving_ratio(K: int) -> float:
    """The least ``beta / c`` at which ``f+/sum f+`` halves the KL of p = 0.5 (against the uniform prediction).

    With all attention on the parent, ``f = c 1 + beta Pi^T x_{N-1}`` puts ``q = (c + beta/2) / (Kc + beta)``
    on each of the two neighbours, and the KL is ``log(1/(2q))`` against ``log(K/2)`` for the uniform
    prediction; it halves when ``q >= 1/sqrt(2K)``, that is when ``beta / c >= sqrt(2K)``.
    """
    return math.sqrt(2 * K)


def ones_part_drift(results: Results, run: str) -> float:
    """Relative change of V's all-ones part c from the first recorded V after attention locks onto the
    parent (mean parent attention above 0.9) to the last step (NaN if it never locks)."""
    steps, c, _ = v_parts(results, run)
    lock = results[run].first_step("parent_attention", lambda a: a > 0.9)
    after = np.flatnonzero(steps >= lock)
    if not after.size:
        return math.nan
    return float(abs(c[-1] - c[after[0]]) / abs(c[-1]))


def transition_to_ones(results: Results, run: str) -> float:
    """``beta / c`` of V at the last step (:func:`ones_and_transition`)."""
    _, c, beta = v_parts(results, run)
    return float(beta[-1] / c[-1])


def spread_at(results: Results, run: str, step: int) -> float:
    """``max|V[:, j] - V[:, 0]| / max|V|`` at the recorded step nearest below ``step``."""
    return float(results[run].at("v_column_spread", step)[1])


def parent_is_largest(results: Results, run: str) -> bool:
    """The parent position N-1 holds the largest mean attention at the last step."""
    attention = np.asarray(results[run].final["attention"])
    return int(np.argmax(attention)) in results[run].task.parent_positions()


def top_token_weight(results: Results, run: str, step: int) -> float:
    """Largest coordinate of the first test walk's averaged token at ``step`` (1/K when uniform)."""
    return float(np.max(results[run].at("averaged_token", step)[1]["example"]))


def outcome(results: Results, reading: Reading) -> str:
    """What the p = 0.5 and p = 1 runs of ``reading`` did, measured (those of the two that the figure
    trains): the explanation of every claim of Figs 6 and 11 to 13 that fails on the reading."""
    parts = []
    name = run_name(reading, 0.5)
    if name in results:
        r, learned = results[name], first_step_within(results, name, 0.5)
        attention = np.asarray(r.final["attention"])
        top, parent = int(np.argmax(attention)), r.task.parent_positions()[0]
        where = "the parent" if top == parent else f"position {top + 1}, not the parent {parent + 1}"
        parts.append((f"p = 0.5 is within 3 standard errors of 0.5 accuracy from step {learned:g}"
                      if math.isfinite(learned) else "p = 0.5 never comes within 3 standard errors of 0.5 accuracy")
                     + f" and ends at {r.history[-1]['test_accuracy']:.3f}, with its largest attention "
                       f"({attention[top]:.3g}) on {where}")
    name = run_name(reading, 1.0)
    if name in results:
        broke, full = breaking_step(results, name), full_step(results, name)
        parts.append((f"p = 1's symmetry is broken at step {broke:g} (checked every {EVERY} steps)"
                      if math.isfinite(broke) else
                      f"p = 1 keeps its symmetry (variance <= {BROKEN_VARIANCE}) for all "
                      f"{results[name].history[-1]['step']} steps")
                     + (f", and it reaches 100% at step {full:g}" if math.isfinite(full)
                        else f", its best accuracy {max_accuracy(results, name):.3f}"))
    return f"What this reading's runs did: {'; '.join(parts)}."


# ------------------------------------------------------------------------------------ claims
def fig6_claims(reading: Reading) -> list[Claim]:
    p05, p1 = run_name(reading, 0.5), run_name(reading, 1.0)
    tag = f"[{reading.name}] "
    why = partial(outcome, reading=reading)

    def kl_why(key: str) -> Callable[[Results], str]:
        return lambda r: f"{kl_steps(r, reading, key)} {outcome(r, reading)}"

    return [
        Claim(tag + "p = 0.5 reaches about 0.5 accuracy after roughly 400 steps (first step within 3 "
              "standard errors of 0.5)",
              Computed(lambda r: first_step_within(r, p05, 0.5)), between(*ROUGHLY_400),
              note="'roughly 400' read as 200 to 600 steps. " + reading.about, why=why),
        Claim(tag + "p = 0.5 accuracy after 1000 steps is about 0.5",
              Computed(lambda r: accuracy_at(r, p05, 1000)), accuracy_near(p05, 0.5),
              note="3 standard errors of the test walks", why=why),
        Claim(tag + "p = 1 does not reach 100% accuracy within 1000 steps (best test accuracy)",
              Computed(lambda r: max_accuracy(r, p1)), at_most(0.999), why=why),
        Claim(tag + "the KL (f+/sum f+) falls much faster for p = 0.5: it halves (vs the uniform "
              "prediction) at least twice as soon as for p = 1",
              Computed(lambda r: kl_speedup(r, reading, "kl_normalised")), at_least(2),
              note="measured: step at which p = 1 halves / step at which p = 0.5 halves (a lower bound if "
                   "p = 1 never halves; null: p = 0.5 never halves within 1000 steps)", why=kl_why("kl_normalised")),
        Claim(tag + "the KL (softmax f) falls much faster for p = 0.5 (same measure)",
              Computed(lambda r: kl_speedup(r, reading, "kl_softmax")), at_least(2),
              note="the paper does not say how f is normalised; softmax is the other natural choice",
              why=kl_why("kl_softmax")),
    ]


def kl_why_claims(reading: Reading) -> list[Claim]:
    """Why the KL of ``f+/sum f+`` falls slowly at p = 0.5 under a reading that learns it."""
    run = run_name(reading, 0.5)
    tag = f"[{reading.name}] "
    return [
        Claim(tag + "why the KL (f+/sum f+) falls slowly for p = 0.5: V = c 11^T + beta Pi^T (+ a small rest), and "
              "its all-ones part c, built while attention is uniform, stops growing once attention is on the "
              "parent (relative change of c from the step parent attention passes 0.9 to step 1000)",
              Computed(lambda r: ones_part_drift(r, run)), at_most(0.01),
              note="c and beta fitted to V by least squares (panels m, n). While attention is uniform the "
                   "averaged token is about 1/K everywhere, so the gradient adds to every column of V alike; "
                   "once attention is on the parent it adds only to the entries of Pi^T, and beta grows like "
                   "sqrt(t) while c stays"),
        Claim(tag + f"and f+/sum f+ halves the KL only once beta / c reaches sqrt(2K) = {halving_ratio(K):.3f}: "
              "beta / c at step 1000 is below it",
              Computed(lambda r: transition_to_ones(r, run)), at_most(halving_ratio(K)),
              note="with all attention on the parent, f+/sum f+ puts (c + beta/2) / (Kc + beta) on each "
                   "neighbour, and the KL, log(1/(2q)), is half the uniform prediction's log(K/2) at "
                   "q = 1/sqrt(2K), that is at beta / c = sqrt(2K); below it the KL claim cannot hold"),
    ]


def fig11_claims(reading: Reading) -> list[Claim]:
    run = run_name(reading, 0.5)
    tag = f"[{reading.name}] "
    why = partial(outcome, reading=reading)
    return [
        Claim(tag + "V recovers Pi^T: in every column the +1 and -1 neighbours hold the largest entries",
              Computed(lambda r: neighbours_dominate(r[run].final["V"], 0.5)), is_true(), note=reading.about,
              why=why),
        Claim(tag + "attention on the parent position N-1 is the largest",
              Computed(lambda r: parent_is_largest(r, run)), is_true(), why=why),
        Claim(tag + "attention on the parent is near 1",
              Computed(lambda r: r[run].history[-1]["parent_attention"]), at_least(0.9), why=why),
    ]


def fig13_seed_claim(reading: Reading) -> Claim:
    lo, hi = ABOUT_700
    return Claim(f"[{reading.name}] the symmetry breaks after about step 700 for every seed "
                 f"{', '.join(map(str, SEEDS))} (seeds whose first step with variance > {BROKEN_VARIANCE} lies in "
                 f"[{lo}, {hi}])",
                 Computed(lambda r: sum(lo <= step <= hi for step in break_steps(r, reading))), at_least(len(SEEDS)),
                 note="tells whether the breaking step of seed 0 is one seed's: the seed sets both the "
                      "initialisation and the walks",
                 why=lambda r: "Breaking steps by seed: " + ", ".join(
                     f"{seed}: {step:g}" if math.isfinite(step) else f"{seed}: none"
                     for seed, step in zip(SEEDS, break_steps(r, reading))) + ".")


def fig12_claims(reading: Reading) -> list[Claim]:
    run = run_name(reading, 1.0)
    tag = f"[{reading.name}] "
    shown = [s for s in SHOWN if s <= 700]

    def why(r: Results) -> str:
        recorded = dict(r[run].at("v_column_spread", s) for s in SHOWN)  # (reduced runs record fewer steps)
        spreads = ", ".join(f"{value:.3g} at step {step}" for step, value in recorded.items())
        return f"Column spread {spreads}. {outcome(r, reading)}"

    return [
        Claim(tag + f"V is proportional to all-ones up to about step 700 (largest column spread at steps "
              f"{', '.join(map(str, shown))}; < {ONES_SPREAD})",
              Computed(lambda r: max(spread_at(r, run, s) for s in shown)), at_most(ONES_SPREAD),
              note="spread = max_j |V[:, j] - V[:, 1]| / max|V| (columns 1..K), at the steps the paper shows; while "
                   "V is small the N(0, 0.01^2) initial noise alone counts", why=why),
        Claim(tag + f"V is no longer proportional to all-ones at step 1000 (column spread >= {ONES_SPREAD})",
              Computed(lambda r: spread_at(r, run, 1000)), at_least(ONES_SPREAD), why=why),
    ]


def fig13_claims(reading: Reading) -> list[Claim]:
    run = run_name(reading, 1.0)
    tag = f"[{reading.name}] "
    return [
        Claim(tag + "the averaged token's variance over walks stays near 0 until about step 700 "
              f"(first step with variance > {BROKEN_VARIANCE})",
              Computed(lambda r: breaking_step(r, run)), between(*ABOUT_700),
              note="'about 700' read as 600 to 1000 (the paper shows 700 still symmetric and 1000 broken)",
              why=partial(outcome, reading=reading)),
        Claim(tag + f"at step 1000 one token of the example walk receives much more weight (> {MUCH_MORE_WEIGHT})",
              Computed(lambda r: top_token_weight(r, run, 1000)), at_least(MUCH_MORE_WEIGHT),
              note="uniform attention gives every token 1/6", why=partial(outcome, reading=reading)),
    ]


def verdict(results: Results, claims: Callable[[Reading], list[Claim]]) -> str:
    """For each reading: REPRODUCES if every claim of the figure holds on it, else how many do."""
    from experiments.runner import evaluate_claims

    lines = []
    for reading in READINGS:
        outcome = evaluate_claims(FigureSpec("verdict", "", "", claims=claims(reading)), results)
        held = sum(c.holds for c in outcome)
        verdict = "REPRODUCES" if held == len(outcome) else f"{held}/{len(outcome)} claims hold"
        lines.append(f"{reading.name}: {verdict}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- panels
def reading_series(p: float, source: Callable[[str], Any]) -> dict[str, Any]:
    return {r.label: source(run_name(r, p)) for r in READINGS}


def snapshot_panels(reading: Reading, p: float, letter: str, what: str) -> list[Panel]:
    """Four panels of one quantity at the paper's steps: V heatmaps (colour scale from 0, so that V
    proportional to all-ones looks uniform), or averaged-token bars on one y scale for every reading
    (so that a variance of 1e-11 does not look as large as one of 0.03)."""
    run = run_name(reading, p)
    panels = []
    for i, step in enumerate(SHOWN):
        title = f"({letter}{i + 1}) {reading.name}: "
        if what == "V":
            panels.append(Panel("heatmap", title + "V", data=_at(run, "V", step), xlabel="token (column)",
                                ylabel="output row", options={"annot": True, "fmt": ".2g", "zero": True}))
        else:
            name = {"example": "averaged token, walk 1", "var": "variance over walks"}[what]
            panels.append(Panel("bar", title + name,
                                data=_at(run, "averaged_token", step, part=what),
                                xlabel="state", ylabel=name, options={"share": f"{p_tag(p)} {what}"}))
    return panels


def attention_panel(reading: Reading, p: float, letter: str) -> Panel:
    """Mean attention of the query slot on every position after training (the parent is N-1), on a log
    axis: uniform attention (1/N each) shows as a flat band, one position's lock as a single bar."""
    run = run_name(reading, p)

    def n(results: Results) -> int:  # the run's N (smaller in reduced mode)
        return results[run].task.seq_len

    return Panel("bar", f"({letter}) {reading.name}: mean attention by position (log)", data=Final(run, "attention"),
                 xlabel=Computed(lambda r: f"position 1..{n(r)} (parent N-1 = {n(r) - 1})", "the run's N"),
                 ylabel="mean attention", logy=True, ylim=(1e-4, 1.5),
                 ref={"uniform 1/N": Computed(lambda r: 1 / n(r), "1/N of the run")})


def _at(run: str, key: str, step: int, part: str = "") -> Computed:
    def get(results: Results) -> tuple[int, Any]:
        s, value = results[run].at(key, step)
        return s, (value[part] if part else value)

    return Computed(get, f"{key}{'.' + part if part else ''} of {run} at step {step}")
