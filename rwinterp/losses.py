"""Losses on the model's raw scores ``f`` (``[batch, K]``, or ``[*models, batch, K]`` for a stack of models),
averaged with optional sample weights.

* ``log`` (the paper's): ``-log(f[y] + eps)`` on the raw score of the true label. Not softmax
  cross-entropy; it can be negative, and it is undefined where ``f[y] + eps <= 0``.
* ``xent``: softmax cross-entropy of the scores taken as logits.
* ``squared``: ``||f - e_y||^2 / 2``.

With ``weights`` (population mode) the loss is the exact expectation ``sum_i w_i l_i``; without,
the mean over the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from rwinterp.config import LOSSES
from rwinterp.errors import require


def per_sample_loss(
    name: str, scores: Float[Tensor, "*models batch K"], labels: Int[Tensor, "*models batch"], eps: float = 0.1
) -> Float[Tensor, "*models batch"]:
    """The loss of each sample."""
    if name == "log":
        return -torch.log(scores.gather(-1, labels[..., None])[..., 0] + eps)
    if name == "xent":
        return F.cross_entropy(scores.flatten(0, -2), labels.flatten(), reduction="none").view(labels.shape)
    if name == "squared":
        target = F.one_hot(labels, scores.shape[-1]).to(scores.dtype)
        return 0.5 * (scores - target).pow(2).sum(-1)
    require(False, f"loss must be one of {', '.join(LOSSES)}, got {name!r}")
    raise AssertionError  # unreachable


def average(values: Float[Tensor, "batch *rest"], weights: Float[Tensor, " batch"] | None) -> Tensor:
    """Mean over the samples (the first axis), or the weighted sum over them when ``weights``
    (the samples' probabilities, an enumerated population) are given."""
    if weights is None:
        return values.mean(0)
    return (values * weights.to(values.dtype).reshape(-1, *[1] * (values.ndim - 1))).sum(0)


def loss(
    name: str,
    scores: Float[Tensor, "*models batch K"],
    labels: Int[Tensor, "*models batch"],
    weights: Float[Tensor, "*models batch"] | None = None,
    eps: float = 0.1,
) -> Float[Tensor, "*models"]:
    """The mean loss (:func:`average`), one for each model of a stack (:func:`over_samples`)."""
    return over_samples(per_sample_loss(name, scores, labels, eps), weights)


def over_samples(values: Float[Tensor, "*models batch"], weights: Float[Tensor, "*models batch"] | None
                 ) -> Float[Tensor, "*models"]:
    """:func:`average` over the last axis: each model's samples are summed as one contiguous row, the same sum for
    a model alone and for each model of a stack."""
    return values.mean(-1) if weights is None else (values * weights.to(values.dtype)).sum(-1)
