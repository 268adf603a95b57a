"""Shared builders for the zero-initialisation walk figures (4, 5, 8, 9): one figure layout, two regimes.

Panels as in the paper: (a) test accuracy by step, (b) V after training, (c) mean attention of the
query slot over the test walks by position, (d) the same for the last positions.
"""

from __future__ import annotations

import numpy as np

from experiments.spec import (Claim, Computed, FigureSpec, Final, History, Panel, Snapshot, Record, Results,
                              binomial_tol, accuracy_near, near, at_least, at_most, walk_run)

#: Reduced mode: a short walk, small embeddings, few steps and walks (seconds per figure).
REDUCED = {"model": {"pos_dim": 200}, "train": {"steps": 10, "n_train": 300, "n_test": 300}}


def walk_panels(run: str, K: int, N: int, bayes: float, steps: int) -> list[Panel]:
    return [
        Panel("line", "(a) test accuracy", series={"test": History(run, "test_accuracy"),
                                                   "train": History(run, "train_accuracy")},
              ref={"Bayes max(p, 1-p)": bayes, "chance 1/K": 1 / K}, xlabel="step", ylabel="accuracy",
              ylim=(0, 1.05)),
        Panel("heatmap", "(b) V after training", data=Snapshot(run, "V", steps), xlabel="token x (column)",
              ylabel="output row", options={"annot": K <= 8}),
        Panel("bar", "(c) mean attention by position", data=Final(run, "attention"), xlabel="position",
              ylabel="attention"),
        Panel("bar", "(d) last 8 positions", data=Computed(lambda r: dict(
            (str(i + 1), float(a)) for i, a in list(enumerate(r[run].final["attention"]))[-8:])),
            xlabel="position (N = query slot)", ylabel="attention"),
    ]


def first_step_within(results: Results, run: str, target: float, tol: float) -> float:
    """First step whose test accuracy lies within ``tol`` of ``target`` (inf if none)."""
    for h in results[run].history:
        if abs(h["test_accuracy"] - target) <= tol:
            return float(h["step"])
    return float("inf")


def learning_figure(fig_id: str, K: int, N: int, p: float = 0.5, steps: int = 50) -> FigureSpec:
    """Figs 4 and 8: zero init learns the walk (accuracy max(p, 1-p), attention on the parent)."""
    run = walk_run("walk", K, p, N, train={"steps": steps}, record=Record(("V", "attention")))
    n_test = 1000
    tol = binomial_tol(max(p, 1 - p), n_test)
    return FigureSpec(
        id=fig_id,
        title=f"zero initialisation learns the walk (K = {K}, N = {N}, p = {p})",
        caption=(f"Test accuracy reaches the Bayes-optimal {max(p, 1 - p):.2f} within a few steps, V takes the "
                 "pattern of Pi^T (mass on the +1 and -1 neighbours), and the query slot puts almost all its "
                 "attention on position N-1, the parent of the label."),
        runs=[run],
        panels=walk_panels("walk", K, N, max(p, 1 - p), steps),
        layout=(1, 4),
        reduced=REDUCED,
        claims=[
            Claim(f"test accuracy after {steps} steps is optimal, max(p, 1-p)",
                  Final("walk", "test_accuracy"), accuracy_near("walk", max(p, 1 - p)), reduced=True,
                  note="tolerance: 3 standard errors of the test-set accuracy"),
            Claim("optimal accuracy is reached within a few steps (<= 5)",
                  Computed(lambda r: first_step_within(r, "walk", max(p, 1 - p), tol)), at_most(5), reduced=True),
            Claim("attention on the parent position N-1 is near 1 (Theorem 3.1: 1 - exp(-Omega(N)))",
                  Final("walk", "parent_attention"), at_least(0.99), reduced=True),
            Claim("V points towards Pi^T: ||V/||V|| - Pi^T/||Pi^T|| ||_F is small",
                  Final("walk", "v_distance"), at_most(0.25), reduced=True,
                  note="the theorem's rate is O(T^-1/2); after 50 steps the distance is still visibly non-zero"),
        ],
    )
