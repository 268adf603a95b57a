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
) -> Float[Tensor, "cell batch pred"]:
    """Logit differences (``base.labels`` against ``bad``) of every patched run, stacked
    ``max_rows // batch`` runs per forward pass."""
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
        out.append(logit_diff(logits.reshape(len(chunk), B, *logits.shape[1:]), base, base.labels, bad))
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


def patching_probe(model: Any, task: Task, data: Batch, config: ProbeConfig = ProbeConfig()) -> PatchingResult:
    """Patch clean activations into runs on independent corrupted walks (see the module docstring).

    A pure function of (model, task, data, config): the model's weights and mode are untouched.
    """
    with evaluating(model):
        return _patching(model, task, data, config)


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
