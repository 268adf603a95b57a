"""Summary numbers shared by training and the probes."""

from __future__ import annotations

from typing import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rwinterp.losses import over_samples


def predict(scores: Float[Tensor, "... K"]) -> Int[Tensor, "..."]:
    """The paper's prediction: the smallest index among the maximisers of the scores.

    Scores within a relative tolerance (64 machine epsilons of the row's largest magnitude) of the
    maximum count as ties, so floating-point round-off does not decide between equal scores.
    """
    tol = 64 * torch.finfo(scores.dtype).eps * scores.abs().amax(dim=-1, keepdim=True)
    top = scores.amax(dim=-1, keepdim=True)
    is_max = scores >= top - tol
    return is_max.to(torch.int8).argmax(dim=-1)


def accuracy(
    scores: Float[Tensor, "batch K"],
    labels: Int[Tensor, " batch"],
    weights: Float[Tensor, " batch"] | None = None,
) -> float:
    """Share of samples whose prediction (smallest maximiser, see ``predict``) is the label."""
    return float(accuracy_tensor(scores, labels, weights))


def accuracy_tensor(
    scores: Float[Tensor, "*models batch K"],
    labels: Int[Tensor, "*models batch"],
    weights: Float[Tensor, "*models batch"] | None = None,
) -> Float[Tensor, "*models"]:
    """:func:`accuracy` as a float64 tensor on the scores' device (read many at once, with one transfer); with
    leading axes (a stack of models), one number for each."""
    hits = (predict(scores) == labels).to(torch.float64)
    return over_samples(hits, weights)


def parent_attention(
    pattern: Float[Tensor, "batch pos"],
    parents: Sequence[int],
    weights: Float[Tensor, " batch"] | None = None,
) -> float:
    """Mean total attention that the query slot puts on the parent position(s)."""
    return float(parent_attention_tensor(pattern, parents, weights))


def parent_attention_tensor(
    pattern: Float[Tensor, "*models batch pos"],
    parents: Sequence[int],
    weights: Float[Tensor, "*models batch"] | None = None,
) -> Float[Tensor, "*models"]:
    """:func:`parent_attention` as a float64 tensor on the pattern's device; with leading axes, one number for
    each."""
    on_parent = pattern[..., list(parents)].sum(-1).to(torch.float64)
    return over_samples(on_parent, weights)


def exact_scale(x: Tensor) -> float:
    """A power of two near ``max |x|`` (1 for a zero or non-finite ``x``). Dividing by it is exact, and
    keeps sums of squares finite for weights as large as 1e300 (whose norm overflows) or as small as
    1e-300 (whose squares underflow)."""
    return float(_power_of_two_near(x.abs().max())) if x.numel() else 1.0


def _power_of_two_near(top: Tensor) -> Tensor:
    """:func:`exact_scale` of each entry of ``top`` (a largest magnitude)."""
    scale = torch.exp2(torch.frexp(top).exponent.to(top.dtype))
    return torch.where((top > 0) & top.isfinite(), scale, torch.ones_like(top))


def normalized(matrix: Float[Tensor, "*models r c"]) -> Float[Tensor, "*models r c"]:
    """``matrix / ||matrix||_F``, computed without overflow (:func:`exact_scale`); each matrix of a stack alone."""
    matrix = matrix / _power_of_two_near(matrix.abs().amax((-2, -1), keepdim=True))
    return matrix / torch.linalg.matrix_norm(matrix, keepdim=True)


def transition_distance(V: Float[Tensor, "K K"], Pi: Float[Tensor, "K K"]) -> float:
    """The paper's ``|| V/||V||_F - Pi^T/||Pi^T||_F ||_F`` (NaN when V = 0). In [0, 2]."""
    return float(transition_distance_tensor(V, Pi))


def transition_distance_tensor(V: Float[Tensor, "*models K K"], Pi: Float[Tensor, "K K"]) -> Float[Tensor, "*models"]:
    """:func:`transition_distance` as a float64 tensor on V's device; with leading axes (a stack of models), one
    number for each."""
    V = V.detach().to(torch.float64)
    return torch.linalg.matrix_norm(normalized(V) - normalized(Pi.to(V.device, torch.float64).T))
