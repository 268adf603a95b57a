"""Attention attribution: how much of each prediction's attention, and of its input attribution,
goes to the prediction's parents.

For every layer and head, the attention row of each prediction (``hook_pattern`` at the
prediction's query position) gives

* ``parent_attention``: the total attention on the parent position(s), averaged over walks and
  predictions (the paper's Theorem 3.1: at least ``1 - exp(-Omega(N))`` after training);
* ``parent_argmax_rate``: how often the most-attended position is a parent (ties, within 64 machine
  epsilons of the model's dtype, count as the chance that a random pick among the tied positions is
  a parent);
* ``entropy`` (nats) and ``uniformity = exp(entropy) / (number of visible positions)``: 1 for
  attention spread evenly over everything a prediction can see (the paper's Theorem 4.1 case),
  ``1 / n`` for attention on a single position;
* a per-position profile, the mean attention at each offset from the prediction's own position
  (for the paper's model, at each input position: its Fig 4c and 5c).

Two attributions spread the credit for the output over source positions and report the share
that lands on the parents:

* **attention x value norm**: ``a_j ||v_j W_O||``, the size of what position j actually writes
  into the output (Kobayashi et al. 2020), normalised over positions;
* **gradient x input**: ``(d logit_y / d e_j) . e_j`` for the embeddings ``e_j`` entering the
  first layer (``blocks.0.hook_resid_pre``) and the clean label ``y``, in absolute value and
  normalised over the visible positions. This is the only attribution that needs the dense
  embeddings and a backward pass, so it runs on the first ``config.gradient_walks`` walks (on every
  walk of an enumerated population).

A share is undefined for a walk whose attribution is 0 at every visible position (V = 0 at zero
initialisation, or a ReLU dead on that walk); the mean leaves such walks out, and is NaN only when
every walk is undefined.

The headline numbers describe the head that attends to the parents most; every head's parent
attention is kept as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from probes.config import ProbeConfig
from probes.stats import point_weights, wmean
from probes.targets import Layout, Targets, evaluating, model_dims, require_hooks, targets_for
from rwinterp.tasks import Batch, Task

PATTERN = "blocks.{layer}.attn.hook_pattern"
VALUES = "blocks.{layer}.attn.hook_v"
EMBEDDINGS = "blocks.0.hook_resid_pre"


@dataclass
class AttentionResult:
    """Per-walk attention statistics (``[batch, pred]`` unless noted) and their summaries.

    ``per_head``: parent attention of every head, ``[layer, head, batch, pred]``; ``head`` the
    (layer, head) the other fields describe; ``gradient_share`` covers the first
    ``gradient_share.shape[0]`` walks (``None`` when not computed); ``profiles``: mean attention at
    each offset ``-(n_pos - 1) .. 0`` from the prediction, ``[layer, head, offset]``.
    """

    layout: Layout
    weights: Float[Tensor, " batch"] | None
    per_head: Float[Tensor, "layer head batch pred"]
    head: tuple[int, int]
    argmax_hit: Float[Tensor, "batch pred"]
    entropy: Float[Tensor, "batch pred"]
    uniformity: Float[Tensor, "batch pred"]
    value_share: Float[Tensor, "batch pred"]
    gradient_share: Float[Tensor, "gbatch pred"] | None
    profiles: Float[Tensor, "layer head offset"]

    @property
    def n_walks(self) -> int:
        return int(self.entropy.shape[0])

    @property
    def profile(self) -> Float[Tensor, " offset"]:
        """The mean attention profile of the reported head."""
        return self.profiles[self.head]

    def summary(self, w: Float[Tensor, "draws batch"]) -> dict[str, Tensor]:
        def mean(values: Tensor, rows: Tensor = w) -> Tensor:
            return wmean(rows, values.mean(-1))

        def defined_mean(share: Tensor) -> Tensor:
            """Weighted mean of a share over the walks where it is defined (a walk whose attribution is 0
            at every visible position, such as one a dead ReLU silences, has none): NaN only if none is."""
            rows = w[:, : share.shape[0]]
            walk = share.nanmean(-1)
            rows = rows * walk.isfinite()
            return wmean(rows, torch.nan_to_num(walk))

        L, H = self.per_head.shape[:2]
        out = {f"parent_attention.L{l}H{h}": mean(self.per_head[l, h]) for l in range(L) for h in range(H)}
        out.update(
            parent_attention=mean(self.per_head[self.head]),
            parent_argmax_rate=mean(self.argmax_hit),
            entropy=mean(self.entropy),
            uniformity=mean(self.uniformity),
            value_weighted_parent_share=defined_mean(self.value_share),
        )
        if self.gradient_share is not None:
            out["gradient_parent_share"] = defined_mean(self.gradient_share)
        return out

    def scores(self) -> dict[str, float]:
        w = point_weights(self.weights, self.n_walks)
        return {k: float(v[0]) for k, v in self.summary(w).items()}


def attention_probe(model: Any, task: Task, data: Batch, config: ProbeConfig = ProbeConfig()) -> AttentionResult:
    """Attention statistics and attributions of every prediction (see the module docstring).

    A pure function of (model, task, data, config): the model's weights and mode are untouched.
    """
    with evaluating(model):
        targets = targets_for(model, task, data, config.kind)
        n_layers, n_heads = model_dims(model)
        patterns = [PATTERN.format(layer=l) for l in range(n_layers)]
        values = [VALUES.format(layer=l) for l in range(n_layers)]
        require_hooks(model, patterns + values + ([EMBEDDINGS] if config.gradient_walks else []), "attention")
        with torch.no_grad():
            _, cache = model.run_with_cache(targets.inputs, names_filter=patterns + values)
        rows = torch.stack([_rows(cache[name], targets) for name in patterns])  # [L, B, H, T, pos]
        rows = rows.transpose(1, 2)  # [L, H, B, T, pos]
        parents = targets.parents.to(rows.dtype)
        per_head = (rows * parents).sum(-1).to(torch.float64)
        w0 = point_weights(data.weights, targets.n_walks)
        head_means = wmean(w0, per_head.mean(-1).permute(2, 0, 1))[0]
        flat = int(torch.nan_to_num(head_means, nan=-1.0).flatten().argmax())
        head = (flat // n_heads, flat % n_heads)
        a = rows[head].to(torch.float64)  # [B, T, pos]
        visible = targets.visible
        hit = _argmax_hits(rows[head], targets)  # (in the model's dtype: a float32 model's ties are float32's)
        entropy = -(a * torch.where(a > 0, a.log(), torch.zeros_like(a))).sum(-1)
        uniformity = entropy.exp() / visible.sum(-1).to(torch.float64)
        v = cache[values[head[0]]]
        value_share = _share(a * _value_norms(model, v, head), targets)
        # A population (weighted, enumerated in order) is attributed whole: its first walks are no sample of it.
        n_gradient = targets.n_walks if data.weights is not None else config.gradient_walks
        gradient = _gradient_x_input(model, targets, n_gradient) if config.gradient_walks else None
        return AttentionResult(
            layout=targets.layout(),
            weights=data.weights,
            per_head=per_head,
            head=head,
            argmax_hit=hit,
            entropy=entropy,
            uniformity=uniformity,
            value_share=value_share,
            gradient_share=None if gradient is None else _share(gradient.abs(), targets),
            profiles=_profiles(rows, targets, w0),
        )


def _rows(pattern: Float[Tensor, "batch head q pos"], targets: Targets) -> Float[Tensor, "batch head pred pos"]:
    """Each prediction's attention row, from a ``hook_pattern`` activation."""
    return pattern[:, :, targets.query_index(pattern.shape[2]), :]


