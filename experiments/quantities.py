"""The quantities a run can record at chosen steps (see :class:`experiments.spec.Record`).

Each is a pure function of a :class:`~experiments.spec.StepView` (model, task, test walks, and the
model's test scores and attention pattern at that step). Register more with
:func:`experiments.spec.quantity` in a spec module.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from einops import einsum

from experiments.spec import StepView, quantity
from rwinterp.losses import average


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy().copy()


@quantity("V")
def value_matrix(view: StepView) -> np.ndarray:
    """The value matrix V (K x K, or m x K with the FC+ReLU layer)."""
    return _np(view.model.V)


@quantity("attention")
def mean_attention(view: StepView) -> np.ndarray:
    """Mean attention of the query slot on each of the N positions over the test walks."""
    return _np(average(view.pattern, view.test.weights))


def averaged_tokens(view: StepView) -> torch.Tensor:
    """``X softmax(...)`` per test walk ``[B, K]``: the attention-weighted average of the one-hot tokens."""
    K = view.task.n_states
    onehot = F.one_hot(view.test.tokens, K + 1)[..., :K].to(view.pattern.dtype)
    return einsum(view.pattern, onehot, "b n, b n k -> b k")


@quantity("averaged_token")
def averaged_token(view: StepView) -> dict[str, Any]:
    """The averaged token of the first test walk, and the mean and per-coordinate variance over walks."""
    avg = averaged_tokens(view).to(torch.float64)
    mean = average(avg, view.test.weights)
    return {"example": _np(avg[0]), "mean": _np(mean), "var": _np(average((avg - mean) ** 2, view.test.weights))}


@quantity("v_column_spread")
def v_column_spread(view: StepView) -> float:
    """``max |V[:, j] - V[:, 0]| / max |V|``: zero while V is proportional to a column repeated
    (Theorem 4.1's symmetric state ``V = v 1^T``), growing once the symmetry breaks."""
    V = view.model.V.detach().to(torch.float64)
    scale = float(V.abs().max())
    return 0.0 if scale == 0.0 else float((V - V[:, :1]).abs().max()) / scale


@quantity("attention_spread")
def attention_spread(view: StepView) -> float:
    """Largest relative spread of the attention over the N-1 token positions, over the test walks:
    ``max_b (max_i a_bi - min_i a_bi) / mean_i a_bi`` (zero when attention is uniform on the tokens)."""
    tokens = view.pattern[:, :-1].to(torch.float64)
    return float(((tokens.amax(1) - tokens.amin(1)) / tokens.mean(1)).max())


@quantity("sqrt_distance")
def sqrt_distance(view: StepView) -> float:
    """``|| V/||V|| - sqrt(Pi^T)/||sqrt(Pi^T)|| ||_F`` (entrywise square root; NaN while V = 0).

    Under the loss ``-log(f_y + eps)`` with attention on the parent, each entry obeys
    ``dV[y, x]/dt = P(x) Pi[x, y] / (V[y, x] + eps)``, so ``V[y, x] ~ sqrt(2 P(x) Pi[x, y] t)``: V's direction
    tends to the entrywise square root of Pi^T, which is Pi^T's direction only when p = 1/2."""
    from rwinterp.metrics import transition_distance

    return transition_distance(view.model.V, view.task.transition_matrix().sqrt())


@quantity("position_logits")
def position_logits(view: StepView) -> np.ndarray:
    """The positional part of the attention logits, ``p_i . u_pos`` for each position ``[N]``."""
    return _np(view.model.W_pos @ view.model.u)
