"""Weighted batch statistics, ratios of batch means, and bootstrap intervals for the probes.

Every probe keeps its per-walk numbers (a ``[batch, ...]`` tensor) and computes its summary
scores as weighted sums over walks. The weights come in as a ``[draws, batch]`` matrix ``w``:

* one row of ones (or the population probabilities) gives the point estimate;
* rows of bootstrap multiplicities (how often each walk was drawn, times its probability) give
  the bootstrap distribution of the same score, at the cost of one matrix product.

A weighted mean divides by its row's total (:func:`wmean`); a score's interval is the
bias-corrected percentile interval of its draws (:func:`bootstrap_interval`).

A ratio of batch means, ``sum_b w_b num_b / sum_b w_b den_b``, is the patching metric's
normalisation: walks whose clean and corrupted outputs agree add zero to both sums instead of
dividing by zero. When the denominator is negligible against the size of the model's outputs
(for example a model whose output is the same for every walk), the ratio is NaN rather than a
large meaningless number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist, stdev
from typing import Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.utilities.statistics import bootstrap_ci, derive_generator

from rwinterp.errors import require

#: Relative size below which a denominator counts as zero (see :func:`ratio`).
NEGLIGIBLE = 1e-6


def point_weights(weights: Float[Tensor, " batch"] | None, n: int) -> Float[Tensor, "1 batch"]:
    """The weight row of the point estimate: the walks' probabilities, or ones for sampled walks."""
    if weights is None:
        return torch.ones((1, n), dtype=torch.float64)
    return weights.to(torch.float64)[None]


def bootstrap_weights(
    weights: Float[Tensor, " batch"] | None, n: int, draws: int, seed: int
) -> Float[Tensor, "draws batch"]:
    """Rows of bootstrap weights: multinomial draw counts of the walks (times their probabilities).

    Seeded through TransformerLens' ``derive_generator`` so that the same seed gives the same
    intervals.
    """
    gen = derive_generator(seed, "walk-bootstrap")
    idx = torch.randint(0, n, (draws, n), generator=gen)
    counts = torch.zeros(draws, n, dtype=torch.float64)
    counts.scatter_add_(1, idx, torch.ones(draws, n, dtype=torch.float64))
    if weights is not None:
        counts = counts * weights.to(torch.float64)[None]
    return counts


def wmean(w: Float[Tensor, "draws batch"], values: Float[Tensor, "batch *rest"]) -> Float[Tensor, "draws *rest"]:
    """``sum_b w[r, b] values[b, ...] / sum_b w[r, b]`` for every weight row ``r``.

    The rows are normalised here, not beforehand: with whole-number weights (ones, draw counts) the
    sums are exact, so a rate of n hits in n walks is 1, not 1 + 1e-16 as a sum of n copies of 1/n.
    """
    flat = values.to(torch.float64).reshape(values.shape[0], -1)
    return ((w @ flat) / w.sum(1, keepdim=True)).reshape(w.shape[0], *values.shape[1:])


def ratio(num: Tensor, den: Tensor, scale: Tensor | float) -> Tensor:
    """``num / den``, NaN where ``|den| <= NEGLIGIBLE * scale`` (``scale``: typical output size)."""
    scale = torch.as_tensor(scale, dtype=torch.float64)
    small = den.abs() <= NEGLIGIBLE * scale
    return torch.where(small, torch.full_like(num, math.nan), num / torch.where(small, 1.0, den))


def bootstrap_interval(draws: Float[Tensor, " draws"], point: float, confidence: float = 0.95) -> tuple[float, float]:
    """Efron's bias-corrected percentile interval of a score from its bootstrap draws.

    With ``z0 = Phi^-1(share of the draws below the point estimate)`` (ties count half), the interval
    runs between the draws' quantiles ``Phi(2 z0 -+ z)``, ``z = Phi^-1((1 + confidence) / 2)``. When the
    point is the draws' median (z0 = 0) this is the plain percentile interval. A score whose resamples
    are biased, such as ``localization`` (a ratio of sums of absolute effects, which resampling inflates
    in the denominator), has its draws mostly on one side of the point: the plain percentile interval
    then lies mostly on that side too, and the correction moves it back towards the point. Like the
    plain interval, it contains the point exactly when the point lies within the draws' central
    ``confidence`` share. NaN draws are left out; NaN if the point or every draw is NaN.
    """
    finite = draws[draws.isfinite()].to(torch.float64)
    if finite.numel() == 0 or not math.isfinite(point):
        return math.nan, math.nan
    n = finite.numel()
    below = (float((finite < point).sum()) + 0.5 * float((finite == point).sum())) / n
    normal = NormalDist()
    z0 = normal.inv_cdf(min(max(below, 0.5 / n), 1.0 - 0.5 / n))
    z = normal.inv_cdf((1.0 + confidence) / 2.0)
    levels = torch.tensor([normal.cdf(2 * z0 - z), normal.cdf(2 * z0 + z)], dtype=torch.float64)
    lo, hi = torch.quantile(finite, levels).tolist()
    return lo, hi


