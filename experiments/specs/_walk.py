"""Shared builders for the zero-initialisation walk figures: one layout, two regimes.

* :func:`learning_figure` (Figs 4 and 8, 0 < p < 1): accuracy reaches max(p, 1-p), V takes the
  pattern of Pi^T, attention locks onto the parent position N-1 (Theorem 3.1).
* :func:`failure_figure` (Figs 5 and 9, p = 1, N = rK + 1): attention stays uniform, V stays
  ``v 1^T``, accuracy stays at 1/K (Theorem 4.1), as long as round-off does not break the symmetry.

Panels as in the paper: (a) test accuracy by step, (b) V after training, (c) mean attention of the
query slot over the test walks by position, (d) the last positions; the failure figures add (e)
how far V is from the symmetric state at each step (log scale).
"""

from __future__ import annotations

import numpy as np
import torch

from experiments.spec import (Claim, Computed, FigureSpec, Final, History, Panel, Record, Results, Snapshot,
                              accuracy_near, at_least, at_most, binomial_tol, is_true, walk_run)

#: Reduced mode: small embeddings, few steps and walks (about a second per figure).
REDUCED = {"model": {"pos_dim": 200}, "train": {"steps": 10, "n_train": 300, "n_test": 300}}


#: How far V's columns are from equal (the symmetric state), as the panels label it (columns 1..K).
COLUMN_SPREAD = r"max$_j\,|V_{:,j} - V_{:,1}|$ / max$\,|V|$"


def walk_panels(run: str, K: int, bayes: float, steps: int) -> list[Panel]:
    return [
        Panel("line", "(a) test accuracy", series={"test": History(run, "test_accuracy"),
                                                   "train": History(run, "train_accuracy")},
              ref={"Bayes max(p, 1-p)": bayes, "chance 1/K": 1 / K}, xlabel="step", ylabel="accuracy",
              ylim=(0, 1.05)),
        Panel("heatmap", "(b) V after training", data=Snapshot(run, "V", steps), xlabel="token x (column)",
              ylabel="output row", options={"annot": K <= 8, "zero": True}),
        Panel("bar", "(c) mean attention by position", data=Final(run, "attention"), xlabel="position",
              ylabel="attention"),
        Panel("bar", "(d) last 8 positions", data=Computed(lambda r: {
            str(i + 1): float(a) for i, a in list(enumerate(r[run].final["attention"]))[-8:]}),
            xlabel="position (N = query slot)", ylabel="attention"),
    ]


def first_step_within(results: Results, run: str, target: float) -> float:
    """First step whose test accuracy lies within 3 standard errors of ``target`` (inf if none)."""
    tol = binomial_tol(target, len(results[run].test))
    return results[run].first_step("test_accuracy", lambda a: abs(a - target) <= tol)


def learning_figure(fig_id: str, K: int, N: int, p: float = 0.5, steps: int = 50,
                    n_train: int = 1000, note: str = "") -> FigureSpec:
    """Figs 4 and 8: zero init learns the walk (accuracy max(p, 1-p), attention on the parent)."""
    bayes = max(p, 1 - p)
    run = walk_run("walk", K, p, N, train={"steps": steps, "n_train": n_train}, record=Record(("V", "attention")))
    return FigureSpec(
        id=fig_id,
        title=f"zero initialisation learns the walk (K = {K}, N = {N}, p = {p})",
        caption=(f"Test accuracy reaches the Bayes-optimal {bayes:.2f} within a few steps, V takes the "
                 "pattern of Pi^T (mass on the +1 and -1 neighbours), and the query slot puts almost all its "
                 "attention on position N-1, the parent of the label."),
        runs=[run],
        panels=walk_panels("walk", K, bayes, steps),
        layout=(1, 4),
        reduced=REDUCED,
        claims=[
            Claim(f"test accuracy after {steps} steps is optimal, max(p, 1-p)",
                  Final("walk", "test_accuracy"), accuracy_near("walk", bayes), reduced=True,
                  note="tolerance: 3 standard errors of the test-set accuracy. " + note),
            Claim("optimal accuracy is reached within a few steps (<= 5)",
                  Computed(lambda r: first_step_within(r, "walk", bayes)), at_most(5), reduced=True, note=note),
            Claim("attention on the parent position N-1 is near 1 (Theorem 3.1: 1 - exp(-Omega(N)))",
                  Final("walk", "parent_attention"), at_least(0.99), reduced=True, note=note),
            Claim("V has the pattern of Pi^T: in every column the largest entries are the +1 and -1 neighbours",
                  Computed(lambda r: neighbours_dominate(r["walk"].final["V"], p)), is_true(), reduced=True),
            Claim("V points towards Pi^T: ||V/||V|| - Pi^T/||Pi^T|| ||_F <= 0.25 after training",
                  Final("walk", "v_distance"), at_most(0.25),
                  note="Theorem 3.1 gives only a rate O(T^-1/2), no constant; 0.25 is our reading of "
                       "'has the pattern of Pi^T' (Pi^T itself is at 0, a uniform V at about 1)"),
        ],
    )


