"""Causal evidence per head: what the loss does when a head's output is ablated or patched.

* :func:`head_ablation`: replace one head's output ``z`` (at every position) by its mean over the walks
  at that position (``mode="mean"``) or by its value on an independent walk (``mode="resample"``), in
  the clean run, and report the increase of the mean next-state cross-entropy (nats, averaged over
  every prediction of every walk), with bootstrap intervals over walks.
* :func:`head_patching`: the other direction, patching one head's clean output into the run on an
  independent (corrupted) walk and scoring that run against the clean walk's labels: how much of the
  corrupted run's extra loss one head's output takes back.
* :func:`probes.circuits.path_patching_through_keys` (re-exported here): one head's effect through a
  later head's keys alone, the path-patching measure of K-composition.

Both are one sweep of :func:`probes.patching.sweep` (family ``z``, granularity ``head``), exact by
default; ``method="atp"`` gives the attribution-patching estimate of the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from probes.circuits import KeyPathResult, path_patching_through_keys
from probes.config import ProbeConfig
from probes.patching import Sweep, _require_choice, sweep
from probes.targets import head_name
from rwinterp.tasks import Batch, Task

__all__ = ["HeadAblationResult", "HeadPatchingResult", "KeyPathResult", "head_ablation", "head_patching",
           "path_patching_through_keys"]


def _intervals(result: Sweep, config: ProbeConfig) -> tuple[Tensor, Tensor]:
    if not config.bootstrap or result.weights is not None:  # a weighted population is exact
        nan = torch.full(result.effects().shape, math.nan, dtype=torch.float64)
        return nan, nan.clone()
    return result.intervals(config.bootstrap, config.seed, config.confidence)


@dataclass
class HeadAblationResult:
    """``loss_increase[l, h]``: mean loss (nats) with head ``L{l}H{h}`` ablated minus the clean loss;
    ``ci_low``/``ci_high``: its bootstrap interval; ``clean_loss``: the unablated model's loss."""

    mode: str
    loss_increase: Tensor
    ci_low: Tensor
    ci_high: Tensor
    clean_loss: float
    sweep: Sweep

    def scores(self) -> dict[str, dict[str, Any]]:
        """``{"L0H0": {"ablation_loss_increase": x, "ablation_ci": [lo, hi]}, ...}``."""
        L, H = self.loss_increase.shape
        return {head_name(l, h): {"ablation_loss_increase": float(self.loss_increase[l, h]),
                              "ablation_ci": [float(self.ci_low[l, h]), float(self.ci_high[l, h])]}
                for l in range(L) for h in range(H)}


def head_ablation(model: Any, task: Task, data: Batch, mode: str = "mean", config: ProbeConfig | None = None,
                  method: str = "exact") -> HeadAblationResult:
    """Ablate each head's output in turn (see the module docstring). A pure function of its inputs."""
    config = config or ProbeConfig()
    _require_choice(mode, ("mean", "resample"), "ablation mode")
    result = sweep(model, task, data, "z", "head", mode, "loss", method, config)
    lo, hi = _intervals(result, config)
    return HeadAblationResult(mode, result.effects(), lo, hi, _mean(result.base, result.weights), result)


@dataclass
class HeadPatchingResult:
    """``loss_change[l, h]``: loss (on the clean labels) of the corrupted run with head ``L{l}H{h}``'s clean
    output patched in, minus the corrupted run's loss (negative: the head carries the clean information);
    ``recovered``: ``-loss_change`` as a fraction of ``corrupted_loss - clean_loss``."""

    loss_change: Tensor
    ci_low: Tensor
    ci_high: Tensor
    corrupted_loss: float
    clean_loss: float
    sweep: Sweep

    @property
    def recovered(self) -> Tensor:
        gap = self.corrupted_loss - self.clean_loss
        return -self.loss_change / gap if abs(gap) > 1e-12 else torch.full_like(self.loss_change, math.nan)


def head_patching(model: Any, task: Task, data: Batch, config: ProbeConfig | None = None,
                  method: str = "exact") -> HeadPatchingResult:
    """Patch each head's clean output into the corrupted run in turn. A pure function of its inputs."""
    from probes.patching import _setup, element_rows, unpatched_metric
    from probes.targets import evaluating

    config = config or ProbeConfig()
    result = sweep(model, task, data, "z", "head", "clean", "loss", method, config)
    lo, hi = _intervals(result, config)
    with evaluating(model):
        setup = _setup(model, task, data, "z", "mean", "loss", config)
        rows = element_rows(model, setup.base.n_pos)
        clean = unpatched_metric(model, setup, rows)
    corrupted_loss, clean_loss = _mean(result.base, result.weights), _mean(clean, result.weights)
    return HeadPatchingResult(result.effects(), lo, hi, corrupted_loss, clean_loss, result)


def _mean(values: Tensor, weights: Tensor | None) -> float:
    if weights is None:
        return float(values.mean())
    w = weights.to(torch.float64)
    return float((w * values).sum() / w.sum())
