"""One call runs every probe; comparison against random-initialised models and between runs.

:func:`scorecard` runs the attention, patching, transition and per-head probes on one model and
returns a :class:`Scorecard`: the model's accuracy beside the Bayes-optimal accuracy and every
interpretability score, each with a bootstrap confidence interval over the test walks, and each
head's role in words (:mod:`probes.heads`).

:func:`compare_to_random` puts a trained model next to random-initialised models of the same
architecture (several seeds; mean, standard deviation and a bootstrap interval of the mean over
seeds), and :func:`compare` puts any two scorecards side by side.

What makes the random baseline fair (see :func:`random_like`)
--------------------------------------------------------------
* Same architecture and configuration as the trained run, only the seed (and, for a zero-
  initialised run, the initialisation) changed; probed on the *same* test walks against the
  *same* corrupted walks with the same probe settings, so every difference is the weights'.
* A zero-initialised run has no random counterpart at its own initialisation: the zero model
  outputs 0 for every walk and every normalised score is undefined. Its baseline is drawn from
  the Gaussian initialisation the configuration itself defines (``init = "gaussian"`` with the
  config's ``init_sigma``, 0.01 by default: the paper's random-initialisation runs), i.e. the
  model gradient descent would have started from had the run been randomly initialised. The
  scale is deliberately *not* matched to the trained weights: their size (for example the large
  ``u`` that makes attention sharp) is itself a product of training.
* With the paper's large positional embeddings (squared norm M/2), even sigma = 0.01 gives
  attention logits of standard deviation ``sigma * M / 2`` (5 for M = 1000): a random model
  attends sharply to one arbitrary position. That is what this architecture is at random
  initialisation, so the baseline keeps it; with ``normalize_tokens`` attention is near uniform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Sequence

import torch
from tqdm.auto import tqdm

from probes.ablation import head_ablation
from probes.attention import AttentionResult, attention_probe
from probes.config import ProbeConfig
from probes.heads import CompositionResult, HeadResult, HeadTable, composition_scores, head_probe, head_table
from probes.patching import PatchingResult, patching_probe
from probes.stats import Estimate, bootstrap_interval, bootstrap_weights, point_weights, wmean
from probes.targets import Targets, evaluating, run_logits, targets_for
from probes.transition import TransitionResult, transition_of, transition_probe
from rwinterp.errors import require
from rwinterp.metrics import predict
from rwinterp.tasks import Batch, Task

#: The headline scores, in report order (flat keys; see :meth:`Scorecard.flat`).
HEADLINE = (
    "accuracy", "bayes_accuracy", "parent_attention", "parent_argmax_rate",
    "attention.uniformity", "attention.value_weighted_parent_share", "attention.gradient_parent_share",
    "patching.parent_effect", "patching.localization", "patching.necessity", "patching.sufficiency",
    "attribution_patching.parent_share", "transition.distance", "transition.cosine", "transition.argmax_agreement",
    "transition.r2", "transition.ones_cosine",
)

#: What each headline score means, for the report.
MEANING = {
    "accuracy": "share of test predictions that are correct (a model that predicts at every position: all of them)",
    "bayes_accuracy": "accuracy of the best possible predictor",
    "parent_attention": "mean attention on the parent position(s)",
    "parent_argmax_rate": "how often the most-attended position is a parent",
    "attention.uniformity": "exp(attention entropy) / visible positions (1 = evenly spread)",
    "attention.value_weighted_parent_share": "share of attention x value norm on the parents",
    "attention.gradient_parent_share": "share of |gradient x input| on the parents",
    "patching.parent_effect": "output recovered by patching the parent alone (1 = all)",
    "attribution_patching.parent_share": "share of the attribution-patching estimate of the effect at the parents",
    "patching.localization": "share of all patching effect that sits at the parents",
    "patching.necessity": "output lost by corrupting only the parents (1 = all)",
    "patching.sufficiency": "output kept when all but the parents is corrupted (1 = all)",
    "transition.distance": "paper's distance between V and Pi^T (0 = same direction)",
    "transition.cosine": "cosine similarity of V and Pi^T",
    "transition.argmax_agreement": "states whose top score is a most likely next state",
    "transition.r2": "R^2 of the fit V ~ a Pi^T + b",
    "transition.ones_cosine": "cosine of V with the all-ones matrix (1 = Theorem 4.1)",
}

#: Which way each headline score moves when a model learns the task: +1 higher, -1 lower, 0 neither
#: (``transition.ones_cosine`` is 1 at the symmetric fixed point of Theorem 4.1, a model that failed).
LEARNED = {
    "accuracy": 1, "bayes_accuracy": 0, "parent_attention": 1, "parent_argmax_rate": 1,
    "attention.uniformity": -1, "attention.value_weighted_parent_share": 1, "attention.gradient_parent_share": 1,
    "patching.parent_effect": 1, "patching.localization": 1, "patching.necessity": 1, "patching.sufficiency": 1,
    "attribution_patching.parent_share": 1, "transition.distance": -1, "transition.cosine": 1,
    "transition.argmax_agreement": 1, "transition.r2": 1, "transition.ones_cosine": 0,
}


def direction(key: str) -> str:
    """" ↑" or " ↓": the way a score moves when a model learns the task (:data:`LEARNED`); "" for neither."""
    return {1: " ↑", -1: " ↓"}.get(LEARNED.get(key, 0), "")


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": x}`` to ``{"a": {"b.c": x}}`` (split at the first dot only)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        head, _, rest = key.partition(".")
        if rest:
            out.setdefault(head, {})[rest] = value
        else:
            out[key] = value
    return out


def bayes_accuracy(task: Task, targets: Targets) -> float:
    """Accuracy of the Bayes-optimal predictor: the task's own for query-slot models; for
    autoregressive models, the mean over the walks and predictions of ``max_y P(y | s_1 .. s_t)``
    (the Bayes predictor's expected accuracy on these walks, from ``task.predictive``)."""
    if targets.kind == "query":
        return float(task.bayes_accuracy())
    w = point_weights(targets.weights, targets.n_walks)
    best = task.predictive(targets.inputs)[:, targets.source].amax(-1)  # [batch, pred]
    return float(wmean(w, best.mean(-1))[0])


@dataclass
class Scorecard:
    """Every probe's result on one model, and the scores with their intervals."""

    task: dict[str, Any]
    model: str
    kind: str
    n_walks: int
    bayes_accuracy: float
    hits: torch.Tensor  # [batch, pred] correct predictions
    weights: Optional[torch.Tensor]
    attention: AttentionResult
    patching: PatchingResult
    transition: Optional[TransitionResult]
    config: ProbeConfig
    sample_name: str = "walk"
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: Per-head attention scores (:mod:`probes.heads`) and the weights' composition scores (two layers or more).
    heads: Optional[HeadResult] = None
    composition: Optional[CompositionResult] = None
    #: The loss increase (nats) of ablating each head, ``{"L1H0": value or (value, low, high)}``, where a causal
    #: per-head probe has measured it: shown in :meth:`head_table`'s words and as ``ablation_loss_increase``
    #: in :meth:`scores` (``None`` until then).
    head_ablation: Optional[dict[str, Any]] = None
    #: The embeddings sweep by attribution patching (on the first ``config.gradient_walks`` walks).
    attribution: Optional[PatchingResult] = None
    #: The last :meth:`head_table` (its heads, its baselines' heads, the table): a report asks for it several times.
    _table: Optional[tuple] = field(default=None, init=False, repr=False, compare=False)

    def _summary(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"accuracy": wmean(w, self.hits.mean(-1))}
        att = self.attention.summary(w)
        out["parent_attention"] = att["parent_attention"]
        out["parent_argmax_rate"] = att["parent_argmax_rate"]
        out.update({f"attention.{k}": v for k, v in att.items() if k not in out})
        out.update({f"patching.{k}": v for k, v in self.patching.summary(w).items()})
        if self.heads is not None:
            out.update({f"heads.{k}": v for k, v in self.heads.summary(w).items()})
        if self.attribution is not None:  # (the AtP sweep covers the first walks only)
            atp = self.attribution.summary(w[:, : self.attribution.n_walks])
            out["attribution_patching.parent_effect"] = atp["parent_effect"]
            out["attribution_patching.parent_share"] = atp["localization"]
        return out

    def flat(self) -> dict[str, float]:
        """Every score under a dotted key (``patching.parent_effect`` ...)."""
        w = point_weights(self.weights, self.n_walks)
        out = {k: float(v[0]) for k, v in self._summary(w).items()}
        out["bayes_accuracy"] = self.bayes_accuracy
        out["patching.contrast_outside_parents"] = self.patching.contrast_outside_parents
        if self.transition is not None:
            out.update({f"transition.{k}": v for k, v in self.transition.scores().items()})
        else:  # not a first-order chain: the headline keys are there, undefined
            out.update({k: math.nan for k in HEADLINE if k.startswith("transition.")})
        if self.composition is not None:
            out.update({f"composition.{k}": v for k, v in self.composition.flat().items()})
        return out

    def scores(self) -> dict[str, Any]:
        """The flat scores nested at the first dot: ``{"patching": {"parent_effect": ...}}``; per head,
        ``{"heads": {"L0H0": {"previous_token": ..., "previous_token_interval": [lo, hi], ...,
        "ablation_loss_increase": ...}, "chance": {...}}}`` (:meth:`probes.heads.HeadTable.to_json`) and
        ``{"composition": {"K": {"L0H0->L1H0": ...}}}``."""
        return nest_scores(self.flat(), self.head_table(), self.head_ablation)

    def head_table(self, baselines: Sequence["Scorecard"] = ()) -> Optional[HeadTable]:
        """Every head's scores with intervals and chance levels (against ``baselines``' heads: random models)."""
        if self.heads is None:
            return None
        others = [b.heads for b in baselines if b.heads is not None]
        last = self._table
        if not (last and last[0] is self.heads and len(last[1]) == len(others)
                and all(a is b for a, b in zip(last[1], others))):
            self._table = last = (self.heads, others, head_table(self.heads, others, self.config))
        return last[2]

    def headline(self) -> dict[str, float]:
        flat = self.flat()
        return {k: flat.get(k, math.nan) for k in HEADLINE}

    def findings(self, baselines: Sequence["Scorecard"] = ()) -> list[str]:
        """Plain sentences on what the scores say, ending with each head's role (against ``baselines``, the
        random models' scorecards, where given)."""
        out = findings(self.flat(), self.kind, self.intervals.get("accuracy"), exact=self.weights is not None)
        table = self.head_table(baselines)
        if table is not None:
            out.append(f"Heads: {table.describe(self.head_ablation)}.")
        return out


def nest_scores(flat: dict[str, float], table: Optional[HeadTable] = None,
                ablation: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """:func:`nest`, with the per-head scores by head (``table.to_json()`` where given: with intervals,
    roles and ablation) and the composition scores by mode."""
    out = nest({k: v for k, v in flat.items() if not k.startswith(("heads.", "composition."))})
    heads = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("heads.")}
    if table is not None:
        out["heads"] = table.to_json(ablation)
    elif heads:
        out["heads"] = nest(heads)
    composition = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("composition.")}
    if composition:
        out["composition"] = nest(composition)
    return out


