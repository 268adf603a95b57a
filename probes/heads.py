"""Per-head attention roles: which head attends to the previous token, which is an induction head.

For every layer and head the attention rows of the predictions (``blocks.{L}.attn.hook_pattern``, read
through :mod:`probes.targets`, so query-slot and autoregressive models alike) give four scores, each
the mean over predictions and sequences of the attention mass on a set of keys:

* ``previous_token``: the key just before the prediction's position (``t - 1``);
* ``induction``: the keys ``j`` whose previous token equals the current state, ``x_{j-1} = x_c``, for
  ``1 <= j <= c``; ``c`` is the position of the state the prediction continues (its own position for an
  autoregressive model, the last observed state for a query-slot model, whose own slot holds the query
  token). A statistical induction head (Edelman et al. 2024) attends there and reads what followed each
  earlier occurrence of the current state: the in-context bigram counts;
* ``self``: the prediction's own position;
* ``parent``: the prediction's parents (as :mod:`probes.attention` defines them: the last k states for a
  chain of order k, moved with the prediction).

A score is averaged over the predictions where its key set is not empty (no previous token at the first
position; no earlier occurrence of the current state for some induction queries), so a head wired to do
exactly that job scores 1. Beside each score is its **chance level**: the mass the same key set gets
under uniform attention over the keys the prediction can see, averaged the same way. With K states about
a 1/K share of the keys match the current state, so an induction score of 0.40 at K = 3 means little;
compare it with the chance level and with random-initialised models of the same architecture
(:func:`head_table` with baseline results), which attend nearly uniformly.

Intervals are bootstrap intervals over sequences (:mod:`probes.stats`); against random models the
difference's interval resamples the sequences and the random seeds together.

Weights: :func:`composition_scores` gives TransformerLens' Q-, K- and V-composition scores
(``||W_A W_B||_F / (||W_A||_F ||W_B||_F)``, Elhage et al. 2021) between every head and every head of a
later layer, from the weight views ``W_Q W_K W_V W_O`` that both the TransformerBridge and the models of
:mod:`rwinterp.model` expose. A layer-1 induction head reads the layer-0 previous-token head through its
keys: high K-composition.

Roles in words (:meth:`HeadTable.describe`): a head is named for a score when (a) it is at least
:data:`ROLE_LIFT` = 0.3 of the way from the chance level to 1, ``(score - chance) / (1 - chance) >= 0.3``,
and (b) its interval lies wholly above the random models' interval (without random models: above the
chance level's interval). Both are rules of thumb: (a) asks for an effect of practical size, (b) that it
is not sampling noise or what any untrained model of this architecture does.

Over training, :func:`heads_over_training` scores a sequence of checkpoints, with the test loss beside
the reference losses of an in-context chain (:func:`rwinterp.icl.reference_losses`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor
from transformer_lens.utilities.statistics import derive_generator

from probes.config import ProbeConfig
from probes.stats import bootstrap_interval, bootstrap_weights, point_weights, wmean
from probes.targets import (Layout, Targets, evaluating, head_name, model_dims, require_hooks, run_logits,
                            targets_for)
from rwinterp.errors import require
from rwinterp.tasks import Batch, Task

PATTERN = "blocks.{layer}.attn.hook_pattern"
#: The per-head scores, in report order.
SCORES = ("previous_token", "induction", "self", "parent")
#: How they are named in words.
ROLE_NAMES = {"previous_token": "previous-token", "induction": "induction", "self": "self", "parent": "parent"}
#: A head is named for a score at least this share of the way from the chance level to 1 (module docstring).
ROLE_LIFT = 0.3


# ------------------------------------------------------------------------------ the pure part
def score_masks(inputs: Int[Tensor, "batch pos"], layout: Layout) -> dict[str, Bool[Tensor, "batch pred pos"]]:
    """For every prediction of ``layout`` on ``inputs``, the keys each score counts (see the module docstring).

    ``previous_token``, ``self`` and ``parent`` are the same for every sequence (expanded, not copied);
    ``induction`` depends on the tokens.
    """
    B, N = inputs.shape
    source = layout.source
    pos = torch.arange(N)
    current = source - 1 if layout.kind == "query" else source  # the state each prediction continues
    before = torch.cat([inputs.new_full((B, 1), -1), inputs[:, :-1]], dim=1)  # before[b, j] = x_{j-1}
    induction = (before[:, None, :] == inputs[:, current][:, :, None]) & (pos <= current[:, None])[None]
    shared = {"previous_token": pos[None, :] == (source - 1)[:, None], "self": pos[None, :] == source[:, None],
              "parent": layout.parents}
    masks = {name: (mask & layout.visible)[None].expand(B, -1, -1) for name, mask in shared.items()}
    masks["induction"] = induction & layout.visible[None]
    return {name: masks[name] for name in SCORES}


def pattern_scores(
    rows: Float[Tensor, "*head batch pred pos"],
    masks: Mapping[str, Bool[Tensor, "batch pred pos"]],
    visible: Bool[Tensor, "pred pos"],
) -> tuple[dict[str, Float[Tensor, "*head batch"]], dict[str, Float[Tensor, " batch"]],
           dict[str, Float[Tensor, " batch"]]]:
    """Per-sequence sums of each score from attention rows (any leading head axes), float64.

    Returns ``(mass, count, chance)``: ``mass[s][..., b]`` sums the attention on the keys of score ``s``
    over the predictions of sequence b where that key set is not empty, ``count[s][b]`` counts those
    predictions, ``chance[s][b]`` sums the share of visible keys in the set (uniform attention's mass).
    A score is ``sum_b w_b mass_b / sum_b w_b count_b`` for sequence weights w.
    """
    lead, (B, P, N) = rows.shape[:-3], rows.shape[-3:]
    flat = rows.to(torch.float64).reshape(-1, B, P * N).transpose(0, 1)  # [batch, heads, pred * pos]
    n_visible = visible.sum(-1).to(torch.float64)  # [pred]
    mass, count, chance = {}, {}, {}
    for name, mask in masks.items():
        keys = mask.to(torch.float64)
        n_keys = keys.sum(-1)  # [batch, pred]; a prediction without keys adds nothing below
        on_keys = torch.bmm(flat, keys.reshape(B, P * N, 1))[..., 0]  # [batch, heads]
        mass[name] = on_keys.T.reshape(*lead, B)
        count[name] = (n_keys > 0).sum(-1).to(torch.float64)
        chance[name] = (n_keys / n_visible).sum(-1)
    return mass, count, chance


# ------------------------------------------------------------------------------ probe result
@dataclass
class HeadResult:
    """Per-sequence sums of the per-head scores (see :func:`pattern_scores`), and what they describe.

    ``mass[s]``: ``[layer, head, batch]``; ``count[s]``, ``chance[s]``: ``[batch]``. ``same_as`` names a
    score whose key set is that of another one for every prediction (``{"parent": "self"}`` for an
    autoregressive model of a first-order chain, whose parent is its own position): it is kept, but not
    named as a role of its own.
    """

    layout: Layout
    weights: Float[Tensor, " batch"] | None
    inputs: Int[Tensor, "batch pos"]
    mass: dict[str, Float[Tensor, "layer head batch"]]
    count: dict[str, Float[Tensor, " batch"]]
    chance: dict[str, Float[Tensor, " batch"]]
    same_as: dict[str, str] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return int(self.mass[SCORES[0]].shape[0])

    @property
    def n_heads(self) -> int:
        return int(self.mass[SCORES[0]].shape[1])

    @property
    def n_walks(self) -> int:
        return int(self.inputs.shape[0])

    def summary(self, w: Float[Tensor, "draws batch"]) -> dict[str, Tensor]:
        """``"L{l}H{h}.{score}"`` and ``"chance.{score}"`` for every weight row (NaN where no prediction has
        the score defined)."""
        out = {}
        for name in SCORES:
            den = w @ self.count[name]  # [draws]
            num = torch.einsum("rb,lhb->rlh", w, self.mass[name])
            value = num / den[:, None, None]
            for l in range(self.n_layers):
                for h in range(self.n_heads):
                    out[f"{head_name(l, h)}.{name}"] = value[:, l, h]
            out[f"chance.{name}"] = (w @ self.chance[name]) / den
        return out

    def scores(self) -> dict[str, float]:
        return {k: float(v[0]) for k, v in self.summary(point_weights(self.weights, self.n_walks)).items()}

    def table(self, name: str) -> Float[Tensor, "layer head"]:
        """One score of every head, ``[layer, head]`` (point estimates)."""
        s = self.scores()
        return torch.tensor([[s[f"{head_name(l, h)}.{name}"] for h in range(self.n_heads)]
                             for l in range(self.n_layers)], dtype=torch.float64)


def head_probe(model: Any, task: Task, data: Batch, config: ProbeConfig = ProbeConfig()) -> HeadResult:
    """The per-head scores of ``model`` on ``data`` (see the module docstring), from its hooks alone.

    A pure function of (model, task, data, config): the model's weights and mode are untouched.
    """
    with evaluating(model):
        targets = targets_for(model, task, data, config.kind)
        return _head_result(model, targets, data.weights)[0]


def _head_result(model: Any, targets: Targets, weights: Tensor | None) -> tuple[HeadResult, Tensor]:
    """Every head's scores on ``targets``, and the logits of the same forward pass."""
    n_layers, _ = model_dims(model)
    names = [PATTERN.format(layer=l) for l in range(n_layers)]
    require_hooks(model, names, "per-head")
    with torch.no_grad():
        logits, cache = model.run_with_cache(targets.inputs, names_filter=names)
    rows = torch.stack([_rows(cache[name], targets) for name in names])  # [L, B, H, pred, pos]
    rows = rows.transpose(1, 2)  # [L, H, B, pred, pos]
    masks = score_masks(targets.inputs, targets.layout())
    mass, count, chance = pattern_scores(rows, masks, targets.visible)
    same_as = {}
    for name in ("parent",):
        for other in ("self", "previous_token"):
            if torch.equal(masks[name][0], masks[other][0]):
                same_as[name] = other
                break
    return HeadResult(layout=targets.layout(), weights=weights, inputs=targets.inputs, mass=mass, count=count,
                      chance=chance, same_as=same_as), logits


def _rows(pattern: Float[Tensor, "batch head q pos"], targets: Targets) -> Float[Tensor, "batch head pred pos"]:
    """Each prediction's attention row, from a ``hook_pattern`` activation."""
    return pattern[:, :, targets.query_index(pattern.shape[2]), :]


# ------------------------------------------------------------------------------ intervals, random models
@dataclass
class HeadTable:
    """Every head's scores with intervals, their chance levels and, against random-initialised models,
    the random models' scores and the differences (trained - random), with intervals.

    Tensors are ``[layer, head]`` (intervals ``[layer, head, 2]``), one per score of :data:`SCORES`;
    ``random`` and ``difference`` are ``None`` without random models. Intervals are NaN without
    bootstrap resamples.
    """

    n_layers: int
    n_heads: int
    value: dict[str, Tensor]
    interval: dict[str, Tensor]
    chance: dict[str, float]
    chance_interval: dict[str, tuple[float, float]]
    same_as: dict[str, str]
    random: Optional[dict[str, Tensor]] = None
    random_interval: Optional[dict[str, Tensor]] = None
    difference: Optional[dict[str, Tensor]] = None
    difference_interval: Optional[dict[str, Tensor]] = None
    n_random: int = 0

    def heads(self) -> list[tuple[int, int]]:
        return [(l, h) for l in range(self.n_layers) for h in range(self.n_heads)]

    def lift(self, name: str) -> Tensor:
        """``(score - chance) / (1 - chance)``: 0 at the chance level, 1 for a perfect head."""
        c = self.chance[name]
        return (self.value[name] - c) / (1 - c) if c < 1 else torch.full_like(self.value[name], math.nan)

    def roles(self, layer: int, head: int) -> list[str]:
        """The scores the head is named for (module docstring), strongest first (by lift)."""
        named = []
        for name in SCORES:
            if name in self.same_as:
                continue
            lift = float(self.lift(name)[layer, head])
            low = float(self.interval[name][layer, head, 0])
            if self.random_interval is not None:
                bar = float(self.random_interval[name][layer, head, 1])
            else:
                bar = self.chance_interval[name][1]
            bar = bar if math.isfinite(bar) else self.chance[name]
            low = low if math.isfinite(low) else float(self.value[name][layer, head])
            if math.isfinite(lift) and lift >= ROLE_LIFT and low > bar:
                named.append((lift, name))
        return [name for _, name in sorted(named, reverse=True)]

    def _phrase(self, name: str, layer: int, head: int) -> str:
        v = float(self.value[name][layer, head])
        lo, hi = (float(x) for x in self.interval[name][layer, head])
        text = f"{ROLE_NAMES[name]} {v:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if math.isfinite(lo) else "")
        extra = []
        if self.random is not None:
            extra.append(f"random {float(self.random[name][layer, head]):.2f}")
        extra.append(f"chance {self.chance[name]:.2f}")
        return text + f" ({', '.join(extra)})"

    def describe(self, ablation: Optional[Mapping[str, Any]] = None) -> str:
        """One line naming each head's role, e.g. ``L0H0 previous-token 0.97 [0.96, 0.98] (random 0.06, chance
        0.06); L1H0 induction 0.91 [0.90, 0.92] (random 0.40, chance 0.35)``. ``ablation`` (optional) maps
        ``"L1H0"`` to the loss increase (nats) of ablating that head, a number or ``(value, low, high)``."""
        parts = []
        for l, h in self.heads():
            label = head_name(l, h)
            roles = self.roles(l, h)
            if roles:
                text = f"{label} " + "; also ".join(self._phrase(name, l, h) for name in roles)
            else:
                best = max((n for n in SCORES if n not in self.same_as),
                           key=lambda n: float(torch.nan_to_num(self.lift(n)[l, h], nan=-math.inf)))
                text = f"{label} no clear role (highest: {self._phrase(best, l, h)})"
            cost = None if ablation is None else ablation.get(label)
            if cost is not None:
                value, *ci = cost if isinstance(cost, (tuple, list)) else (cost,)
                text += f"; ablating {label} costs {float(value):.2f} nats" + (
                    f" [{float(ci[0]):.2f}, {float(ci[1]):.2f}]" if len(ci) == 2 else "")
            parts.append(text)
        return "; ".join(parts)

    def to_json(self, ablation: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
        """Per head ``L{l}H{h}``: each score, its interval (``{score}_interval``), with random models the
        random mean and the difference (``{score}_random``, ``{score}_difference`` and their intervals),
        the named ``roles``, and ``ablation_loss_increase`` (``None`` unless given); under ``chance``, the
        chance levels."""
        def pair(t: Tensor) -> list[float]:
            return [float(t[0]), float(t[1])]

        out: dict[str, Any] = {}
        for l, h in self.heads():
            label = head_name(l, h)
            entry: dict[str, Any] = {}
            for name in SCORES:
                entry[name] = float(self.value[name][l, h])
                entry[f"{name}_interval"] = pair(self.interval[name][l, h])
                if self.random is not None:
                    entry[f"{name}_random"] = float(self.random[name][l, h])
                    entry[f"{name}_random_interval"] = pair(self.random_interval[name][l, h])
                    entry[f"{name}_difference"] = float(self.difference[name][l, h])
                    entry[f"{name}_difference_interval"] = pair(self.difference_interval[name][l, h])
            entry["roles"] = self.roles(l, h)
            cost = None if ablation is None else ablation.get(label)
            entry["ablation_loss_increase"] = (None if cost is None else
                                               float(cost[0] if isinstance(cost, (tuple, list)) else cost))
            out[label] = entry
        out["chance"] = {name: self.chance[name] for name in SCORES}
        out["chance_interval"] = {name: list(self.chance_interval[name]) for name in SCORES}
        return out


def head_table(trained: HeadResult, baselines: Sequence[HeadResult] = (),
               config: ProbeConfig = ProbeConfig()) -> HeadTable:
    """Scores, intervals and chance levels of ``trained``; with ``baselines`` (results of random-initialised
    models on the same sequences), their mean and the difference trained - random.

    The difference's interval comes from one bootstrap over the sequences (the same resample for the
    trained and the random models: a paired comparison) and over the random seeds together; the random
    models' interval, likewise, resamples both.
    """
    for base in baselines:
        require(base.inputs.shape == trained.inputs.shape and torch.equal(base.inputs, trained.inputs),
                "a random baseline must be probed on the same sequences as the trained model")
        require((base.n_layers, base.n_heads) == (trained.n_layers, trained.n_heads),
                "a random baseline must have the trained model's layers and heads")
    L, H = trained.n_layers, trained.n_heads
    point = trained.summary(point_weights(trained.weights, trained.n_walks))
    draws = None
    if config.bootstrap and trained.weights is None:
        w = bootstrap_weights(trained.weights, trained.n_walks, config.bootstrap, config.seed)
        draws = trained.summary(w)

    def grid(values: dict[str, Tensor], name: str, row: int = 0) -> Tensor:
        return torch.tensor([[float(values[f"{head_name(l, h)}.{name}"][row]) for h in range(H)]
                             for l in range(L)], dtype=torch.float64)

    def intervals(name: str, sample: Optional[dict[str, Tensor]], centre: Tensor) -> Tensor:
        out = torch.full((L, H, 2), math.nan, dtype=torch.float64)
        if sample is not None:
            for l in range(L):
                for h in range(H):
                    out[l, h] = torch.tensor(bootstrap_interval(sample[f"{head_name(l, h)}.{name}"],
                                                                float(centre[l, h]), config.confidence))
        return out

    value = {n: grid(point, n) for n in SCORES}
    table = HeadTable(
        n_layers=L, n_heads=H, value=value,
        interval={n: intervals(n, draws, value[n]) for n in SCORES},
        chance={n: float(point[f"chance.{n}"][0]) for n in SCORES},
        chance_interval={n: (bootstrap_interval(draws[f"chance.{n}"], float(point[f"chance.{n}"][0]),
                                                config.confidence) if draws is not None else (math.nan, math.nan))
                         for n in SCORES},
        same_as=dict(trained.same_as))
    if not baselines:
        return table
    S = len(baselines)
    base_points = [b.summary(point_weights(b.weights, b.n_walks)) for b in baselines]
    table.n_random = S
    table.random = {n: torch.stack([grid(p, n) for p in base_points]).mean(0) for n in SCORES}
    table.difference = {n: value[n] - table.random[n] for n in SCORES}
    table.random_interval = {n: torch.full((L, H, 2), math.nan, dtype=torch.float64) for n in SCORES}
    table.difference_interval = {n: torch.full((L, H, 2), math.nan, dtype=torch.float64) for n in SCORES}
    if draws is None:
        return table
    base_draws = [b.summary(w) for b in baselines]
    gen = derive_generator(config.seed, "head-seed-bootstrap")
    pick = torch.randint(0, S, (config.bootstrap, S), generator=gen)
    seed_w = torch.zeros(config.bootstrap, S, dtype=torch.float64).scatter_add_(
        1, pick, torch.ones(config.bootstrap, S, dtype=torch.float64))
    seed_w = seed_w / seed_w.sum(1, keepdim=True)
    for n in SCORES:
        for l in range(L):
            for h in range(H):
                key = f"{head_name(l, h)}.{n}"
                rand = (torch.stack([d[key] for d in base_draws], 1) * seed_w).sum(1)  # [draws]
                table.random_interval[n][l, h] = torch.tensor(bootstrap_interval(
                    rand, float(table.random[n][l, h]), config.confidence))
                table.difference_interval[n][l, h] = torch.tensor(bootstrap_interval(
                    draws[key] - rand, float(table.difference[n][l, h]), config.confidence))
    return table


def heads_against_random(model: Any, task: Task, data: Batch, seeds: int | Sequence[int] = 5,
                         config: ProbeConfig = ProbeConfig(), baselines: Optional[Sequence[Any]] = None) -> HeadTable:
    """:func:`head_table` of ``model`` against random-initialised models of the same architecture
    (:func:`probes.scoring.random_like`, or the given ``baselines``), all on ``data``: the per-head probe
    alone, without the rest of the scorecard."""
    from probes.scoring import baseline_seeds, random_like

    if baselines is None:
        seed_list = baseline_seeds(model, seeds) if isinstance(seeds, int) else list(seeds)
        require(len(seed_list) >= 1, "a random baseline needs at least one seed")
        baselines = [random_like(model, s) for s in seed_list]
    trained = head_probe(model, task, data, config)
    config = replace(config, kind=trained.layout.kind)
    return head_table(trained, [head_probe(m, task, data, config) for m in baselines], config)


# ------------------------------------------------------------------------------ weights
@dataclass
class CompositionResult:
    """TransformerLens composition scores between every head (first two axes) and every head of a later
    layer (last two axes), ``[layer, head, layer, head]``; 0 where the second head is not in a later layer.

    ``Q``: the first head's OV output read by the second head's queries; ``K``: by its keys; ``V``: by its
    values. A random matrix pair scores about ``1 / sqrt(rank)``; compare with random models."""

    Q: Float[Tensor, "layer head layer2 head2"]
    K: Float[Tensor, "layer head layer2 head2"]
    V: Float[Tensor, "layer head layer2 head2"]

    def flat(self) -> dict[str, float]:
        """``"{mode}.L{l}H{h}->L{l2}H{h2}"`` for every pair with ``l < l2``."""
        L, H = self.K.shape[:2]
        return {f"{mode}.{head_name(a, i)}->{head_name(b, j)}": float(getattr(self, mode)[a, i, b, j])
                for mode in ("Q", "K", "V") for a in range(L) for i in range(H)
                for b in range(a + 1, L) for j in range(H)}


def composition_scores(model: Any) -> Optional[CompositionResult]:
    """Q-, K- and V-composition of every pair of heads in different layers, from ``model.W_Q/W_K/W_V/W_O``
    (TransformerLens' ``utilities.composition_scores`` on ``FactoredMatrix`` views, as
    ``TransformerBridge.all_composition_scores`` computes them, for any model with those weight views).
    ``None`` for a model without them or with one layer."""
    from transformer_lens import FactoredMatrix
    from transformer_lens.utilities import composition_scores as tl_composition

    views = {}
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        try:
            views[name] = getattr(model, name)
        except Exception:  # a model without the view (or whose view refuses its configuration)
            return None
        if not (isinstance(views[name], Tensor) and views[name].ndim == 4):
            return None
    if views["W_Q"].shape[0] < 2:
        return None
    W_Q, W_K, W_V, W_O = (views[n].detach().to(torch.float64) for n in ("W_Q", "W_K", "W_V", "W_O"))
    left = FactoredMatrix(W_V, W_O)
    rights = {"Q": FactoredMatrix(W_Q, W_K.transpose(-2, -1)),
              "K": FactoredMatrix(W_Q, W_K.transpose(-2, -1)).T, "V": left}
    L = W_Q.shape[0]
    later = torch.arange(L)[:, None, None, None] < torch.arange(L)[None, None, :, None]
    out = {}
    for mode, right in rights.items():
        scores = tl_composition(left, right, broadcast_dims=True)
        out[mode] = torch.where(later, scores, torch.zeros_like(scores))
    return CompositionResult(**out)


# ------------------------------------------------------------------------------ over training
def next_token_loss(model: Any, task: Task, data: Batch, kind: Optional[str] = None) -> float:
    """Mean next-token cross-entropy (nats) of the model's outputs as logits: over every position
    ``t = 0 .. N-2`` of every sequence for an autoregressive model (as
    :func:`rwinterp.icl.reference_losses` averages), at the query slot for a query-slot model."""
    with evaluating(model):
        targets = targets_for(model, task, data, kind)
        return _loss_of(run_logits(model, targets.inputs), task, targets, data)


def _loss_of(logits: Float[Tensor, "batch lpos vocab"], task: Task, targets: Targets, data: Batch) -> float:
    """:func:`next_token_loss` from the model's logits on ``targets.inputs``."""
    logits = logits.to(torch.float64)
    K = task.n_states
    if targets.kind == "autoregressive":
        scores, labels = logits[:, : task.seq_len - 1, :K], targets.inputs[:, 1:]
    else:
        scores, labels = targets.select(logits), targets.labels
    nll = -scores.log_softmax(-1).gather(-1, labels[..., None])[..., 0]  # [batch, pred]
    return float(wmean(point_weights(data.weights, len(data)), nll.mean(-1))[0])


@dataclass
class TrainingCurve:
    """Scores of a model's checkpoints: ``steps`` ``[S]``, the test loss ``[S]``, the reference losses
    (``{"uniform", ...}``, nats, on the same test data), and every head's scores ``[S, layer, head]`` for
    each score of :data:`SCORES`, with the chance levels (the same at every step: they depend on the data)."""

    steps: list[int]
    test_loss: Float[Tensor, " step"]
    references: dict[str, float]
    scores: dict[str, Float[Tensor, "step layer head"]]
    chance: dict[str, float]

    def rise_step(self, name: str = "induction", layer: int = -1, head: Optional[int] = None) -> Optional[int]:
        """The first step at which a head's score is at least halfway from its first value to its last
        (``head=None``: the head of ``layer`` whose score rises most); ``None`` if it does not rise."""
        s = self.scores[name][:, layer]
        if head is None:
            head = int((s[-1] - s[0]).argmax())
        s = s[:, head]
        if not float(s[-1]) > float(s[0]):
            return None
        half = float(s[0] + s[-1]) / 2
        return self.steps[int(torch.nonzero(s >= half)[0])]


def heads_over_training(checkpoints: Iterable[tuple[int, Any]], task: Task, data: Batch,
                        config: ProbeConfig = ProbeConfig()) -> TrainingCurve:
    """Per-head scores and test loss at every ``(step, model)`` checkpoint, on the same test data.

    The reference losses are those of :func:`rwinterp.icl.reference_losses` for an in-context chain (over
    the positions the test loss covers), ``{"uniform": ln K}`` for any other task.
    """
    from rwinterp.icl import InContextChain, reference_losses

    steps, losses, per = [], [], {n: [] for n in SCORES}
    chance: dict[str, float] = {}
    kind = config.kind
    for step, model in checkpoints:
        with evaluating(model):
            targets = targets_for(model, task, data, kind)
            kind = targets.kind
            result, logits = _head_result(model, targets, data.weights)  # (one forward pass for both)
        losses.append(_loss_of(logits, task, targets, data))
        steps.append(int(step))
        for n in SCORES:
            per[n].append(result.table(n))
        chance = {n: v for n, v in ((k.split(".", 1)[1], v) for k, v in result.scores().items()
                                    if k.startswith("chance."))}
    require(len(steps) >= 1, "no checkpoints to probe")
    if isinstance(task, InContextChain) and data.states is not None:
        references = reference_losses(task, data.states, last_only=kind == "query")
    else:
        references = {"uniform": math.log(task.n_states)}
    return TrainingCurve(steps=steps, test_loss=torch.tensor(losses, dtype=torch.float64), references=references,
                         scores={n: torch.stack(v) for n, v in per.items()}, chance=chance)
