"""Weighted batch statistics, ratios of batch means, and bootstrap intervals for the probes.

Every probe keeps its per-walk numbers (a ``[batch, ...]`` tensor) and computes its summary
scores as weighted sums over walks. The weights come in as a ``[draws, batch]`` matrix ``w``:

* one row of ones (or the population probabilities) gives the point estimate;
* rows of bootstrap multiplicities (how often each walk was drawn, times its probability) give
  the bootstrap distribution of the same score, at the cost of one matrix product.

A ratio of batch means, ``sum_b w_b num_b / sum_b w_b den_b``, is the patching metric's
normalisation: walks whose clean and corrupted outputs agree add zero to both sums instead of
dividing by zero. When the denominator is negligible against the size of the model's outputs
(for example a model whose output is the same for every walk), the ratio is NaN rather than a
large meaningless number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.utilities.statistics import bootstrap_ci, derive_generator

#: Relative size below which a denominator counts as zero (see :func:`ratio`).
NEGLIGIBLE = 1e-6


def point_weights(weights: Float[Tensor, " batch"] | None, n: int) -> Float[Tensor, "1 batch"]:
    """The weight row of the point estimate: the probabilities, or 1/n for sampled walks."""
    if weights is None:
        return torch.full((1, n), 1.0 / n, dtype=torch.float64)
    w = weights.to(torch.float64)
    return (w / w.sum())[None]


def bootstrap_weights(
    weights: Float[Tensor, " batch"] | None, n: int, draws: int, seed: int
) -> Float[Tensor, "draws batch"]:
    """Rows of bootstrap weights: multinomial draw counts of the walks (times their probabilities).

    Each row sums to one. Seeded through TransformerLens' ``derive_generator`` so that the same
    seed gives the same intervals.
    """
    gen = derive_generator(seed, "walk-bootstrap")
    idx = torch.randint(0, n, (draws, n), generator=gen)
    counts = torch.zeros(draws, n, dtype=torch.float64)
    counts.scatter_add_(1, idx, torch.ones(draws, n, dtype=torch.float64))
    if weights is not None:
        counts = counts * weights.to(torch.float64)[None]
    return counts / counts.sum(1, keepdim=True)


def wsum(w: Float[Tensor, "draws batch"], values: Float[Tensor, "batch *rest"]) -> Float[Tensor, "draws *rest"]:
    """``sum_b w[r, b] values[b, ...]`` for every weight row ``r``."""
    flat = values.to(torch.float64).reshape(values.shape[0], -1)
    return (w @ flat).reshape(w.shape[0], *values.shape[1:])


def ratio(num: Tensor, den: Tensor, scale: Tensor | float) -> Tensor:
    """``num / den``, NaN where ``|den| <= NEGLIGIBLE * scale`` (``scale``: typical output size)."""
    scale = torch.as_tensor(scale, dtype=torch.float64)
    small = den.abs() <= NEGLIGIBLE * scale
    return torch.where(small, torch.full_like(num, math.nan), num / torch.where(small, 1.0, den))


def percentile_interval(draws: Float[Tensor, "draws *rest"], confidence: float = 0.95) -> tuple[Tensor, Tensor]:
    """Percentile interval over the first axis, ignoring NaN draws (NaN if all are NaN)."""
    alpha = (1.0 - confidence) / 2.0
    lo = torch.nanquantile(draws, alpha, dim=0)
    hi = torch.nanquantile(draws, 1.0 - alpha, dim=0)
    return lo, hi


@dataclass
class Spread:
    """A score over several models (e.g. random-initialised seeds): mean, spread and interval."""

    values: list[float]
    mean: float
    std: float
    ci_low: float
    ci_high: float

    @classmethod
    def of(cls, values: list[float], confidence: float = 0.95, resamples: int = 2000, seed: int = 0) -> "Spread":
        """Mean and sample standard deviation over the finite values, with a bootstrap interval
        of the mean (TransformerLens ``bootstrap_ci``; collapses to a point for one value)."""
        finite = [v for v in values if v is not None and math.isfinite(v)]
        if not finite:
            return cls(list(values), math.nan, math.nan, math.nan, math.nan)
        x = torch.tensor(finite, dtype=torch.float64)
        std = float(x.std()) if len(finite) > 1 else 0.0
        lo, hi = bootstrap_ci(x, confidence=confidence, n_resamples=resamples,
                              generator=derive_generator(seed, "seed-bootstrap"))
        return cls(list(values), float(x.mean()), std, float(lo), float(hi))

    def to_dict(self) -> dict:
        return {"mean": self.mean, "std": self.std, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "values": self.values}