def accuracy_finding(accuracy: float, bayes: float, interval: Optional[tuple[float, float]] = None,
                     exact: bool = False) -> str:
    """The accuracy beside the Bayes accuracy, and whether the gap is more than sampling error.

    ``interval``: the accuracy's bootstrap interval over the test walks; ``exact``: the accuracy is
    that of the whole population (no sampling error). A test accuracy a little above Bayes is the
    luck of a finite test set, and is said to be so."""
    head = f"Accuracy {accuracy:.3f}, Bayes {bayes:.3f}"
    if exact:
        gap = accuracy - bayes
        where = "at the Bayes accuracy" if abs(gap) < 5e-4 else f"{abs(gap):.3f} {'above' if gap > 0 else 'below'} it"
        return f"{head}: {where} (exact: scored on the whole population)."
    if interval is None or not all(math.isfinite(v) for v in interval):
        return f"{head} (no interval to judge the gap by: probe with bootstrap resamples)."
    lo, hi = interval
    span = f"interval [{lo:.3f}, {hi:.3f}]"
    if lo <= bayes <= hi:
        return f"{head}: within sampling error ({span})."
    if hi < bayes:
        return f"{head}: below it by more than sampling error ({span})."
    return (f"{head}: above it by more than the {span} allows; no predictor beats Bayes on average, so this test "
            "set happens to suit the model.")


