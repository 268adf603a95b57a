"""Probes: does a model implement the walk, and how? Numbers, not pictures alone.

Every probe is a pure function of (model, task, walks[, config]) returning a typed result; none
asks which class the model is. Any model with TransformerLens hook names and weight views works:
the paper's model, the deeper variants of :mod:`rwinterp.deep`, or a standard
``TransformerBridge`` trained on next-token prediction (:mod:`rwinterp.standard`).

=========================  ==================================================================
module                     what it answers
=========================  ==================================================================
:mod:`probes.targets`      where predictions are read and where each one's parents sit
:mod:`probes.patching`     activation patching: localisation, necessity, sufficiency
:mod:`probes.attention`    attention on the parents, entropy, attention x value, gradient x input
:mod:`probes.transition`   the value map (OV circuit) against the transition matrix Pi
:mod:`probes.scorecard`    all of them at once; trained against random models; run against run
:mod:`probes.plots`        seaborn figures, each with a caption
:mod:`probes.report`       ``scores.json``, ``report.md`` and figures in a directory
:mod:`probes.cli`          ``rwinterp probe`` and ``rwinterp compare``
=========================  ==================================================================

Quick use::

    from probes.scorecard import scorecard
    card = scorecard(model, task, task.sample(1000, seed=1))
    card.scores()["patching"]["localization"], card.findings()

The names below are imported on first use, so ``import probes`` stays light (the command line
imports :mod:`probes.cli` at start-up). ``probes.scorecard`` is the module, as for every module
name; the function is ``probes.scorecard.scorecard``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProbeConfig": "probes.config",
    "Targets": "probes.targets",
    "targets_for": "probes.targets",
    "patching_probe": "probes.patching",
    "PatchingResult": "probes.patching",
    "attention_probe": "probes.attention",
    "AttentionResult": "probes.attention",
    "transition_probe": "probes.transition",
    "TransitionResult": "probes.transition",
    "compare_to_transition": "probes.transition",
    "Scorecard": "probes.scorecard",
    "compare_to_random": "probes.scorecard",
    "compare": "probes.scorecard",
    "random_like": "probes.scorecard",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'probes' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