#: Resamples of the runs behind an :class:`Estimate`'s interval (a few values each: cheap).
RUN_RESAMPLES = 2000


@dataclass
class Estimate:
    """A score over a group of runs (seeds): each run's value, their mean and a bootstrap interval of the mean.

    The runs are the unit that is resampled: the interval says how far the mean could move had other seeds
    been trained, not how noisy each run's own test set is (that is each run's own interval). It is the
    percentile interval of the means of ``resamples`` draws of the runs with replacement (TransformerLens
    ``bootstrap_ci``), seeded, so the same values and seed give the same interval. Runs whose value is
    undefined (NaN) are left out of the mean and the interval. With fewer than two defined values there is
    nothing to resample and the interval is undefined (NaN, ``null`` in JSON), not a point.
    """

    values: list[float]
    mean: float
    interval: tuple[float, float]

    @property
    def defined(self) -> list[float]:
        return [v for v in self.values if v is not None and math.isfinite(v)]

    @property
    def std(self) -> float:
        """The sample standard deviation of the defined values (NaN with fewer than two)."""
        defined = self.defined
        return stdev(defined) if len(defined) > 1 else math.nan

    @classmethod
    def of(cls, values: list[float], confidence: float = 0.95, resamples: int = RUN_RESAMPLES,
           seed: int = 0) -> "Estimate":
        """The mean of the defined values (``math.fsum`` over their count) and its interval over runs."""
        values = [math.nan if v is None else float(v) for v in values]
        finite = [v for v in values if math.isfinite(v)]
        mean = finite_mean(finite)
        if len(finite) < 2:
            return cls(values, mean, (math.nan, math.nan))
        lo, hi = bootstrap_ci(torch.tensor(finite, dtype=torch.float64), confidence=confidence,
                              n_resamples=resamples, generator=derive_generator(seed, "run-bootstrap"))
        return cls(values, mean, (float(lo), float(hi)))

    @classmethod
    def paired(cls, a: "Estimate", b: "Estimate", confidence: float = 0.95, resamples: int = RUN_RESAMPLES,
               seed: int = 0) -> "Estimate":
        """``a - b`` run by run (the same runs in the same order, e.g. trained and its own random models), with
        the interval of the mean difference over runs: resampling the pairs keeps what the two share."""
        require(len(a.values) == len(b.values), "a paired difference needs one value of each per run")
        return cls.of([x - y for x, y in zip(a.values, b.values)], confidence, resamples, seed)

    @classmethod
    def difference(cls, a: "Estimate", b: "Estimate", confidence: float = 0.95, resamples: int = RUN_RESAMPLES,
                   seed: int = 0) -> "Estimate":
        """``mean(b) - mean(a)`` of two independent groups of runs, with the percentile interval of the
        difference when each group is resampled on its own (independent generators). ``values`` is empty:
        the runs of two groups are not paired. The interval is undefined unless both groups have two defined
        values or more."""
        xa, xb = a.defined, b.defined
        if not xa or not xb:
            return cls([], math.nan, (math.nan, math.nan))
        point = b.mean - a.mean
        if len(xa) < 2 or len(xb) < 2:
            return cls([], point, (math.nan, math.nan))
        draws = (_resampled_means(xb, resamples, derive_generator(seed, "run-bootstrap", "b"))
                 - _resampled_means(xa, resamples, derive_generator(seed, "run-bootstrap", "a")))
        alpha = (1.0 - confidence) / 2.0
        lo, hi = torch.quantile(draws, torch.tensor([alpha, 1.0 - alpha], dtype=torch.float64)).tolist()
        return cls([], point, (lo, hi))

    def to_dict(self) -> dict:
        return {"values": self.values, "mean": self.mean, "interval": list(self.interval)}


def finite_mean(values: Sequence[Optional[float]]) -> float:
    """The mean of the defined (finite) values, ``math.fsum`` over their count; NaN if there are none."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def _resampled_means(values: list[float], resamples: int, generator: torch.Generator) -> Float[Tensor, " resamples"]:
    """Means of ``resamples`` draws of ``values`` with replacement."""
    x = torch.tensor(values, dtype=torch.float64)
    idx = torch.randint(0, len(values), (resamples, len(values)), generator=generator)
    return x[idx].mean(-1)