def findings(s: dict[str, float], kind: str = "query", accuracy_interval: Optional[tuple[float, float]] = None,
             exact: bool = False) -> list[str]:
    """Plain sentences on what a flat score dict says (thresholds are rules of thumb);
    ``accuracy_interval`` and ``exact`` as for :func:`accuracy_finding`."""
    out = []
    if kind == "autoregressive":
        out.append("The model predicts the next state at every position; each prediction's parents move with it "
                   "(for a first-order chain, the parent is the prediction's own position).")

    def ok(key: str) -> bool:
        return key in s and s[key] is not None and math.isfinite(s[key])

    if ok("accuracy") and ok("bayes_accuracy"):
        out.append(accuracy_finding(s["accuracy"], s["bayes_accuracy"], accuracy_interval, exact))
    if ok("parent_attention") and s["parent_attention"] >= 0.5:
        where = "sits on" if s["parent_attention"] >= 0.9 else "mostly goes to"
        out.append(f"Attention {where} the parent: {s['parent_attention']:.3f} of it on average, and the parent "
                   f"is the most-attended position in {100 * s['parent_argmax_rate']:.0f}% of predictions.")
    elif ok("attention.uniformity") and s["attention.uniformity"] >= 0.9:
        out.append(f"Attention is spread evenly over the positions it can see (uniformity "
                   f"{s['attention.uniformity']:.3f}): the model does not single out the parent.")
    elif ok("parent_attention"):
        out.append(f"Attention mostly goes elsewhere: {s['parent_attention']:.3f} of it on the parent.")
    if ok("patching.localization"):
        where = "at the parent" if s["patching.localization"] >= 0.9 else "largely away from the parent"
        out.append(f"Activation patching finds the computation {where}: {s['patching.localization']:.3f} of the "
                   f"effect is there, and patching the parent alone recovers {s['patching.parent_effect']:.3f} "
                   "of the clean output.")
        scores = [s[k] for k in ("patching.parent_effect", "patching.necessity", "patching.sufficiency") if ok(k)]
        if any(not -0.1 <= v <= 1.1 for v in scores):
            out.append("Some patching scores lie outside [0, 1]: each is a ratio of mean logit differences, and "
                       "when corrupting the input barely changes the output on average (a small denominator) the "
                       "ratio is unstable; read them with their intervals.")
        if s.get("patching.contrast_outside_parents") == 0.0:
            out.append("Clean and corrupted inputs differ only at the parents, so patching anywhere else cannot "
                       "change the output: localization is 1 for any model on these inputs, trained or not; judge "
                       "the patching scores against the random baseline.")
        if kind == "autoregressive" and "transition.direct.kl" in s:
            out.append("With a residual stream each position's own token reaches its prediction directly, so even "
                       "an untrained model localises there: judge patching against the random baseline.")
    elif "patching.localization" in s:
        out.append("The output does not depend on which input is read, so patching cannot localise anything.")
    if ok("transition.direct.kl"):
        close = s["transition.kl"] < 0.1 and s.get("transition.argmax_agreement") == 1.0
        out.append(f"Through a parent it attends to, the model's logits {'reproduce' if close else 'do not reproduce'} "
                   f"the transition matrix (direct and attention paths together: KL(Pi || softmax) = "
                   f"{s['transition.kl']:.3f}, top score right for {100 * s['transition.argmax_agreement']:.0f}% "
                   "of states).")
    elif ok("transition.ones_cosine") and s["transition.ones_cosine"] >= 0.999:
        out.append(f"V is proportional to the all-ones matrix (cosine {s['transition.ones_cosine']:.4f}): every "
                   "state gets the same scores, the symmetric fixed point of the paper's Theorem 4.1.")
    elif ok("transition.distance"):
        close = s["transition.distance"] < 0.35 and s.get("transition.argmax_agreement") == 1.0
        out.append(f"The value map {'points in the direction of' if close else 'differs from'} the transposed "
                   f"transition matrix (distance {s['transition.distance']:.3f}, cosine "
                   f"{s['transition.cosine']:.3f}, top score right for "
                   f"{100 * s['transition.argmax_agreement']:.0f}% of states).")
    return out


