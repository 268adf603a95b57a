"""Figure 2: the transition matrices Pi of the walk on a circle of K = 6 nodes, p = 0.5, 0.7, 1.

No training: the panels are Pi itself, and the claims check the facts of the task that the rest of
the paper uses (``docs/model.md`` section 1: circulant, stationary uniform start, Bayes accuracy
max(p, 1-p) on sampled walks).
"""

from __future__ import annotations

import numpy as np

from experiments.spec import Claim, Computed, FigureSpec, Panel, at_most, binomial_tol, near
from rwinterp.tasks import CircleWalk, circle_transition

K = 6
PS = (0.5, 0.7, 1.0)
N_WALKS = 20000


def pi(p: float) -> np.ndarray:
    return circle_transition(K, p).numpy()


def structure_error(p: float) -> float:
    """Largest deviation of Pi from: rows summing to one, circulant, p on i -> i+1 and 1-p on i -> i-1."""
    P = pi(p)
    idx = np.arange(K)
    target = np.zeros((K, K))
    target[idx, (idx + 1) % K] += p
    target[idx, (idx - 1) % K] += 1 - p
    circulant = max(np.abs(np.roll(P[0], i) - P[i]).max() for i in range(K))
    return float(max(np.abs(P - target).max(), np.abs(P.sum(1) - 1).max(), circulant))


def stationarity_error(p: float) -> float:
    """``|| (1/K) 1^T Pi - (1/K) 1^T ||_inf``: the uniform start is stationary."""
    u = np.full(K, 1 / K)
    return float(np.abs(u @ pi(p) - u).max())


def bayes_on_samples(p: float, reduced: bool) -> float:
    """Accuracy of the Bayes predictor Pi^T x_{N-1} (ties to the smallest label) on sampled walks."""
    from rwinterp.metrics import accuracy

    task = CircleWalk(K, p, 97)
    batch = task.sample(2000 if reduced else N_WALKS, seed=2)
    return accuracy(task.conditional(batch.tokens), batch.labels)


def claims() -> list[Claim]:
    out = []
    for p in PS:
        out += [
            Claim(f"p = {p}: Pi is circulant, rows sum to 1, p on i -> i+1 and 1-p on i -> i-1 (max deviation)",
                  Computed(lambda r, p=p: structure_error(p)), at_most(1e-12), reduced=True),
            Claim(f"p = {p}: the uniform start is stationary (max deviation of 1/K 1^T Pi)",
                  Computed(lambda r, p=p: stationarity_error(p)), at_most(1e-12), reduced=True),
            Claim(f"p = {p}: the Bayes predictor Pi^T x_(N-1) has accuracy max(p, 1-p) on sampled walks",
                  Computed(lambda r, p=p: bayes_on_samples(p, r.reduced)),
                  lambda r, p=p: near(max(p, 1 - p), binomial_tol(max(p, 1 - p), 2000 if r.reduced else N_WALKS)),
                  reduced=True, note="tolerance: 3 standard errors of the sampled accuracy"),
        ]
    return out


SPEC = FigureSpec(
    id="2",
    title="transition matrices of the walk on a circle (K = 6)",
    caption=("Row = current node, column = next node; one colour scale, 0 to 1. Each row puts p on the next node "
             "clockwise and 1-p on the previous one; for p = 1 the walk is deterministic. Every Pi is circulant, so "
             "the uniform start is stationary."),
    panels=[Panel("heatmap", f"({'abc'[i]}) p = {p}", data=Computed(lambda r, p=p: pi(p)),
                  xlabel="next state", ylabel="current state",
                  options={"cmap": "Blues", "fmt": ".1f", "range": (0.0, 1.0)})
            for i, p in enumerate(PS)],
    claims=claims(),
)
