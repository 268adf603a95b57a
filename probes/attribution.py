"""Direct logit attribution, and how far two attribution methods agree.

Direct logit attribution (DLA)
------------------------------
Where the final residual stream is a sum of what the components wrote (:mod:`probes.graph`), a
prediction's logits are ``sum_c out_c W_U`` plus constants, so any linear readout of them splits into
one term per component. :func:`direct_logit_attribution` reads, for every prediction,

* ``logit_diff``: ``logit[label] - logit[other]`` (``other``: an independent walk's label, as the
  patching probe uses), exactly a sum of the components' terms and a constant;
* ``logprob``: the log-probability of the label, linearised at the model's logits: the direction
  ``e_label - softmax(logits)`` (the gradient of ``log p(label)`` with respect to the logits) read off
  each component's output. (The log-probability itself is not linear in the stream.)

Components are the embeddings, each head and each MLP that write into the final residual stream
directly (all of them with a residual stream; the last layer's alone in a model without one, such as the
paper's), plus a ``bias`` term. A head's term is further split by *source position*: its output at a
query row is ``sum_j pattern[j] v_j W_O``, so position ``j`` contributes ``pattern[j] v_j W_O W_U . d``.
``parent_share`` is the share of a head's ``|term|`` over visible source positions that sits on the
prediction's parents, the DLA counterpart of the attention probe's attention x value share.

TransformerLens 4.3's ``transformer_lens.tools.analysis.direct_logit_attribution`` computes the
component and head terms of a logit difference on a ``TransformerBridge`` (after
``enable_compatibility_mode()``, which changes the model's weights: run it on a copy); the tests
check that its numbers equal ours there. It does not split heads by source position, and does not
take the paper's or the deep models, which this module reads through their hooks alone.

Agreement
---------
:func:`agreement` compares two methods' scores of the same cells (a sweep, a patching result's
positions, the edges of a graph, or plain tensors): Pearson and Spearman correlation, the overlap of
their top-k cells by magnitude, the cells on which they disagree most, and what each cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from jaxtyping import Float
from torch import Tensor

from probes.config import ProbeConfig
from probes.graph import PATTERN, RESID_POST, Z, Node, _close, _padded, inspect_model
from probes.patching import Cost, corrupted_walks
from probes.stats import point_weights, wmean
from probes.targets import Layout, evaluating, model_dims, require_hooks, targets_for
from rwinterp.errors import require
from rwinterp.tasks import Batch, Task

DLA_METRICS = ("logprob", "logit_diff")


@dataclass
class DLAResult:
    """Direct logit attribution of every prediction.

    ``components``: names (``embeddings``, ``L0H0``, ``MLP0``, ``bias``); ``terms``: ``[component, batch,
    pred]``; ``by_source``: each head's term split by source position, ``[layer, head, batch, pred, pos]``
    (NaN for heads that do not write into the final stream directly). ``total`` is the sum of
    ``terms`` (for ``logit_diff``, the logit difference itself).
    """

    metric: str
    layout: Layout
    weights: Optional[Tensor]
    components: list[str]
    terms: Float[Tensor, "component batch pred"]
    by_source: Float[Tensor, "layer head batch pred pos"]

    @property
    def total(self) -> Tensor:
        return self.terms.sum(0)

    def means(self) -> dict[str, float]:
        """Each component's term, averaged over walks and predictions."""
        w = point_weights(self.weights, self.terms.shape[1])
        m = wmean(w, self.terms.mean(-1).T)[0]
        return {name: float(v) for name, v in zip(self.components, m)}

    def shares(self) -> Float[Tensor, "layer head batch pred"]:
        """Per head and prediction, the share of ``|term by source position|`` on the parents."""
        size = self.by_source.abs()
        visible = self.layout.visible.to(size.dtype)
        parents = self.layout.parents.to(size.dtype)
        on_parents = (size * parents).sum(-1)
        total = (size * visible).sum(-1)
        return torch.where(total > 0, on_parents / torch.where(total > 0, total, 1.0), torch.nan)

    def parent_share(self, head: Optional[tuple[int, int]] = None) -> float:
        """The parents' share of a head's direct term (default: the head with the largest mean ``|term|``),
        averaged over the walks and predictions where it is defined."""
        if head is None:
            L, H = self.by_source.shape[:2]
            size = self.by_source.abs().sum(-1).nan_to_num(-1.0).mean((-1, -2))
            flat = int(size.flatten().argmax())
            head = (flat // H, flat % H)
        share = self.shares()[head]  # [batch, pred]
        w = point_weights(self.weights, share.shape[0])
        walk = share.nanmean(-1)
        rows = w * walk.isfinite()
        return float(wmean(rows, walk.nan_to_num())[0]) if bool(rows.sum() > 0) else math.nan


def direct_logit_attribution(model: Any, task: Task, data: Batch, metric: str = "logprob",
                             config: ProbeConfig | None = None) -> DLAResult:
    """Direct logit attribution of every prediction (see the module docstring). A pure function of its inputs."""
    config = config or ProbeConfig()
    require(metric in DLA_METRICS, f"unknown DLA metric {metric!r}; known: {', '.join(DLA_METRICS)}")
    with evaluating(model):
        return _dla(model, task, data, metric, config)


def _writers_of_final_stream(structure: Any, acts: dict[str, Tensor], final: Tensor) -> list[Node]:
    """The writers whose outputs sum (up to constants) to the final residual stream."""
    L = structure.n_layers
    heads = [Node("head", L - 1, h) for h in range(structure.n_heads)]
    mlp = [Node("mlp", L - 1)] if structure.has_mlp else []
    candidates = [structure.writers(), heads + mlp, mlp, heads]
    for writers in candidates:
        if not writers:
            continue
        total = sum(structure.writer_output(acts, w) for w in writers)
        if _close(_padded(final, structure.n_pos), total):
            return writers
    require(False, "the final residual stream is not a sum of the embeddings', heads' and MLPs' outputs (a "
                   "normalisation): direct logit attribution does not apply")
    return []


def _dla(model: Any, task: Task, data: Batch, metric: str, config: ProbeConfig) -> DLAResult:
    targets = targets_for(model, task, data, config.kind)
    n_layers, n_heads = model_dims(model)
    structure = inspect_model(model, targets.inputs)
    value_hooks = [f"blocks.{l}.attn.hook_v" for l in range(n_layers)]
    names = structure.writer_hooks() + [PATTERN.format(layer=l) for l in range(n_layers)] + value_hooks + [
        RESID_POST.format(layer=n_layers - 1)]
    require_hooks(model, names, "direct logit attribution")
    other = targets.with_batch(task, corrupted_walks(task, len(data), config.seed)).labels
    W_U = structure.weights["W_U"][:, : targets.n_states]
    rows = 64
    terms_parts, source_parts = [], []
    writers: Optional[list[Node]] = None
    for start in range(0, targets.n_walks, rows):
        stop = min(targets.n_walks, start + rows)
        with torch.no_grad():
            logits, cache = model.run_with_cache(targets.inputs[start:stop], names_filter=names)
        acts = {n: cache[n] for n in names}
        sel = targets.select(logits).to(torch.float64)  # [b, T, K]
        labels = targets.labels[start:stop]
        if metric == "logprob":
            direction = torch.nn.functional.one_hot(labels, targets.n_states).to(torch.float64) - sel.softmax(-1)
        else:
            direction = (torch.nn.functional.one_hot(labels, targets.n_states)
                         - torch.nn.functional.one_hot(other[start:stop], targets.n_states)).to(torch.float64)
        u = direction @ W_U.T  # [b, T, d_model]: the readout direction of each prediction
        final = acts[RESID_POST.format(layer=n_layers - 1)].to(torch.float64)
        if writers is None:
            writers = _writers_of_final_stream(structure, acts, final)
        read = targets.read + (structure.n_pos - logits.shape[1])  # input positions of the logits read

        def term(out: Tensor) -> Tensor:  # out [b, pos, d_model] -> [b, T]
            return (out[:, read] * u).sum(-1)

        outs = [structure.writer_output(acts, w) for w in writers]
        parts = [term(o) for o in outs]
        resid = _padded(final, structure.n_pos)
        parts.append(term(resid - sum(outs)))  # biases (b_O, and whatever else is constant)
        terms_parts.append(torch.stack(parts))
        by_source = torch.full((n_layers, n_heads, stop - start, targets.n_pred, structure.n_pos), math.nan,
                               dtype=torch.float64)
        for w in writers:
            if w.kind != "head":
                continue
            v = acts[value_hooks[w.layer]][:, :, w.head].to(torch.float64)  # [b, pos, d_head]
            pattern = acts[PATTERN.format(layer=w.layer)][:, w.head].to(torch.float64)  # [b, rows, pos]
            z = acts[Z.format(layer=w.layer)][:, :, w.head].to(torch.float64)
            require(_close(torch.einsum("bqp,bpd->bqd", pattern, v), z, constant=False),
                    f"head {w.name} does not compute z = pattern @ v, so its term cannot be split by source position")
            vu = torch.einsum("bpd,dm,btm->btp", v, structure.weights["W_O"][w.layer, w.head], u)  # [b, T, pos]
            q_rows = read - (structure.n_pos - pattern.shape[1])
            by_source[w.layer, w.head] = pattern[:, q_rows] * vu
        source_parts.append(by_source)
    labels_out = [w.name for w in writers] + ["bias"]
    return DLAResult(metric, targets.layout(), data.weights, labels_out, torch.cat(terms_parts, 1),
                     torch.cat(source_parts, 2))


# ------------------------------------------------------------------------------ agreement
def _ranks(x: Tensor) -> Tensor:
    """Ranks from 1 with ties averaged."""
    order = torch.argsort(x, stable=True)
    ranks = torch.empty_like(x, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    values, inverse = torch.unique(x, return_inverse=True)
    sums = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(len(values), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    return (sums / counts)[inverse]


def pearson(a: Tensor, b: Tensor) -> float:
    a, b = a.to(torch.float64) - a.to(torch.float64).mean(), b.to(torch.float64) - b.to(torch.float64).mean()
    den = float(a.norm() * b.norm())
    return float((a * b).sum()) / den if den > 0 else math.nan


def spearman(a: Tensor, b: Tensor) -> float:
    return pearson(_ranks(a.to(torch.float64)), _ranks(b.to(torch.float64)))


def top_overlap(a: Tensor, b: Tensor, k: int) -> float:
    """Share of the ``k`` cells largest in ``|a|`` that are among the ``k`` largest in ``|b|``."""
    k = min(k, len(a))
    top_a = set(torch.argsort(-a.abs(), stable=True)[:k].tolist())
    top_b = set(torch.argsort(-b.abs(), stable=True)[:k].tolist())
    return len(top_a & top_b) / k


@dataclass
class Agreement:
    """How far method ``a`` agrees with method ``b`` (usually the exact one) over the same cells."""

    names: tuple[str, str]
    n_cells: int
    pearson: float
    spearman: float
    top_k: dict[int, float]
    disagreements: list[tuple[str, float, float]]
    costs: tuple[Optional[Cost], Optional[Cost]] = (None, None)

    def to_dict(self) -> dict[str, Any]:
        return {"methods": list(self.names), "cells": self.n_cells, "pearson": self.pearson,
                "spearman": self.spearman, "top_k_overlap": {str(k): v for k, v in self.top_k.items()},
                "disagreements": [{"cell": c, self.names[0]: x, self.names[1]: y} for c, x, y in self.disagreements],
                "cost": {n: (c.to_dict() if c is not None else None) for n, c in zip(self.names, self.costs)}}


def _cells(result: Any) -> tuple[Tensor, list[str], Optional[Cost]]:
    """Scores, cell names and cost of a sweep, edge scores, patching result's embeddings sweep or tensor."""
    from probes.circuits import CircuitResult, EdgeScores
    from probes.patching import PatchingResult, Sweep

    if isinstance(result, CircuitResult):
        result = result.scores
    if isinstance(result, Sweep):
        return result.effects().flatten(), result.labels(), result.cost
    if isinstance(result, EdgeScores):
        return result.scores(), [e.name for e in result.edges], result.cost
    if isinstance(result, PatchingResult):
        name = "resid_pre.0"
        require(name in result.positions, "the patching result has no embeddings sweep (resid_pre) to compare")
        values = result.positions[name]
        w = point_weights(result.weights, result.n_walks)
        effect = wmean(w, (values - result.corrupted).movedim(1, 0))[0].sum(-1)  # [pos]
        return effect, [f"pos{j}" for j in range(effect.shape[0])], result.cost
    require(isinstance(result, Tensor), f"cannot compare a {type(result).__name__}")
    flat = result.flatten()
    return flat, [str(i) for i in range(flat.numel())], None


def agreement(a: Any, b: Any, names: tuple[str, str] = ("a", "b"), k: Sequence[int] = (1, 3, 5, 10),
              n_disagree: int = 5) -> Agreement:
    """Compare two methods' scores of the same cells (see the module docstring)."""
    va, la, ca = _cells(a)
    vb, lb, cb = _cells(b)
    require(va.shape == vb.shape, f"the two results score different cells ({va.numel()} against {vb.numel()})")
    require(la == lb, "the two results label their cells differently")
    va, vb = va.to(torch.float64), vb.to(torch.float64)
    order = torch.argsort(-(va - vb).abs(), stable=True)[:n_disagree].tolist()
    return Agreement(names, va.numel(), pearson(va, vb), spearman(va, vb),
                     {int(x): top_overlap(va, vb, int(x)) for x in k if int(x) >= 1},
                     [(la[i], float(va[i]), float(vb[i])) for i in order], (ca, cb))
