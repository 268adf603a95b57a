"""Summary numbers shared by training and the probes."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rwinterp.losses import average
from rwinterp.model import predict


def accuracy(
    scores: Float[Tensor, "batch K"],
    labels: Int[Tensor, " batch"],
    weights: Float[Tensor, " batch"] | None = None,
) -> float:
    """Share of samples whose prediction (smallest maximiser, see ``predict``) is the label."""
    hits = (predict(scores) == labels).to(torch.float64)
    return float(average(hits, weights))


def parent_attention(
    pattern: Float[Tensor, "batch pos"],
    parents: Sequence[int],
    weights: Float[Tensor, " batch"] | None = None,
) -> float:
    """Mean total attention that the query slot puts on the parent position(s)."""
    on_parent = pattern[:, list(parents)].sum(-1).to(torch.float64)
    return float(average(on_parent, weights))


def normalized(matrix: Tensor) -> Tensor:
    return matrix / matrix.norm()


def transition_distance(V: Float[Tensor, "K K"], Pi: Float[Tensor, "K K"]) -> float:
    """The paper's ``|| V/||V||_F - Pi^T/||Pi^T||_F ||_F`` (NaN when V = 0). In [0, 2]."""
    V = V.detach().to(torch.float64)
    if float(V.norm()) == 0.0:
        return math.nan
    Pi_T = Pi.to(torch.float64).T
    return float((normalized(V) - normalized(Pi_T)).norm())