def scorecard(model: Any, task: Task, data: Batch, config: ProbeConfig = ProbeConfig()) -> Scorecard:
    """Run every probe on ``model`` over the walks ``data`` and collect the scores.

    A pure function of (model, task, data, config): the model's weights and mode are untouched.
    The transition probe is skipped (``None``) for tasks without a first-order transition matrix.
    Intervals are bootstrapped over the walks, except for a weighted population (exact numbers).
    """
    require(len(data) >= 2, "probing needs at least 2 walks")
    with evaluating(model):
        targets = targets_for(model, task, data, config.kind)
        config = replace(config, kind=targets.kind)
        logits = targets.select(run_logits(model, targets.inputs))
        hits = (predict(logits) == targets.labels).to(torch.float64)
        attention = attention_probe(model, task, data, config)
        patching = patching_probe(model, task, data, config)
        n_atp = len(data) if data.weights is not None else min(config.gradient_walks, len(data))
        attribution = (patching_probe(model, task, data[:n_atp], replace(config, hooks=("resid_pre",)), method="atp")
                       if n_atp >= 2 and "resid_pre" in config.hooks else None)
        transition = (transition_probe(model, task, data, config, head=attention.head)
                      if transition_of(task) is not None else None)
        heads = head_probe(model, task, data, config)
        composition = composition_scores(model)
        ablation = head_ablation(model, task, data, "mean", config)
    card = Scorecard(
        task=task.to_dict(),
        model=describe_model(model),
        kind=targets.kind,
        n_walks=len(data),
        bayes_accuracy=bayes_accuracy(task, targets),
        hits=hits,
        weights=data.weights,
        attention=attention,
        patching=patching,
        transition=transition,
        config=config,
        sample_name=task.sample_name,
        heads=heads,
        composition=composition,
        attribution=attribution,
        head_ablation={label: (s["ablation_loss_increase"], *s["ablation_ci"]) for label, s in ablation.scores().items()},
    )
    if config.bootstrap and data.weights is None:  # a weighted population is exact: no interval
        w = bootstrap_weights(data.weights, len(data), config.bootstrap, config.seed)
        point = card.flat()
        card.intervals = {key: bootstrap_interval(draws, point[key], config.confidence)
                          for key, draws in card._summary(w).items()}
    return card


