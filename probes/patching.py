"""Activation patching: which positions and components carry the information a prediction uses.

Setup
-----
Take the test walks (*clean*) and as many independent walks of the same task (*corrupted*):
they differ at essentially every position, so nothing the model reads is shared by accident.
(Corrupting only the parent would be uninformative: patching the parent position back would then
restore everything for any model.) For each prediction the metric is the logit difference

    LD = logit[clean walk's true next state] - logit[corrupted walk's true next state],

and a patched run's *normalised effect* is a ratio of batch means,

    effect = mean_b (LD_patched - LD_corrupted) / mean_b (LD_clean - LD_corrupted),

so 0 means no recovery and 1 full recovery of the clean output, and walks whose clean and
corrupted labels agree (LD = 0 in every run) add nothing instead of dividing by zero. With several
predictions per walk (autoregressive models) the sums run over predictions too. When the
denominator is negligible next to the model's outputs the effect is NaN (undefined), not a big
number: a model whose output does not depend on the walk cannot be localised.

Sweeps (clean activations patched into the corrupted run)
----------------------------------------------------------
* ``resid_pre.L``: the residual stream entering layer L, one position at a time. For layer 0 it is
  the embeddings, and since each position's embedding depends only on that position's token,
  patching position j is the same as running on the corrupted walk with token j taken from the
  clean walk. That is how it is computed (no ``[walk, position, d_model]`` tensors); the identity
  is checked on a few walks against a real hook patch first and the hook patch is used instead if
  it fails (any model where the embedding at j would depend on other positions).
* ``v.L``: the value vectors of layer L (all heads), one position at a time. Attention output is
  linear in the values for a fixed pattern, so where a layer computes ``z = pattern @ v`` (checked
  on the corrupted run) the patch is applied to z as ``pattern[..., j] (v_clean[j] - v_corrupted[j])``:
  the same numbers, without hooking v (the paper's model then keeps its fast path).
* ``z.L`` and ``pattern.L``: each head's output and attention pattern, head by head, at all query
  positions at once (TransformerLens ``layer_head_vector_patch_setter`` and
  ``layer_head_pattern_patch_setter``).

Several patches run stacked in one batch (each copy of the corrupted walks patched differently),
which is what makes a full sweep of a 97-position model on 1000 walks take about a second.
TransformerLens' ``generic_activation_patch`` runs one forward pass per patch and patches
activations only, so it is not used for the sweeps; its patch setters are.

Scores
------
* ``parent_effect``: the summed normalised effect of patching the parent position(s) one at a time
  (embeddings sweep; per sweep under ``by_hook``).
* ``localization``: the share of the total absolute effect, over all positions a prediction can
  see, that sits at its parents.
* ``necessity``: how far the output moves from the clean run towards the corrupted run when only
  the parents are corrupted, ``mean(LD_clean - LD_only_parents_corrupted) / mean(LD_clean -
  LD_corrupted)`` (1 = all the way: the parents are necessary).
* ``sufficiency``: one minus how far it moves when everything except the parents is corrupted,
  ``mean(LD_only_parents_clean - LD_corrupted) / mean(LD_clean - LD_corrupted)`` (1 = the parents
  alone keep the clean output). For one parent this equals the embeddings sweep's parent effect.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from tqdm.auto import tqdm
from transformer_lens.patching import (
    layer_head_pattern_patch_setter,
    layer_head_vector_patch_setter,
    layer_pos_patch_setter,
)

from probes.config import ProbeConfig
from probes.stats import point_weights, ratio, wmean
from probes.targets import (
    Layout,
    Targets,
    evaluating,
    hook_names,
    logit_diff,
    model_dims,
    require_hooks,
    run_logits,
    targets_for,
)
from rwinterp.errors import require
from rwinterp.tasks import Batch, Task

#: TransformerLens hook of each sweep's activation.
HOOKS = {
    "resid_pre": "blocks.{layer}.hook_resid_pre",
    "v": "blocks.{layer}.attn.hook_v",
    "z": "blocks.{layer}.attn.hook_z",
    "pattern": "blocks.{layer}.attn.hook_pattern",
}
#: TransformerLens patch setters of the head-by-head sweeps.
HEAD_SETTERS = {"z": layer_head_vector_patch_setter, "pattern": layer_head_pattern_patch_setter}
#: Sweeps that patch one position at a time; the others patch one head at a time.
BY_POSITION = ("resid_pre", "v")
#: The sweep behind the headline ``parent_effect`` and ``localization``.
MAIN = "resid_pre.0"


def corrupted_walks(task: Task, n: int, seed: int) -> Batch:
    """``n`` walks drawn independently of the test walks (seed derived from ``seed``)."""
    derived = int(np.random.SeedSequence([int(seed), 0x70617463]).generate_state(1)[0])
    return task.sample(n, derived)


@dataclass(frozen=True)
class Cell:
    """One patched run: ``positions`` of the inputs taken from the donor walks, and/or the
    activation ``hook`` edited in place by ``patch`` (called on this run's rows of the batch)."""

    positions: Bool[Tensor, " pos"] | None = None
    hook: str | None = None
    patch: Callable[[Tensor], Any] | None = None


def setter_patch(setter: Callable, index: tuple[int, ...], clean: Tensor) -> Callable[[Tensor], Any]:
    """A TransformerLens patch setter (``layer_pos_patch_setter`` ...) as an in-place edit."""
    return lambda act: setter(act, list(index), clean)


def value_patch(pattern: Tensor, dv: Tensor, j: int) -> Callable[[Tensor], Any]:
    """Patching the values at position ``j``, applied to the head outputs ``z = pattern @ v``:
    with the pattern fixed, ``z`` changes by ``pattern[..., j] (v_clean[j] - v_corrupted[j])``."""
    return lambda act: act.add_(torch.einsum("bhq,bhd->bqhd", pattern[:, :, :, j], dv[:, j]).to(act.dtype))


def _patch_hook(act: Tensor, hook: Any, cells: list[tuple[slice, Cell]]) -> Tensor:
    act = act.clone()
    for rows, cell in cells:
        cell.patch(act[rows])
    return act


def run_cells(
    model: Any,
    base: Targets,
    donor: Int[Tensor, "batch pos"],
    cells: list[Cell],
    bad: Int[Tensor, "batch pred"],
    max_rows: int,
    bar: Any = None,
    metric: Callable[[Tensor, Targets], Tensor] | None = None,
) -> Float[Tensor, "cell batch ..."]:
    """Logit differences (``base.labels`` against ``bad``) of every patched run, stacked
    ``max_rows // batch`` runs per forward pass; with ``metric``, ``metric(logits, base)`` of each
    run instead (``logits`` ``[run, batch, lpos, vocab]``, see :func:`walk_metric`)."""
    B = base.n_walks
    per = max(1, max_rows // max(B, 1))
    out = []
    for start in range(0, len(cells), per):
        chunk = cells[start : start + per]
        inputs = base.inputs.repeat(len(chunk), 1)
        hooks: dict[str, list[tuple[slice, Cell]]] = {}
        for p, cell in enumerate(chunk):
            rows = slice(p * B, (p + 1) * B)
            if cell.positions is not None:
                inputs[rows, cell.positions] = donor[:, cell.positions]
            if cell.hook is not None:
                hooks.setdefault(cell.hook, []).append((rows, cell))
        fwd = [(name, partial(_patch_hook, cells=lst)) for name, lst in hooks.items()]
        with torch.no_grad():
            logits = model.run_with_hooks(inputs, fwd_hooks=fwd)
        logits = logits.reshape(len(chunk), B, *logits.shape[1:])
        out.append(logit_diff(logits, base, base.labels, bad) if metric is None else metric(logits, base))
        if bar is not None:
            bar.update(len(chunk))
    return torch.cat(out)


def embeddings_patch_is_substitution(model: Any, clean: Targets, corrupted: Targets, n: int = 8) -> bool:
    """Whether patching ``blocks.0.hook_resid_pre`` at one position equals swapping that token.

    True by definition for a model without that hook (the embeddings are then only reachable
    through the tokens)."""
    name = "blocks.0.hook_resid_pre"
    if name not in hook_names(model):
        return True
    n = min(n, clean.n_walks)
    j = min(clean.n_pos - 2, max(int(clean.parents[0].nonzero()[0, 0]), 0))
    small_clean, small_corr = clean.inputs[:n], corrupted.inputs[:n]
    with torch.no_grad():
        _, cache = model.run_with_cache(small_clean, names_filter=[name])
        hooked = model.run_with_hooks(
            small_corr,
            fwd_hooks=[(name, lambda act, hook: layer_pos_patch_setter(act.clone(), [0, j], cache[name]))],
        )
    swapped = small_corr.clone()
    swapped[:, j] = small_clean[:, j]
    direct = run_logits(model, swapped)
    tol = 1e-4 * float(hooked.abs().max()) + 1e-12
    return bool((hooked - direct).abs().max() <= tol)


@dataclass
class PatchingResult:
    """Per-walk logit differences of every patched run, and the scores computed from them.

    ``clean``/``corrupted``: ``[batch, pred]`` logit differences of the unpatched runs.
    ``positions[name]``: ``[pos, batch, pred]``, one row per patched position (``resid_pre.L``,
    ``v.L``). ``heads[name]``: ``[layer, head, batch, pred]`` (``z``, ``pattern``).
    ``only_parents_corrupted`` / ``only_parents_clean``: the necessity and sufficiency runs.
    ``method``: ``exact`` (every patched run computed), or ``atp``/``atp*`` (every patched run's logit
    difference estimated by attribution patching from the corrupted run, the only-parents runs as sums of
    the embeddings sweep's estimates); ``cost``: the passes and seconds spent.
    ``contrast``: the input positions at which some clean walk differs from its corrupted partner.
    Patching a position without contrast changes nothing, so if only parents have contrast (the QA
    tasks: only the fruit slots vary) localization is 1 for any model, trained or not.
    """

    layout: Layout
    weights: Float[Tensor, " batch"] | None
    clean: Float[Tensor, "batch pred"]
    corrupted: Float[Tensor, "batch pred"]
    only_parents_corrupted: Float[Tensor, "batch pred"]
    only_parents_clean: Float[Tensor, "batch pred"]
    scale: float
    embeddings_by_substitution: bool
    contrast: Bool[Tensor, " pos"]
    positions: dict[str, Float[Tensor, "pos batch pred"]] = field(default_factory=dict)
    heads: dict[str, Float[Tensor, "layer head batch pred"]] = field(default_factory=dict)
    method: str = "exact"
    cost: Cost | None = None

    @property
    def n_walks(self) -> int:
        return int(self.clean.shape[0])

    def summary(self, w: Float[Tensor, "draws batch"]) -> dict[str, Tensor]:
        """Every score, one value per weight row (see :mod:`probes.stats`)."""
        corr = self.corrupted
        den = wmean(w, self.clean - corr).sum(-1)
        scale = self.scale
        out: dict[str, Tensor] = {}
        par, vis = self.layout.parents.T.to(torch.float64), self.layout.visible.T.to(torch.float64)
        for name, values in self.positions.items():
            num = wmean(w, (values - corr).movedim(1, 0))  # [draws, pos, pred]
            out[f"{name}.parent_effect"] = ratio((num * par).sum((1, 2)), den, scale)
            size = num.abs()
            out[f"{name}.localization"] = ratio((size * par).sum((1, 2)), (size * vis).sum((1, 2)), scale)
        for name, values in self.heads.items():
            num = wmean(w, (values - corr).permute(2, 0, 1, 3)).sum(-1)  # [draws, layer, head]
            effect = ratio(num, den[:, None, None], scale)
            for layer in range(effect.shape[1]):
                for head in range(effect.shape[2]):
                    out[f"{name}.L{layer}H{head}"] = effect[:, layer, head]
        out["necessity"] = 1.0 - ratio(wmean(w, self.only_parents_corrupted - corr).sum(-1), den, scale)
        out["sufficiency"] = ratio(wmean(w, self.only_parents_clean - corr).sum(-1), den, scale)
        if f"{MAIN}.parent_effect" in out:
            out["parent_effect"] = out[f"{MAIN}.parent_effect"]
            out["localization"] = out[f"{MAIN}.localization"]
        return out

    @property
    def contrast_outside_parents(self) -> float:
        """Share of the (prediction, visible non-parent position) pairs at which the clean and
        corrupted inputs differ somewhere; 0 means localization is 1 by construction."""
        others = self.layout.visible & ~self.layout.parents
        return int((others & self.contrast[None, :]).sum()) / max(int(others.sum()), 1)

    def scores(self) -> dict[str, float]:
        """Point estimates of :meth:`summary`."""
        w = point_weights(self.weights, self.n_walks)
        return {k: float(v[0]) for k, v in self.summary(w).items()}

    def profile(self, name: str = MAIN) -> Float[Tensor, " offset"]:
        """Normalised effect of patching at each offset from the prediction's own position
        (``-(n_pos - 1) .. 0``): for a query-slot model, index ``j`` is input position ``j``.
        Predictions that cannot see an offset do not count towards it."""
        values = self.positions[name]
        w = point_weights(self.weights, self.n_walks)
        num = wmean(w, (values - self.corrupted).movedim(1, 0))[0]  # [pos, pred]
        den_t = wmean(w, self.clean - self.corrupted)[0]  # [pred]
        prof, _ = self.layout.by_offset(num.T)
        den, _ = self.layout.by_offset(den_t[:, None].expand(-1, values.shape[0]))
        return ratio(prof, den, self.scale)


def patching_probe(model: Any, task: Task, data: Batch, config: ProbeConfig = ProbeConfig(),
                   method: str = "exact") -> PatchingResult:
    """Patch clean activations into runs on independent corrupted walks (see the module docstring).

    ``method``: ``exact``, or ``atp``/``atp*`` for attribution patching's estimate of every patched run
    (each patched run's logit difference estimated as ``LD_corrupted + (a_clean - a_corrupted) . dLD/da`` at
    the corrupted run, with AtP*'s query-key fix on the position sweeps for ``atp*``), returned in the same result.
    A pure function of (model, task, data, config): the model's weights and mode are untouched.
    """
    _require_choice(method, METHODS, "patching method")
    start = time.perf_counter()
    with evaluating(model):
        result = _patching(model, task, data, config) if method == "exact" else _atp_patching(
            model, task, data, config, method)
    if result.cost is None:  # exact: one pass per patched run, plus the clean and corrupted runs
        runs = sum(v.shape[0] for v in result.positions.values()) + sum(
            v.shape[0] * v.shape[1] for v in result.heads.values())
        result.cost = Cost(forward=runs + 2 + 2 * len(_parent_groups(targets_for(model, task, data[:2], config.kind))))
    result.cost.seconds = time.perf_counter() - start
    return result


def _patching(model: Any, task: Task, data: Batch, config: ProbeConfig) -> PatchingResult:
    clean = targets_for(model, task, data, config.kind)
    corrupted = clean.with_batch(task, corrupted_walks(task, len(data), config.seed))
    n_layers, n_heads = model_dims(model)
    substitution = "resid_pre" not in config.hooks or embeddings_patch_is_substitution(model, clean, corrupted)
    name = {kind: [HOOKS[kind].format(layer=layer) for layer in range(n_layers)] for kind in HOOKS}
    wanted = [k for k in config.hooks if k != "resid_pre"]
    needed = [n for k in wanted for n in name[k]]
    if "resid_pre" in config.hooks:
        needed += name["resid_pre"][0 if not substitution else 1 :]
    if "v" in config.hooks:
        needed += [n for k in ("z", "pattern") for n in name[k]]
    needed = list(dict.fromkeys(needed))
    require_hooks(model, needed, "patching")
    with torch.no_grad():
        clean_logits, clean_cache = _cached(model, clean.inputs, needed)
        corrupted_logits, corr_cache = _cached(model, corrupted.inputs, needed if "v" in config.hooks else [])
    sweeps: list[tuple[str, list[Cell]]] = []
    positions = range(clean.n_pos)
    for kind in config.hooks:
        for layer in range(n_layers):
            hook = name[kind][layer]
            if kind == "resid_pre" and layer == 0 and substitution:
                cells = [Cell(positions=torch.arange(clean.n_pos) == j) for j in positions]
            elif kind == "v" and _z_is_pattern_at_v(corr_cache, name, layer):
                dv = clean_cache[hook] - corr_cache[hook]
                pattern = corr_cache[name["pattern"][layer]]
                cells = [Cell(hook=name["z"][layer], patch=value_patch(pattern, dv, j)) for j in positions]
            elif kind in BY_POSITION:
                cells = [Cell(hook=hook, patch=setter_patch(layer_pos_patch_setter, (layer, j), clean_cache[hook]))
                         for j in positions]
            else:
                setter = HEAD_SETTERS[kind]
                cells = [Cell(hook=hook, patch=setter_patch(setter, (layer, h), clean_cache[hook]))
                         for h in range(n_heads)]
            sweeps.append((f"{kind}.{layer}", cells))
    bad = corrupted.labels
    base = replace(clean, inputs=corrupted.inputs)  # corrupted walks, scored against the clean labels
    groups = _parent_groups(clean)
    bar = tqdm(total=sum(len(c) for _, c in sweeps) + 2 * len(groups), desc="patching", leave=False,
               disable=None if config.progress is None else not config.progress)
    runs = {key: run_cells(model, base, clean.inputs, cells, bad, config.max_rows, bar) for key, cells in sweeps}
    group_cells = [Cell(positions=mask) for mask, _ in groups]
    necessity = run_cells(model, clean, corrupted.inputs, group_cells, bad, config.max_rows, bar)
    sufficiency = run_cells(model, base, clean.inputs, group_cells, bad, config.max_rows, bar)
    bar.close()
    pick = torch.zeros(clean.n_pred, dtype=torch.long)
    for g, (_, preds) in enumerate(groups):
        pick[preds] = g
    cols = torch.arange(clean.n_pred)
    result = PatchingResult(
        layout=clean.layout(),
        weights=data.weights,
        clean=logit_diff(clean_logits, clean, clean.labels, bad),
        corrupted=logit_diff(corrupted_logits, clean, clean.labels, bad),
        only_parents_corrupted=necessity[pick, :, cols].T,
        only_parents_clean=sufficiency[pick, :, cols].T,
        scale=float(clean.select(clean_logits).abs().mean()) * clean.n_pred,
        embeddings_by_substitution=substitution,
        contrast=(clean.inputs != corrupted.inputs).any(0),
    )
    for key, values in runs.items():
        kind, layer = key.split(".")
        if kind in BY_POSITION:
            result.positions[key] = values
        else:
            stacked = result.heads.setdefault(kind, values.new_zeros(n_layers, n_heads, *values.shape[1:]))
            stacked[int(layer)] = values
    return result


def _cached(model: Any, inputs: Tensor, names: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
    """Logits and the named activations of one run (a plain dict; nothing else is cached)."""
    if not names:
        return run_logits(model, inputs), {}
    logits, cache = model.run_with_cache(inputs, names_filter=names)
    return logits, {n: cache[n] for n in names}


def _z_is_pattern_at_v(cache: dict[str, Tensor], name: dict[str, list[str]], layer: int) -> bool:
    """Whether layer ``layer`` computes ``z = pattern @ v`` head by head (checked on the cached
    corrupted run), so that a value patch can be applied to z (:func:`value_patch`)."""
    keys = [name[k][layer] for k in ("v", "pattern", "z")]
    if not all(k in cache for k in keys):
        return False
    v, pattern, z = (cache[k] for k in keys)
    if v.ndim != 4 or pattern.ndim != 4 or z.ndim != 4 or not (v.shape[2] == pattern.shape[1] == z.shape[2]):
        return False
    if pattern.shape[-1] != v.shape[1] or pattern.shape[2] != z.shape[1]:
        return False
    rebuilt = torch.einsum("bhqp,bphd->bqhd", pattern.to(torch.float64), v.to(torch.float64))
    tol = 1e-5 * float(rebuilt.abs().max()) + 1e-30
    return bool((rebuilt - z.to(torch.float64)).abs().max() <= tol)


def _parent_groups(targets: Targets) -> list[tuple[Bool[Tensor, " pos"], Tensor]]:
    """Distinct parent sets, each with the predictions that have it."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(targets.parent_sets()):
        groups.setdefault(row, []).append(i)
    out = []
    for row, preds in groups.items():
        mask = torch.zeros(targets.n_pos, dtype=torch.bool)
        mask[list(row)] = True
        out.append((mask, torch.tensor(preds)))
    return out


# ===================================================================================== sweeps
#
# The probe above patches clean activations into corrupted runs and reads logit differences. The
# sweeps below ask the same question with the other sources and metrics a circuit study uses, at
# every granularity, exactly (one patched run per cell, stacked) or by attribution patching (one
# forward and one backward pass for every cell at once), and return the same typed result either way.

#: What a sweep measures per walk: ``loss``, the mean next-state cross-entropy over the walk's
#: predictions (nats), or ``logit_diff``, the summed logit difference of the clean label against an
#: independent walk's label (as :func:`patching_probe`).
METRICS = ("loss", "logit_diff")
#: Where a patched activation comes from. ``mean``: its mean over the walks at that position (mean
#: ablation); ``resample``: its value on an independent walk (resample ablation); both are patched into
#: the clean run. ``clean``: the clean walk's value, patched into the run on an independent corrupted walk
#: (denoising, the direction of :func:`patching_probe`).
SOURCES = ("mean", "resample", "clean")
#: ``exact``: one patched forward pass per cell. ``atp``: attribution patching, ``(a_source - a) . dm/da``
#: at the run the patches go into (Nanda 2023). ``atp*``: AtP with the query-key fix of Kramar et al.
#: (2024): a change that reaches a head's queries or keys directly through the residual stream is
#: carried through that head's softmax exactly, and only linearised after the attention pattern. ``ig``:
#: integrated gradients over the inputs (the node form of EAP-IG, Hanna et al. 2024): the same deltas, the
#: gradient averaged over ``steps`` runs whose embeddings move from the source's towards the base run's
#: (``x_k = x_s + k/m (x - x_s)``, ``k = 0 .. m-1``).
METHODS = ("exact", "atp", "atp*", "ig")
GRANULARITIES = ("layer", "head", "position", "head_position")
#: Hook families a sweep patches: hook name, head axis and position axis (counting the batch axis).
#: The position axis of ``pattern`` is its query axis; a query-slot model's heads have one query row.
FAMILIES = {
    "resid_pre": ("blocks.{layer}.hook_resid_pre", None, 1),
    "attn_out": ("blocks.{layer}.hook_attn_out", None, 1),
    "mlp_out": ("blocks.{layer}.hook_mlp_out", None, 1),
    "q": ("blocks.{layer}.attn.hook_q", 2, 1),
    "k": ("blocks.{layer}.attn.hook_k", 2, 1),
    "v": ("blocks.{layer}.attn.hook_v", 2, 1),
    "z": ("blocks.{layer}.attn.hook_z", 2, 1),
    "pattern": ("blocks.{layer}.attn.hook_pattern", 1, 2),
}
#: Largest activation, in elements, that one stacked forward pass or attribution chunk may build.
ELEMENT_BUDGET = 1 << 24


@dataclass
class Cost:
    """What a method spent: forward and backward passes over the walks (a batch of patched runs
    stacked ``k`` deep counts ``k``), and wall-clock seconds."""

    forward: int = 0
    backward: int = 0
    seconds: float = 0.0

    @property
    def passes(self) -> int:
        return self.forward + self.backward

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.forward + other.forward, self.backward + other.backward, self.seconds + other.seconds)

    def to_dict(self) -> dict[str, float]:
        return {"forward": self.forward, "backward": self.backward, "passes": self.passes, "seconds": self.seconds}


def prediction_losses(logits: Float[Tensor, "... batch lpos vocab"],
                      targets: Targets) -> Float[Tensor, "... batch pred"]:
    """Cross-entropy (nats) of every prediction's state logits against its label (float64)."""
    sel = targets.select(logits).to(torch.float64)
    labels = targets.labels.expand(sel.shape[:-1])[..., None]
    return torch.logsumexp(sel, -1) - sel.gather(-1, labels)[..., 0]


def walk_metric(logits: Tensor, targets: Targets, metric: str, bad: Tensor | None = None) -> Float[Tensor, "... batch"]:
    """The sweep metric of every walk (see :data:`METRICS`)."""
    if metric == "loss":
        return prediction_losses(logits, targets).mean(-1)
    return logit_diff(logits, targets, targets.labels, bad).sum(-1)


def element_rows(model: Any, n_pos: int, budget: int = ELEMENT_BUDGET) -> int:
    """How many walks one pass may hold so that its largest activation (the attention pattern, or the
    residual stream) stays under ``budget`` elements."""
    cfg = model.cfg
    per_walk = max(int(cfg.n_heads) * n_pos * n_pos, n_pos * int(cfg.d_model), 1)
    return max(1, budget // per_walk)


@dataclass
class Sweep:
    """The metric of every walk with each cell patched (exact), or its first-order estimate (AtP).

    ``values`` is ``[layer, (head,) (pos,) batch]`` by ``granularity``; ``base`` the metric of the unpatched
    run the patches go into (the clean run for ``mean``/``resample``, the corrupted run for ``clean``).
    ``positions``: the input positions of the position axis. ``graddrop``: with GradDrop, its ranking
    score of every cell (unsigned, batch level). The *effect* of a cell is the mean over walks of
    ``values - base``: for a mean ablation with the loss metric, the loss increase in nats.
    """

    family: str
    granularity: str
    source: str
    metric: str
    method: str
    layout: Layout
    positions: Int[Tensor, " cellpos"]
    weights: Float[Tensor, " batch"] | None
    base: Float[Tensor, " batch"]
    values: Float[Tensor, "... batch"]
    cost: Cost
    graddrop: Tensor | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return {"layer": ("layer",), "head": ("layer", "head"), "position": ("layer", "pos"),
                "head_position": ("layer", "head", "pos")}[self.granularity]

    @property
    def n_walks(self) -> int:
        return int(self.base.shape[0])

    def summary(self, w: Float[Tensor, "draws batch"]) -> Float[Tensor, "draws ..."]:
        """The effect of every cell, one row per weight row (see :mod:`probes.stats`)."""
        diff = (self.values - self.base).movedim(-1, 0)
        return wmean(w, diff)

    def effects(self) -> Tensor:
        """Point estimate of every cell's effect, shaped like ``values`` without the batch axis."""
        return self.summary(point_weights(self.weights, self.n_walks))[0]

    def intervals(self, draws: int = 200, seed: int = 0, confidence: float = 0.95) -> tuple[Tensor, Tensor]:
        """Bootstrap intervals (over walks) of every cell's effect."""
        from probes.stats import bootstrap_interval, bootstrap_weights

        w = bootstrap_weights(self.weights, self.n_walks, draws, seed)
        samples = self.summary(w).flatten(1)
        point = self.effects().flatten()
        bounds = [bootstrap_interval(samples[:, i], float(point[i]), confidence) for i in range(point.numel())]
        lo = torch.tensor([b[0] for b in bounds], dtype=torch.float64).reshape(self.effects().shape)
        hi = torch.tensor([b[1] for b in bounds], dtype=torch.float64).reshape(self.effects().shape)
        return lo, hi

    def labels(self) -> list[str]:
        """A name per cell, in the order of ``effects().flatten()``: ``L0``, ``L0H1``, ``L0@12``, ``L0H1@12``."""
        shape = self.effects().shape
        out = []
        for index in np.ndindex(*shape):
            parts = dict(zip(self.axes, index))
            name = f"L{parts['layer']}" + (f"H{parts['head']}" if "head" in parts else "")
            if "pos" in parts:
                name += f"@{int(self.positions[parts['pos']])}"
            out.append(name)
        return out

    def ranking(self) -> Tensor:
        """The score cells are ranked by (flattened): GradDrop's where computed, else ``|effect|``."""
        if self.graddrop is not None:
            return self.graddrop.flatten()
        return self.effects().flatten().abs()


def _require_choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    require(value in allowed, f"unknown {what} {value!r}; known: {', '.join(allowed)}")


def sweep(
    model: Any,
    task: Task,
    data: Batch,
    family: str = "z",
    granularity: str = "head",
    source: str = "mean",
    metric: str = "loss",
    method: str = "exact",
    config: ProbeConfig | None = None,
    graddrop: bool = False,
    steps: int = 1,
) -> Sweep:
    """Patch every cell of a hook family from ``source`` and measure ``metric`` (see the constants above).

    ``granularity``: ``layer`` (the whole activation of a layer), ``head`` (one head at every position),
    ``position`` (every head at one position) or ``head_position``. ``method`` ``exact`` runs one patched
    pass per cell; ``atp``/``atp*`` estimate them all from one forward and one backward pass (a cell that
    joins positions gets the sum of its head x position estimates, AtP*'s query-key fix included: the fix
    is exact for one position's change at a time); ``ig`` from ``steps`` of each.
    ``graddrop`` (AtP methods, models of two or more layers) adds Kramar et al.'s GradDrop ranking
    score: ``1/(L-1) sum_l |AtP with the gradient through layer l's output dropped|``. ``steps``: the m
    of ``ig``. A pure function of its inputs: the model's weights, mode and hooks are left as they were.
    """
    config = config or ProbeConfig()
    _require_choice(family, tuple(FAMILIES), "hook family")
    _require_choice(granularity, GRANULARITIES, "granularity")
    _require_choice(source, SOURCES, "source")
    _require_choice(metric, METRICS, "metric")
    _require_choice(method, METHODS, "method")
    require(not graddrop or method in ("atp", "atp*"), "GradDrop is an option of the methods atp and atp*")
    require(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
            f"integrated gradients need m >= 1 steps, got {steps!r}")
    require(FAMILIES[family][1] is not None or granularity in ("layer", "position"),
            f"the {family} activation has no head axis; use the granularity layer or position")
    with evaluating(model):
        start = time.perf_counter()
        result = _sweep(model, task, data, family, granularity, source, metric, method, config, graddrop, steps)
        result.cost.seconds = time.perf_counter() - start
        return result


@dataclass
class _Setup:
    """The runs of a sweep: ``base`` (what is patched into), the ``donor`` inputs (resample/clean), the
    labels a logit difference is taken against, and the hooks' names."""

    base: Targets
    donor: Tensor | None
    bad: Tensor
    names: list[str]
    kind: str

    def metric(self, logits: Tensor, targets: Targets, start: int = 0) -> Tensor:
        """The metric of walks ``start ..`` (``targets`` holds their labels), ``[..., batch]``."""
        bad = self.bad[start : start + targets.labels.shape[0]]
        return walk_metric(logits, targets, self.kind, bad)


def _setup(model: Any, task: Task, data: Batch, family: str, source: str, metric: str, config: ProbeConfig) -> _Setup:
    clean = targets_for(model, task, data, config.kind)
    n_layers, _ = model_dims(model)
    names = [FAMILIES[family][0].format(layer=layer) for layer in range(n_layers)]
    require_hooks(model, names, "sweep")
    other = clean.with_batch(task, corrupted_walks(task, len(data), config.seed))
    base = replace(clean, inputs=other.inputs) if source == "clean" else clean
    donor = {"clean": clean.inputs, "resample": other.inputs}.get(source)
    bad = other.labels
    return _Setup(base, donor, bad, names, metric)


def source_activations(model: Any, setup: _Setup, source: str, rows: int, weights: Tensor | None) -> dict[str, Tensor]:
    """What each hook is patched with: ``[1, ...]`` means over the base walks, or ``[batch, ...]``
    activations of the donor walks."""
    inputs = setup.base.inputs if source == "mean" else setup.donor
    parts: dict[str, list[Tensor]] = {name: [] for name in setup.names}
    with torch.no_grad():
        for start in range(0, inputs.shape[0], rows):
            _, cache = model.run_with_cache(inputs[start : start + rows], names_filter=setup.names)
            for name in setup.names:
                act = cache[name]
                if source == "mean":
                    w = (torch.ones(act.shape[0], dtype=torch.float64) if weights is None
                         else weights[start : start + rows])
                    act = torch.einsum("b,b...->...", w.to(torch.float64), act.to(torch.float64))[None]
                parts[name].append(act)
    if source == "mean":
        total = float(weights.sum()) if weights is not None else float(inputs.shape[0])
        return {name: (sum(p) / total) for name, p in parts.items()}
    return {name: torch.cat(p) for name, p in parts.items()}


def _cell_index(ndim: int, head_axis: int | None, pos_axis: int, head: int | None, pos: int | None) -> tuple:
    """Index of one cell into an activation without its batch axis."""
    index: list[Any] = [slice(None)] * (ndim - 1)
    if head is not None:
        index[head_axis - 1] = head
    if pos is not None:
        index[pos_axis - 1] = pos
    return tuple(index)


def _put(index: tuple, source: Tensor) -> Callable[[Tensor], Any]:
    def patch(act: Tensor) -> None:
        full = (slice(None),) + index
        act[full] = source[full].to(act.dtype)

    return patch


def _cells_of(granularity: str, n_layers: int, n_heads: int, n_pos: int) -> list[tuple[int, int | None, int | None]]:
    """(layer, head, pos) of every cell in output order (None: all of that axis)."""
    heads: list[int | None] = list(range(n_heads)) if "head" in granularity else [None]
    positions: list[int | None] = list(range(n_pos)) if "position" in granularity else [None]
    return [(l, h, p) for l in range(n_layers) for h in heads for p in positions]


def _cell_shape(granularity: str, n_layers: int, n_heads: int, n_pos: int) -> tuple[int, ...]:
    return (n_layers,) + ((n_heads,) if "head" in granularity else ()) + ((n_pos,) if "position" in granularity else ())


def _sweep(model: Any, task: Task, data: Batch, family: str, granularity: str, source: str, metric: str,
           method: str, config: ProbeConfig, graddrop: bool, steps: int = 1) -> Sweep:
    setup = _setup(model, task, data, family, source, metric, config)
    base = setup.base
    n_layers, n_heads = model_dims(model)
    _, head_axis, pos_axis = FAMILIES[family]
    rows = min(config.max_rows, element_rows(model, base.n_pos))
    cost = Cost()
    with torch.no_grad():
        _, probe = model.run_with_cache(base.inputs[:2], names_filter=setup.names)
    shapes = {name: tuple(probe[name].shape[1:]) for name in setup.names}
    n_cell_pos = shapes[setup.names[0]][pos_axis - 1]
    positions = torch.arange(base.n_pos - n_cell_pos, base.n_pos)
    replacement = source_activations(model, setup, source, rows, data.weights)
    cost.forward += 1
    base_metric = unpatched_metric(model, setup, rows)
    cost.forward += 1
    shape = _cell_shape(granularity, n_layers, n_heads, n_cell_pos)
    gd = None
    if method == "exact":
        cells = [Cell(hook=setup.names[l], patch=_put(_cell_index(len(shapes[setup.names[l]]) + 1, head_axis, pos_axis,
                                                                   h, p), replacement[setup.names[l]]))
                 for l, h, p in _cells_of(granularity, n_layers, n_heads, n_cell_pos)]
        bar = tqdm(total=len(cells), desc=f"{family} sweep", leave=False,
                   disable=None if config.progress is None else not config.progress)
        values = run_cells(model, base, base.inputs, cells, setup.bad, rows, bar, metric=setup.metric)
        bar.close()
        cost.forward += len(cells)
        values = values.reshape(*shape, base.n_walks)
    else:
        interpolate = None
        if method == "ig":
            from probes.graph import EMBED, POS_EMBED

            embeddings = _Setup(base, setup.donor, setup.bad, [EMBED, POS_EMBED], setup.kind)
            interpolate = source_activations(model, embeddings, source if source != "clean" else "resample", rows,
                                             data.weights)
            cost.forward += 2  # (the source's embeddings, and the base run's activations)
        estimates, passes = attribute(model, base, setup, family, replacement, method, rows, steps=steps,
                                      embeddings=interpolate)
        cost.forward += passes
        cost.backward += passes
        values = base_metric + _aggregate(estimates, granularity, head_axis is not None)
        if graddrop:
            require(n_layers >= 2, "GradDrop drops one layer's gradient at a time and needs at least 2 layers")
            dropped = []
            for layer in range(n_layers):
                est, passes = attribute(model, base, setup, family, replacement, method, rows, drop=layer)
                cost.forward += passes
                cost.backward += passes
                w = point_weights(data.weights, base.n_walks)
                dropped.append(wmean(w, _aggregate(est, granularity, head_axis is not None).movedim(-1, 0))[0].abs())
            gd = sum(dropped) / (n_layers - 1)
    return Sweep(family, granularity, source, metric, method, base.layout(), positions, data.weights,
                 base_metric, values, cost, gd)


def base_rows(targets: Targets, start: int, rows: int) -> Targets:
    """The predictions of walks ``start .. start + rows`` (labels only; the inputs go to the model)."""
    return replace(targets, inputs=targets.inputs[start : start + rows], labels=targets.labels[start : start + rows],
                   weights=None)


def unpatched_metric(model: Any, setup: _Setup, rows: int) -> Float[Tensor, " batch"]:
    """The metric of every walk of the run the patches go into, unpatched."""
    base = setup.base
    return torch.cat([setup.metric(run_logits(model, base.inputs[s : s + rows])[None], base_rows(base, s, rows), s)[0]
                      for s in range(0, base.n_walks, rows)])


def _aggregate(estimates: Tensor, granularity: str, has_heads: bool) -> Tensor:
    """``[layer, (head,) pos, batch]`` estimates summed to the granularity's cells."""
    if not has_heads:
        return estimates.sum(1) if granularity == "layer" else estimates
    if granularity == "layer":
        return estimates.sum((1, 2))
    if granularity == "head":
        return estimates.sum(2)
    if granularity == "position":
        return estimates.sum(1)
    return estimates


class _Leaves:
    """Forward hooks that add a zero tensor requiring grad to each named activation (so that the
    gradient of the metric with respect to it can be read without cutting the graph upstream), keep
    the activation, and optionally stop the gradient through some hooks (GradDrop)."""

    def __init__(self, names: list[str], dropped: list[str] = ()):
        self.names = list(dict.fromkeys(names))
        self.dropped = list(dropped)
        self.leaves: dict[str, Tensor] = {}
        self.acts: dict[str, Tensor] = {}

    def hooks(self) -> list[tuple[str, Callable]]:
        # (keyed by the name asked for: a TransformerBridge hands its hooks an alias's name)
        def leaf(act: Tensor, hook: Any, name: str) -> Tensor:
            zero = torch.zeros_like(act, requires_grad=True)
            self.leaves[name] = zero
            self.acts[name] = act.detach()
            return act + zero

        def drop(act: Tensor, hook: Any) -> Tensor:
            return act.detach()

        return [(name, partial(leaf, name=name)) for name in self.names] + [(name, drop) for name in self.dropped]


def attribute(model: Any, base: Targets, setup: _Setup, family: str, replacement: dict[str, Tensor], method: str,
              rows: int, drop: int | None = None, steps: int = 1,
              embeddings: dict[str, Tensor] | None = None) -> tuple[Tensor, int]:
    """Attribution-patching estimates ``(a_source - a) . dm/da`` of every head x position cell (every
    position of an activation without heads), ``[layer, (head,) pos, batch]``, at the run ``base``;
    with ``method = "atp*"`` the query-key paths are carried through the softmax exactly. Returns the
    estimates and the forward (= backward) passes spent. ``ig``: the gradient averaged over ``steps`` runs
    whose embeddings move from ``embeddings`` (the source's) towards the base run's."""
    from probes.graph import ATTN_OUT, MLP_OUT, PATTERN, RESID_PRE, inspect_model

    n_layers, n_heads = model_dims(model)
    _, head_axis, pos_axis = FAMILIES[family]
    structure = inspect_model(model, base.inputs) if method == "atp*" else None
    extra: list[str] = []
    if structure is not None:
        extra = [name.format(layer=l) for name in (PATTERN, RESID_PRE) for l in range(n_layers)]
    dropped = []
    if drop is not None:
        have = hook_names(model)
        dropped = [n.format(layer=drop) for n in (ATTN_OUT, MLP_OUT) if n.format(layer=drop) in have]
    out = []
    m = steps if method == "ig" else 1
    for start in range(0, base.n_walks, rows):
        chunk = base_rows(base, start, rows)
        grads: dict[str, Tensor] = {}
        for k in range(m):
            leaves = _Leaves(setup.names + extra, dropped)
            hooks = leaves.hooks()
            if method == "ig":
                hooks = _interpolation(embeddings, k / m, start) + hooks
            with torch.enable_grad():
                logits = model.run_with_hooks(base.inputs[start : start + rows], fwd_hooks=hooks)
                total = setup.metric(logits[None], chunk, start)[0].sum()
                wanted = [n for n in leaves.names if n in leaves.leaves]
                found = torch.autograd.grad(total, [leaves.leaves[n] for n in wanted], allow_unused=True)
            for n, g in zip(wanted, found):
                g = (torch.zeros_like(leaves.acts[n]) if g is None else g).to(torch.float64) / m
                grads[n] = g if n not in grads else grads[n] + g
        acts = leaves.acts
        if method == "ig":  # the deltas are taken at the base run itself
            with torch.no_grad():
                _, cache = model.run_with_cache(base.inputs[start : start + rows], names_filter=setup.names)
            acts = {n: cache[n] for n in setup.names}
        per_layer = []
        for layer, name in enumerate(setup.names):
            act = acts[name].to(torch.float64)
            source = replacement[name]
            source = (source if source.shape[0] == 1 else source[start : start + rows]).to(torch.float64)
            delta = source - act
            est = _contract(delta * grads[name], head_axis, pos_axis)  # [batch, (head,) pos]
            if structure is not None:
                est = est + _qk_correction(structure, leaves.acts, grads, family, layer, delta)
            per_layer.append(est)
        out.append(torch.stack(per_layer))
    # [layer, batch, (head,) pos] -> [layer, (head,) pos, batch]
    return torch.cat(out, dim=1).movedim(1, -1), m


def _interpolation(embeddings: dict[str, Tensor], t: float, start: int) -> list[tuple[str, Callable]]:
    """Hooks that move the embeddings from ``embeddings`` (the source's) a fraction ``t`` towards the run's own."""

    def mix(act: Tensor, hook: Any, name: str) -> Tensor:
        r = embeddings[name]
        r = (r if r.shape[0] == 1 else r[start : start + act.shape[0]]).to(act.dtype)
        return r + t * (act - r)

    return [(name, partial(mix, name=name)) for name in embeddings]


def _contract(product: Tensor, head_axis: int | None, pos_axis: int) -> Tensor:
    """Sum a ``delta * grad`` product over every axis but batch, head and position:
    ``[batch, (head,) pos]``."""
    keep = [0] + ([head_axis] if head_axis is not None else []) + [pos_axis]
    dims = [d for d in range(product.ndim) if d not in keep]
    summed = product.sum(dims) if dims else product
    if head_axis is not None and head_axis > pos_axis:
        summed = summed.transpose(1, 2)
    return summed


def _stream_delta(structure: Any, family: str, layer: int, delta: Tensor) -> Tensor | None:
    """A family's change at every cell as changes of the residual stream: ``[batch, head, pos, d_model]``
    (one "head" for families without heads), positions at their input positions."""
    n_pos = structure.n_pos
    if family == "z":
        per_head = torch.einsum("bphd,hdm->bhpm", delta, structure.weights["W_O"][layer])
    elif family in ("resid_pre", "attn_out", "mlp_out"):
        per_head = delta[:, None]
    else:
        return None
    pad = n_pos - per_head.shape[2]
    if pad:
        per_head = torch.cat([per_head.new_zeros(*per_head.shape[:2], pad, per_head.shape[-1]), per_head], dim=2)
    return per_head


def _qk_correction(structure: Any, acts: dict[str, Tensor], grads: dict[str, Tensor], family: str, layer: int,
                   delta: Tensor) -> Tensor:
    """AtP* minus AtP for every cell of ``family`` at ``layer``: for each head whose queries or keys the cell
    reaches directly (its own, for the q and k families; through the residual stream otherwise), the
    change of that head's pattern computed exactly through its softmax, times ``dm/dpattern``, in place of
    its linearisation. ``[batch, (head,) pos]`` like the AtP estimate."""
    from probes.graph import PATTERN, RESID_PRE, _qk

    n_pos = structure.n_pos
    heads_axis = FAMILIES[family][1] is not None
    if family in ("q", "k"):
        if not math.isfinite(structure.scale[layer]):
            return torch.zeros(())
        resid = acts[RESID_PRE.format(layer=layer)].to(torch.float64)
        q, k = _qk(structure, acts, resid, layer)
        p = acts[PATTERN.format(layer=layer)].to(torch.float64)
        g = grads[PATTERN.format(layer=layer)]
        if family == "k":
            return _key_fix(q, k, delta, p, g, structure.scale[layer])
        return _query_fix(q, k, delta, p, g, structure.scale[layer])
    stream = _stream_delta(structure, family, layer, delta)
    if stream is None:
        return torch.zeros(())
    first = layer if family == "resid_pre" else layer + 1
    # resid_pre.L is layer L's input; every other layer reads the change directly only through a residual stream.
    readers = [r for r in range(first, structure.n_layers) if math.isfinite(structure.scale[r])
               and ((family == "resid_pre" and r == layer) or structure.stream[r])]
    total = torch.zeros(stream.shape[:3], dtype=torch.float64)
    W = structure.weights
    for reader in readers:
        resid = acts[RESID_PRE.format(layer=reader)].to(torch.float64)
        q, k = _qk(structure, acts, resid, reader)
        p = acts[PATTERN.format(layer=reader)].to(torch.float64)
        g = grads[PATTERN.format(layer=reader)]
        rows = q.shape[1]
        for c in range(stream.shape[1]):
            d = stream[:, c]  # [batch, pos, d_model]
            dk = torch.einsum("bpm,hmd->bphd", d, W["W_K"][reader])
            dq = torch.einsum("bpm,hmd->bphd", d[:, n_pos - rows:], W["W_Q"][reader])
            fix = _key_fix(q, k, dk, p, g, structure.scale[reader]).sum(1)  # [batch, pos]
            by_query = _query_fix(q, k, dq, p, g, structure.scale[reader]).sum(1)  # [batch, rows]
            fix[:, n_pos - rows:] += by_query
            total[:, c] += fix
    total = total[:, :, n_pos - delta.shape[FAMILIES[family][2]]:]  # the activation's own positions
    return total if heads_axis else total[:, 0]


def _visible(p: Tensor) -> Tensor:
    """Where each query row of a ``[batch, head, rows, pos]`` pattern may attend (causal rows at the end)."""
    from probes.graph import causal_mask

    return causal_mask(p.shape[2], p.shape[3]).expand_as(p)


def _key_fix(q: Tensor, k: Tensor, dk: Tensor, p: Tensor, g: Tensor, scale: float) -> Tensor:
    """For a change ``dk`` of every key position taken one at a time, the exact change of each query row's
    softmax, times ``g = dm/dpattern``, minus its linearisation: ``[batch, head, pos]``.

    With ``d_ij = q_i . dk_j / scale`` and ``G_i = sum_j g_ij p_ij``, changing key j alone gives the row
    ``p'_ij = p_ij e^d / Z_i``, ``p'_ij' = p_ij' / Z_i`` with ``Z_i = 1 - p_ij + p_ij e^d``, so
    ``sum_j' g_ij' p'_ij' - G_i = (G_i + g_ij p_ij (e^d - 1)) / Z_i - G_i`` (in log space for large d),
    against the linear ``p_ij (g_ij - G_i) d``."""
    mask = _visible(p)
    d = torch.einsum("bqhd,bkhd->bhqk", q, dk) / scale
    d = torch.where(mask, d, torch.zeros_like(d))
    G = (g * p).sum(-1, keepdim=True)
    log_p = torch.where(mask, p.clamp_min(1e-300).log(), torch.zeros_like(p))
    log_z = torch.logaddexp(torch.log1p(-p.clamp(max=1.0 - 1e-16)), log_p + d)  # log Z_i (per column j)
    new_p = torch.exp(log_p + d - log_z)  # p'_ij
    rest = torch.exp(-log_z)  # factor of the other columns
    exact = rest * (G - g * p) + g * new_p - G
    linear = p * (g - G) * d
    return torch.where(mask, exact - linear, torch.zeros_like(d)).sum(2)


def _query_fix(q: Tensor, k: Tensor, dq: Tensor, p: Tensor, g: Tensor, scale: float) -> Tensor:
    """For a change ``dq`` of every query row taken one at a time, the exact change of that row's softmax,
    times ``g``, minus its linearisation: ``[batch, head, rows]``."""
    mask = _visible(p)
    ds = torch.einsum("bqhd,bkhd->bhqk", dq, k) / scale
    ds = torch.where(mask, ds, torch.zeros_like(ds))
    scores = torch.where(mask, p.clamp_min(1e-300).log(), torch.full_like(p, -math.inf))
    new_p = torch.softmax(scores + ds, dim=-1)
    G = (g * p).sum(-1, keepdim=True)
    exact = (g * (new_p - p)).sum(-1)
    linear = (p * (g - G) * ds).sum(-1)
    return exact - linear


def _atp_patching(model: Any, task: Task, data: Batch, config: ProbeConfig, method: str) -> PatchingResult:
    """The attribution-patching version of :func:`_patching` (see :func:`patching_probe`)."""
    from probes.graph import PATTERN, RESID_PRE, inspect_model

    clean = targets_for(model, task, data, config.kind)
    corrupted = clean.with_batch(task, corrupted_walks(task, len(data), config.seed))
    n_layers, n_heads = model_dims(model)
    name = {kind: [HOOKS[kind].format(layer=layer) for layer in range(n_layers)] for kind in config.hooks}
    needed = [n for names in name.values() for n in names]
    require_hooks(model, needed, "attribution patching")
    base = replace(clean, inputs=corrupted.inputs)
    bad = corrupted.labels
    structure = inspect_model(model, base.inputs) if method == "atp*" else None
    extra = [] if structure is None else [PATTERN.format(layer=l) for l in range(n_layers)] + [
        RESID_PRE.format(layer=l) for l in range(n_layers)]
    rows = max(1, element_rows(model, base.n_pos, ELEMENT_BUDGET // 2))
    B, T = base.n_walks, base.n_pred
    positions = {f"resid_pre.{l}": torch.zeros(base.n_pos, B, T, dtype=torch.float64)
                 for l in range(n_layers) if "resid_pre" in config.hooks}
    positions.update({f"v.{l}": torch.zeros(base.n_pos, B, T, dtype=torch.float64)
                      for l in range(n_layers) if "v" in config.hooks})
    heads = {kind: torch.zeros(n_layers, n_heads, B, T, dtype=torch.float64)
             for kind in ("z", "pattern") if kind in config.hooks}
    corr_ld, clean_ld = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    scale_sum = 0.0
    for start in range(0, B, rows):
        stop = min(B, start + rows)
        with torch.no_grad():
            clean_logits, cache = model.run_with_cache(clean.inputs[start:stop], names_filter=needed)
        clean_ld[start:stop] = logit_diff(clean_logits, clean, clean.labels[start:stop], bad[start:stop])
        scale_sum += float(clean.select(clean_logits).abs().sum())
        leaves = _Leaves(needed + extra)
        with torch.enable_grad():
            logits = model.run_with_hooks(base.inputs[start:stop], fwd_hooks=leaves.hooks())
            ld = logit_diff(logits, base, base.labels[start:stop], bad[start:stop])  # [b, T]
            corr_ld[start:stop] = ld.detach()
            wanted = [n for n in leaves.names if n in leaves.leaves]
            for i in range(T):
                grads = torch.autograd.grad(ld[:, i].sum(), [leaves.leaves[n] for n in wanted], allow_unused=True,
                                            retain_graph=i + 1 < T)
                g = {n: (torch.zeros_like(leaves.acts[n]) if x is None else x).to(torch.float64)
                     for n, x in zip(wanted, grads)}
                for kind, names in name.items():
                    for layer, hook in enumerate(names):
                        delta = cache[hook].to(torch.float64) - leaves.acts[hook].to(torch.float64)
                        family = kind
                        _, head_axis, pos_axis = FAMILIES[family]
                        est = _contract(delta * g[hook], head_axis, pos_axis)  # [b, (head,) pos]
                        if structure is not None and kind == "resid_pre":
                            est = est + _qk_correction(structure, leaves.acts, g, family, layer, delta)
                        if kind in ("resid_pre", "v"):
                            est = est.sum(1) if est.ndim == 3 else est  # v: over heads
                            positions[f"{kind}.{layer}"][-est.shape[1]:, start:stop, i] = est.T
                        else:
                            heads[kind][layer, :, start:stop, i] = est.sum(-1).T
    for key in positions:
        positions[key] += corr_ld[None]
    for key in heads:
        heads[key] += corr_ld[None, None]
    groups = _parent_groups(clean)
    only_corrupted, only_clean = corr_ld.clone(), corr_ld.clone()
    first = positions.get("resid_pre.0")
    if first is not None:
        est0 = first - corr_ld[None]
        for mask, preds in groups:
            only_clean[:, preds] += est0[mask][:, :, preds].sum(0)
            only_corrupted[:, preds] += est0[~mask][:, :, preds].sum(0)
    else:
        only_corrupted[:], only_clean[:] = math.nan, math.nan
    return PatchingResult(
        layout=clean.layout(), weights=data.weights, clean=clean_ld, corrupted=corr_ld,
        only_parents_corrupted=only_corrupted, only_parents_clean=only_clean,
        scale=scale_sum / (B * clean.n_pred * clean.n_states) * clean.n_pred, embeddings_by_substitution=False,
        contrast=(clean.inputs != corrupted.inputs).any(0), positions=positions, heads=heads, method=method,
        cost=Cost(forward=2, backward=T))


def cell_faithfulness(model: Any, task: Task, data: Batch, result: Sweep, order: list[int], sizes: list[int],
                      config: ProbeConfig | None = None) -> Float[Tensor, " size"]:
    """Faithfulness of the first ``k`` cells of ``order`` (indices into ``result.effects().flatten()``),
    for each ``k`` in ``sizes``: every other cell of the sweep is patched from its source at once, and the
    metric is reported as a fraction of the way from the run with every cell patched (0) to the unpatched
    run (1). One forward pass per size (and one for every cell patched)."""
    config = config or ProbeConfig()
    with evaluating(model):
        setup = _setup(model, task, data, result.family, result.source, result.metric, config)
        base = setup.base
        rows = min(config.max_rows, element_rows(model, base.n_pos))
        replacement = source_activations(model, setup, result.source, rows, data.weights)
        _, head_axis, pos_axis = FAMILIES[result.family]
        shape = result.effects().shape  # [layer, (head,) (pos,)]
        w = point_weights(data.weights, base.n_walks)

        def run(kept: Tensor) -> float:
            patched = ~kept.reshape(shape)
            hooks = []
            for layer, name in enumerate(setup.names):
                mask = patched[layer]
                hooks.append((name, partial(_write_cells, mask=mask, source=replacement[name],
                                            granularity=result.granularity, head_axis=head_axis, pos_axis=pos_axis)))
            values = []
            for start in range(0, base.n_walks, rows):
                with torch.no_grad():
                    logits = model.run_with_hooks(base.inputs[start : start + rows], fwd_hooks=[
                        (n, partial(f, start=start)) for n, f in hooks])
                values.append(setup.metric(logits[None], base_rows(base, start, rows), start)[0])
            return float(wmean(w, torch.cat(values)[:, None])[0, 0])

        n = int(np.prod(shape))
        every = run(torch.zeros(n, dtype=torch.bool))
        full = float(wmean(w, result.base[:, None])[0, 0])
        out = []
        for k in sizes:
            kept = torch.zeros(n, dtype=torch.bool)
            kept[torch.tensor(order[:k], dtype=torch.long)] = True
            out.append((run(kept) - every) / (full - every) if full != every else math.nan)
        return torch.tensor(out, dtype=torch.float64)


def _write_cells(act: Tensor, hook: Any, mask: Tensor, source: Tensor, granularity: str, head_axis: int | None,
                 pos_axis: int, start: int) -> Tensor:
    """Write ``source`` into the cells of ``act`` where ``mask`` (the layer's cell grid) holds."""
    act = act.clone()
    src = (source if source.shape[0] == 1 else source[start : start + act.shape[0]]).to(act.dtype).expand_as(act)
    index: list[Any] = [slice(None)] * act.ndim
    if granularity == "layer":
        if bool(mask):
            act[:] = src
        return act
    if granularity == "head":
        index[head_axis] = mask
    elif granularity == "position":
        index[pos_axis] = mask
    else:  # head x position: a boolean grid over the two axes, in the activation's order
        grid = mask if head_axis < pos_axis else mask.T
        first = min(head_axis, pos_axis)
        act[(slice(None),) * first + (grid,)] = src[(slice(None),) * first + (grid,)]
        return act
    act[tuple(index)] = src[tuple(index)]
    return act
