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


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy().copy()


@quantity("V")
def value_matrix(view: StepView) -> np.ndarray:
    """The value matrix V (K x K, or m x K with the FC+ReLU layer)."""
    return _np(view.model.V)


@quantity("u")
def key_query_vector(view: StepView) -> np.ndarray:
    """``u = W x~_N``: all of W that the model uses."""
    return _np(view.model.u)


@quantity("A")
def output_matrix(view: StepView) -> np.ndarray:
    """The FC+ReLU variant's output matrix A (K x m)."""
    return _np(view.model.A)


@quantity("attention")
def mean_attention(view: StepView) -> np.ndarray:
    """Mean attention of the query slot on each of the N positions over the test walks."""
    return _np(view.pattern.mean(0))


@quantity("attention_example")
def example_attention(view: StepView) -> np.ndarray:
    """The attention pattern of the first test walk."""
    return _np(view.pattern[0])


def averaged_tokens(view: StepView) -> torch.Tensor:
    """``X softmax(...)`` per test walk ``[B, K]``: the attention-weighted average of the one-hot tokens."""
    K = view.task.n_states
    onehot = F.one_hot(view.test.tokens, K + 1)[..., :K].to(view.pattern.dtype)
    return einsum(view.pattern, onehot, "b n, b n k -> b k")


@quantity("averaged_token")
def averaged_token(view: StepView) -> dict[str, Any]:
    """The averaged token of the first test walk, and the mean and per-coordinate variance over walks."""
    avg = averaged_tokens(view).to(torch.float64)
    return {"example": _np(avg[0]), "mean": _np(avg.mean(0)), "var": _np(avg.var(0, unbiased=False))}


@quantity("scores_example")
def example_scores(view: StepView) -> np.ndarray:
    """The raw scores f of the first test walk."""
    return _np(view.scores[0])


@quantity("test_scores")
def test_scores(view: StepView) -> np.ndarray:
    """The raw scores f of every test walk ``[B, K]``."""
    return _np(view.scores)