def neighbours_dominate(V: np.ndarray, p: float) -> bool:
    """In every column j (token j), the rows j+1 and j-1 (mod K) hold V's largest entries, ordered
    like p and 1-p (equal for p = 1/2 up to a small relative tolerance)."""
    V = np.asarray(V)
    K = V.shape[0]
    for j in range(K):
        col = V[:, j]
        up, down = col[(j + 1) % K], col[(j - 1) % K]
        others = np.delete(col, [(j + 1) % K, (j - 1) % K])
        if min(up, down) <= others.max():
            return False
        if p > 0.5 and not up > down or p < 0.5 and not down > up:
            return False
    return True


def prediction_count(results: Results, run: str) -> int:
    """How many different labels the trained model predicts on the test walks."""
    from rwinterp.metrics import predict

    r = results[run]
    with torch.no_grad():
        return int(predict(r.model.scores(r.test.tokens)).unique().numel())


def rows_follow_label_counts(results: Results, run: str) -> bool:
    """V = v 1^T with v ordered like the training label counts (Theorem 4.1 with a finite sample)."""
    r = results[run]
    v = np.asarray(r.final["V"]).mean(1)
    counts = np.bincount(r.train_data.labels.numpy(), minlength=len(v))
    return all(v[i] > v[j] for i in range(len(v)) for j in range(len(v)) if counts[i] > counts[j])


def failure_figure(fig_id: str, K: int, N: int, steps: int = 50, note: str = "") -> FigureSpec:
    """Figs 5 and 9: the deterministic walk (p = 1) is never learned from zero initialisation."""
    run = walk_run("walk", K, 1.0, N, train={"steps": steps},
                   record=Record(("V", "attention", "v_column_spread", "attention_spread"), at=None))
    reduced = {**REDUCED, "task": {"N": 2 * K + 1}}
    return FigureSpec(
        id=fig_id,
        title=f"zero initialisation cannot learn the deterministic walk (K = {K}, N = {N}, p = 1)",
        caption=(f"A deterministic walk with N - 1 = {N - 1} tokens visits every node {(N - 1) // K} times, so the "
                 "uniformly averaged token is the same for every walk: attention stays uniform, V stays "
                 "proportional to all-ones and accuracy stays at 1/K (Theorem 4.1). Each row of V scales with "
                 "how often its state is the label of a training walk (colour scale from 0). "
                 "Panel (e) shows how far V and the attention are from that symmetric state at each step: exactly 0 "
                 "in floating point too (drawn at the axis' 0, below its decades), as training keeps equal quantities "
                 "bit-for-bit equal (the fragility study shows what round-off does otherwise)."),
        runs=[run],
        panels=walk_panels("walk", K, 1.0, steps) + [
            Panel("line", "(e) distance from the symmetric state", series={
                COLUMN_SPREAD: History("walk", "v_column_spread"),
                "attention spread on tokens": History("walk", "attention_spread")},
                xlabel="step", ylabel="relative spread (log)", logy=True, options={"style": ".-", "dashes": True}),
        ],
        layout=(1, 5),
        reduced=reduced,
        claims=[
            Claim("test accuracy stays at chance, 1/K",
                  Final("walk", "test_accuracy"), accuracy_near("walk", 1 / K), reduced=True,
                  note="tolerance: 3 standard errors of the test-set accuracy. " + note),
            Claim("the model predicts one label for every walk (it cannot tell walks apart)",
                  Computed(lambda r: prediction_count(r, "walk")), at_most(1), reduced=True, note=note),
            Claim("attention is uniform over the N-1 tokens (relative spread, worst test walk)",
                  Final("walk", "attention_spread"), at_most(1e-9), reduced=True, note=note),
            Claim("V is proportional to all-ones along tokens: its columns are identical (relative spread)",
                  Final("walk", "v_column_spread"), at_most(1e-9), reduced=True, note=note),
            Claim("V's rows scale with the training label frequencies (ordered like the label counts)",
                  Computed(lambda r: rows_follow_label_counts(r, "walk")), is_true(), reduced=True, note=note),
        ],
    )