def describe_model(model: Any) -> str:
    """Class name and the config fields that say what the model is."""
    cfg = model.cfg
    to_dict = getattr(cfg, "to_dict", None)
    fields_ = to_dict() if callable(to_dict) else {}
    keep = {k: v for k, v in fields_.items() if isinstance(v, (int, float, str, bool))}
    if not keep or len(keep) > 12:  # a large generic config: its architecture is enough
        keep = {k: getattr(cfg, k) for k in ("n_layers", "n_heads", "d_model", "d_head", "n_ctx", "d_vocab",
                                              "attn_only", "d_mlp") if hasattr(cfg, k)}
    return f"{type(model).__name__}(" + ", ".join(f"{k}={v}" for k, v in keep.items()) + ")"


# ---------------------------------------------------------------------------------- comparisons
def random_like(model: Any, seed: int) -> Any:
    """A random-initialised model of the same architecture (see the module docstring).

    Rebuilt through the saved-run registry (:mod:`rwinterp.runs`) from the model's own config with
    ``seed`` replaced and a zero initialisation turned into the config's Gaussian one.
    """
    from rwinterp.runs import build_model, model_config, model_kind_of

    cfg = model_config(model)
    require("seed" in cfg, f"the config of {type(model).__name__} has no seed to vary; pass baseline models")
    cfg["seed"] = int(seed)
    if cfg.get("init") == "zero":
        cfg["init"] = "gaussian"
    fresh = build_model(model_kind_of(model), cfg)
    fresh.eval()
    return fresh