def _argmax_hits(a: Float[Tensor, "batch pred pos"], targets: Targets) -> Float[Tensor, "batch pred"]:
    """Share of the most-attended visible positions that are parents: 1 or 0 without ties; with
    ties (within 64 machine epsilons), the chance that a random pick among them is a parent."""
    masked = a.masked_fill(~targets.visible, -1.0)
    top = masked.amax(-1, keepdim=True)
    best = masked >= top - 64 * torch.finfo(a.dtype).eps * top.abs()
    return (best & targets.parents).sum(-1).to(torch.float64) / best.sum(-1).to(torch.float64)


def _value_norms(model: Any, v: Float[Tensor, "batch pos kvhead d_head"], head: tuple[int, int]) -> Tensor:
    """``||v_j W_O||`` of the head (``||v_j||`` when the model exposes no ``W_O``), ``[batch, 1, pos]``."""
    layer, h = head
    vh = v[:, :, h * v.shape[2] // model_dims(model)[1], :].to(torch.float64)
    W_O = getattr(model, "W_O", None)
    if not (isinstance(W_O, Tensor) and W_O.ndim == 4):
        return vh.norm(dim=-1)[:, None, :]
    W = W_O[layer, h].detach().to(torch.float64)
    gram = W @ W.T  # ||v W_O||^2 = v (W_O W_O^T) v^T, without building [batch, pos, d_model]
    return torch.einsum("bpi,ij,bpj->bp", vh, gram, vh).clamp(min=0).sqrt()[:, None, :]


def _share(attribution: Float[Tensor, "batch pred pos"], targets: Targets) -> Float[Tensor, "batch pred"]:
    """Share of the (non-negative) attribution over visible positions that sits on the parents."""
    visible = attribution * targets.visible
    total = visible.sum(-1)
    on_parents = (attribution * targets.parents).sum(-1)
    return torch.where(total > 0, on_parents / torch.where(total > 0, total, 1.0), torch.nan)


def _gradient_x_input(model: Any, targets: Targets, n: int, chunk: int = 50) -> Float[Tensor, "n pred pos"]:
    """``(d logit_y / d e_j) . e_j`` for the first ``n`` walks, ``e`` = ``blocks.0.hook_resid_pre``."""
    out = []
    n = min(n, targets.n_walks)
    for start in range(0, n, chunk):
        rows = slice(start, min(n, start + chunk))
        store: dict[str, Tensor] = {}

        def leaf(act: Tensor, hook: Any) -> Tensor:
            store["e"] = act.detach().requires_grad_(True)
            return store["e"]

        with torch.enable_grad():
            logits = model.run_with_hooks(targets.inputs[rows], fwd_hooks=[(EMBEDDINGS, leaf)])
            label_logits = targets.select(logits).gather(-1, targets.labels[rows][..., None])[..., 0]  # [b, T]
            e = store["e"]
            attributions = []
            for i in range(targets.n_pred):
                (grad,) = torch.autograd.grad(label_logits[:, i].sum(), e, retain_graph=i + 1 < targets.n_pred)
                attributions.append((grad * e).sum(-1).detach())
        out.append(torch.stack(attributions, dim=1).to(torch.float64))
    return torch.cat(out)


def _profiles(rows: Float[Tensor, "layer head batch pred pos"], targets: Targets, w: Tensor) -> Tensor:
    """Mean attention at each offset from the prediction's own position, per head."""
    means = wmean(w, rows.permute(2, 0, 1, 3, 4).to(torch.float64))[0]  # [L, H, T, pos]
    total, count = targets.by_offset(means)
    return total / count.clamp(min=1)
