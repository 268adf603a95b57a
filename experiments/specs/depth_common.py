"""Shared pieces of the deeper-model studies (``depth_p1``, ``depth_order``); no figure of its own.

Runs use :class:`rwinterp.model.DeepTransformer` (model dicts carry ``"kind": "deep"`` and
:class:`rwinterp.config.DeepOptions` fields) and record no per-step quantities: the panels and claims
read the history (accuracy, parent attention of every layer and head) and the trained model.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from experiments.spec import Record, Results, RunSpec, Table
from rwinterp.config import standard_options
from rwinterp.losses import average

#: ``DeepConfig.standard(K, N, 32)`` as model fields: learned tokens and added learned positions,
#: factored QK scaled by 1/sqrt(d_head), residual stream, causal attention, learned readout, GPT-2 init.
STANDARD = standard_options(32)
#: How the standard model is trained: AdamW, cross-entropy on next-state prediction at every position.
STANDARD_TRAIN = {"optimizer": "adamw", "lr": 0.01, "loss": "xent", "next_token": True, "steps": 80}


def deep_run(name: str, task: dict[str, Any], model: Optional[dict] = None, train: Optional[dict] = None,
             reduced: Optional[dict] = None, label: str = "") -> RunSpec:
    """A run of the deep model (``n_states``/``n_ctx`` come from the task). Every model of these studies stores its
    whole key-query matrix W (``rank_one_query=False``), so that a one-layer model is parametrised, initialised
    and trained as its deeper counterparts are."""
    return RunSpec(name, dict(task), {"kind": "deep", "rank_one_query": False, **(model or {})}, dict(train or {}),
                   Record(quantities=()), dict(reduced or {}), label or name)


def query_attention(results: Results, run: str) -> np.ndarray:
    """Mean attention of the query slot over the test walks, ``[layer, head, position]``."""
    import torch

    r = results[run]

    def compute() -> np.ndarray:
        with torch.no_grad():
            pattern = r.model.attention(r.test.tokens).to(torch.float64)  # [B, L, H, N]
        return average(pattern, r.test.weights).numpy()

    return r.memo("query_attention", compute)


def parent_rows(results: Results, runs: list[str]) -> tuple[np.ndarray, list[str]]:
    """Per run and layer (heads summed, so a row sums to the number of heads): attention of the
    query slot on each parent (earliest first) and on every other position together."""
    rows, labels = [], []
    for run in runs:
        parents = list(results[run].task.parent_positions())
        att = query_attention(results, run)
        for layer in range(att.shape[0]):
            row = att[layer].sum(0)
            rows.append([*row[parents], row.sum() - row[parents].sum()])
            labels.append(f"{run} L{layer}")
    return np.array(rows), labels


def scorecard_vs_random(results: Results, run: str) -> dict[str, Any]:
    """The probes' scorecard of the trained model and the mean over random-initialised models of
    the same architecture, on the same test walks (:func:`probes.scoring.compare_to_random`):
    2 seeds on the first 100 test walks (1 seed on 50 walks in reduced mode). A population test
    set is probed whole."""
    r = results[run]
    seeds, walks = (1, 50) if results.reduced else (2, 100)

    def compute() -> dict[str, Any]:
        from probes.config import ProbeConfig
        from probes.scoring import compare_to_random

        data = r.test if r.test.weights is not None else r.test[:walks]
        comparison = compare_to_random(r.model, r.task, data, seeds=seeds,
                                       config=ProbeConfig(bootstrap=0, progress=False))
        return {"trained": comparison.trained.flat(), "random": comparison.baseline_means()}

    return r.memo("scorecard_vs_random", compute)


SCORE_KEYS = ("accuracy", "parent_attention", "attention.uniformity", "patching.localization",
              "patching.necessity")
#: Column headings of :func:`score_table` where the score's own name is not the last part of its key.
COLUMN_LABELS = {"parent_attention": "parent attention"}


def score_table(results: Results, runs: list[str], keys: tuple[str, ...] = SCORE_KEYS) -> Table:
    """Each run's probe scores, trained / mean of random-initialised models; each heading carries the
    way the score moves when a model learns the task (:func:`probes.scoring.direction`)."""
    from probes.scoring import direction

    columns = ["run"] + [COLUMN_LABELS.get(k, k.split(".")[-1]) + direction(k) for k in keys]
    rows = []
    for run in runs:
        card = scorecard_vs_random(results, run)
        rows.append([run] + [f"{card['trained'].get(k, math.nan):.3f} / {card['random'].get(k, math.nan):.3f}"
                             for k in keys])
    return Table(columns, rows, "each cell: trained / random init; ↑ higher, ↓ lower for a model that learned "
                                "the task")