def baseline_seeds(model: Any, n: int, start: int = 1000) -> list[int]:
    """``n`` seeds for random baselines, skipping the model's own seed."""
    own = getattr(model.cfg, "seed", None)
    seeds, s = [], start
    while len(seeds) < n:
        if s != own:
            seeds.append(s)
        s += 1
    return seeds


@dataclass
class Comparison:
    """A scorecard against several others (random baselines), with each score over them (``spreads``: its
    values, mean, standard deviation and bootstrap interval of the mean over the random models)."""

    trained: Scorecard
    baselines: list[Scorecard]
    seeds: list[int]
    spreads: dict[str, Estimate]

    def baseline_means(self) -> dict[str, float]:
        return {k: s.mean for k, s in self.spreads.items()}

    def head_table(self) -> Optional[HeadTable]:
        """The trained model's heads against the random models' (difference and interval per head)."""
        return self.trained.head_table(self.baselines)

    def findings(self) -> list[str]:
        """The trained model's findings, its heads' roles judged against the random models."""
        return self.trained.findings(self.baselines)


def compare_to_random(
    model: Any,
    task: Task,
    data: Batch,
    seeds: int | Sequence[int] = 5,
    config: ProbeConfig = ProbeConfig(),
    baselines: Optional[Sequence[Any]] = None,
    trained: Optional[Scorecard] = None,
) -> Comparison:
    """The trained model's scorecard beside those of random-initialised models (same walks).

    ``baselines`` overrides the models built by :func:`random_like` (e.g. for a model class that
    has no saved-run format); ``seeds`` is a count or a list of seeds.
    """
    if baselines is None:
        seed_list = baseline_seeds(model, seeds) if isinstance(seeds, int) else list(seeds)
        require(len(seed_list) >= 1, "a random baseline needs at least one seed")
        models = [random_like(model, s) for s in seed_list]
    else:
        models, seed_list = list(baselines), [getattr(m.cfg, "seed", i) for i, m in enumerate(baselines)]
    trained = trained or scorecard(model, task, data, config)
    cards = [scorecard(m, task, data, config)
             for m in tqdm(models, desc="random baselines", leave=False,
                           disable=None if config.progress is None else not config.progress)]
    keys = list(dict.fromkeys(k for c in cards for k in c.flat()))
    flats = [c.flat() for c in cards]
    spreads = {k: Estimate.of([f.get(k, math.nan) for f in flats], config.confidence, seed=config.seed) for k in keys}
    return Comparison(trained, cards, seed_list, spreads)


@dataclass
class RunComparison:
    """Two scorecards side by side (any two runs)."""

    names: tuple[str, str]
    a: Scorecard
    b: Scorecard

    def rows(self) -> list[tuple[str, float, float, float]]:
        """``(key, a, b, b - a)`` for every score both have."""
        fa, fb = self.a.flat(), self.b.flat()
        return [(k, fa[k], fb[k], fb[k] - fa[k]) for k in fa if k in fb]


def compare(a: Scorecard, b: Scorecard, names: tuple[str, str] = ("A", "B")) -> RunComparison:
    """Any run against any run: their scorecards side by side."""
    return RunComparison(names, a, b)
