"""Probes: does a model implement the walk, and how? Numbers, not pictures alone.

Every probe is a pure function of (model, task, walks[, config]) returning a typed result; none
asks which class the model is. Any model with TransformerLens hook names and weight views works:
the paper's model and its deeper variants (:mod:`rwinterp.model`), or a standard
``TransformerBridge`` trained on next-token prediction (:mod:`rwinterp.bridge`).

=========================  ==================================================================
module                     what it answers
=========================  ==================================================================
:mod:`probes.targets`      where predictions are read and where each one's parents sit
:mod:`probes.patching`     activation patching: localisation, necessity, sufficiency; sweeps with
                           mean/resample ablation at every granularity, exactly or by AtP/AtP*/IG
:mod:`probes.ablation`     per-head ablation and patching, loss effect per head; K-composition by
                           path patching through keys
:mod:`probes.graph`        the computational graph read from hooks: writers, readers, edges
:mod:`probes.circuits`     edge scores (exact, EAP, EAP-IG, AtP*, hybrid), circuits, faithfulness
:mod:`probes.attribution`  direct logit attribution; agreement between two methods
:mod:`probes.attention`    attention on the parents, entropy, attention x value, gradient x input
:mod:`probes.transition`   the value map (OV circuit) against the transition matrix Pi
:mod:`probes.heads`        each head's role: previous-token, induction, self and parent scores,
                           composition between heads, scores over training
:mod:`probes.scoring`      all of them at once (``scorecard``); trained against random models
:mod:`probes.group`        a group of runs (seeds): each score's mean and interval over the runs
:mod:`probes.plots`        seaborn figures, each with a caption
:mod:`probes.report`       ``scores.json``, ``report.md`` and figures in a directory
:mod:`probes.cli`          ``rwinterp probe`` and ``rwinterp compare`` (of runs or groups of runs)
=========================  ==================================================================

Quick use::

    import probes
    card = probes.scorecard(model, task, task.sample(1000, seed=1))   # every probe, with intervals
    card.scores()["patching"]["localization"], card.findings()
    comparison = probes.compare_to_random(model, task, data)          # trained against random models
    probes.write_probe_report("reports/p05", card, "runs/p05", comparison)

The names below are imported on first use, so ``import probes`` stays light (the command line
imports :mod:`probes.cli` at start-up).
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
    "head_probe": "probes.heads",
    "HeadResult": "probes.heads",
    "head_table": "probes.heads",
    "HeadTable": "probes.heads",
    "heads_against_random": "probes.heads",
    "composition_scores": "probes.heads",
    "heads_over_training": "probes.heads",
    "Scorecard": "probes.scoring",
    "scorecard": "probes.scoring",
    "Comparison": "probes.scoring",
    "compare_to_random": "probes.scoring",
    "compare": "probes.scoring",
    "random_like": "probes.scoring",
    "write_probe_report": "probes.report",
    "write_compare_report": "probes.report",
    "score_group": "probes.group",
    "compare_groups": "probes.group",
    "GroupScores": "probes.group",
    "GroupComparison": "probes.group",
    "Estimate": "probes.stats",
    "write_group_report": "probes.report",
    "write_group_compare_report": "probes.report",
    "sweep": "probes.patching",
    "Sweep": "probes.patching",
    "head_ablation": "probes.ablation",
    "HeadAblationResult": "probes.ablation",
    "head_patching": "probes.ablation",
    "path_patching_through_keys": "probes.circuits",
    "edge_attribution": "probes.circuits",
    "circuit": "probes.circuits",
    "CircuitResult": "probes.circuits",
    "direct_logit_attribution": "probes.attribution",
    "agreement": "probes.attribution",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'probes' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
