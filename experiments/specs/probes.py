"""Trained against random models, scored by the probes (:mod:`probes.scoring`).

The trained models are those of Figs 4 (p = 1/2), 5 (p = 1) and 7 (QA task 1), shared with those
figures' runs. Each is put beside random-initialised models of the same configuration (3 seeds) by
:func:`probes.scoring.compare_to_random`, probed on the same 200 test samples. The probes are
imported inside the measurements: if they fail, the claims say so and the rest of the report stands.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from experiments.spec import Claim, Computed, FigureSpec, Panel, Results, at_least, at_most, is_true
from experiments.specs import fig04, fig05, fig07

N_PROBE = 200
SEEDS = 3
SCORES = ("accuracy", "parent_attention", "attention.uniformity", "patching.parent_effect",
          "patching.necessity", "transition.cosine", "transition.ones_cosine")


RUNS = [replace(fig04.SPEC.runs[0], name="walk_p05"), replace(fig05.SPEC.runs[0], name="walk_p1"),
        replace(next(r for r in fig07.SPEC.runs if r.name == "task1"), name="qa_task1")]
LABELS = {"walk_p05": "(a) walk p = 1/2 (Fig 4)", "walk_p1": "(b) walk p = 1 (Fig 5)",
          "qa_task1": "(c) QA task 1 (Fig 7)"}


def comparison(results: Results, run: str) -> Any:
    """The probes' trained-vs-random comparison of ``run`` (computed once)."""

    def compute() -> Any:
        from probes.config import ProbeConfig
        from probes.scoring import compare_to_random

        r = results[run]
        n = min(N_PROBE if not results.reduced else 50, len(r.test))
        return compare_to_random(r.model, r.task, r.test[:n], seeds=SEEDS if not results.reduced else 2,
                                 config=ProbeConfig(bootstrap=0, progress=False))

    return results[run].memo("probe_comparison", compute)


def trained(results: Results, run: str, key: str) -> float:
    return comparison(results, run).trained.flat().get(key, math.nan)


def random_mean(results: Results, run: str, key: str) -> float:
    return comparison(results, run).baseline_means().get(key, math.nan)


def draw(run: str):
    def panel(ax, results: Results) -> None:
        import seaborn as sns

        from probes.scoring import direction

        keys = [k for k in SCORES if not math.isnan(trained(results, run, k))]
        c = comparison(results, run)
        x = np.arange(len(keys))
        colours = sns.color_palette("colorblind")
        for shift, values, colour, label, err in (
                (-0.2, [trained(results, run, k) for k in keys], colours[0], "trained", None),
                (0.2, [c.spreads[k].mean for k in keys], colours[1], f"random init ({SEEDS} seeds)",
                 [c.spreads[k].std for k in keys])):
            ax.bar(x + shift, values, 0.4, yerr=err, color=colour, capsize=2, label=label)
            # A dot at each bar's end: a score of exactly 0 is seen, not mistaken for a missing bar.
            ax.scatter(x + shift, values, s=14, color=colour, edgecolors="white", linewidths=0.6, zorder=3,
                       clip_on=False)
        ax.set_xticks(x)
        ax.set_xticklabels([k + direction(k) for k in keys], rotation=60, ha="right", fontsize=6)
        ax.axhline(0, color="0.3", lw=0.8)
        lo, hi = ax.get_ylim()
        ax.set_ylim(lo, hi + 0.2 * (hi - lo))  # a band above the bars for the legend
        ax.legend(fontsize=6, loc="upper left", ncol=2)

    return panel


CLAIMS = [
    Claim("p = 1/2: the trained model attends to the parent, random models do not (parent attention, trained)",
          Computed(lambda r: trained(r, "walk_p05", "parent_attention")), at_least(0.99), reduced=True),
    Claim("p = 1/2: random models put almost no attention on the parent (mean over seeds)",
          Computed(lambda r: random_mean(r, "walk_p05", "parent_attention")), at_most(0.1), reduced=True),
    Claim("p = 1/2: patching the parent alone restores the trained model's output (parent effect)",
          Computed(lambda r: trained(r, "walk_p05", "patching.parent_effect")), at_least(0.9), reduced=True),
    Claim("p = 1/2: the trained V is aligned with Pi^T (cosine), far above random models",
          Computed(lambda r: trained(r, "walk_p05", "transition.cosine")
                   - random_mean(r, "walk_p05", "transition.cosine")), at_least(0.5),
          expected="trained minus random cosine >= 0.5"),
    Claim("p = 1: the trained V is proportional to all-ones (cosine with the all-ones matrix; Theorem 4.1)",
          Computed(lambda r: trained(r, "walk_p1", "transition.ones_cosine")), at_least(0.99), reduced=True),
    Claim("p = 1: the trained model's attention is spread evenly (uniformity; Theorem 4.1)",
          Computed(lambda r: trained(r, "walk_p1", "attention.uniformity")), at_least(0.95), reduced=True),
    Claim("p = 1: unlike the trained model, random models attend unevenly (uniformity, mean over random models)",
          Computed(lambda r: random_mean(r, "walk_p1", "attention.uniformity")), at_most(0.5),
          note="random models with the paper's large embeddings attend to one or a few arbitrary positions"),
    Claim("QA task 1: the trained model attends more to the fruit slots than random models do",
          Computed(lambda r: trained(r, "qa_task1", "parent_attention")
                   > random_mean(r, "qa_task1", "parent_attention")
                   + 3 * comparison(r, "qa_task1").spreads["parent_attention"].std), is_true(), reduced=True,
          expected="trained > random mean + 3 sd"),
]

SPEC = FigureSpec(
    id="probes",
    title="trained against random-initialised models, scored by the probes",
    caption=("Each panel puts the probe scores of a trained model (blue) beside random-initialised models of the same "
             "configuration (orange, mean and sd over 3 seeds) on the same test samples; a dot marks each bar's end "
             "(a score of 0 is a dot on the axis), and an arrow after a score's name says which way learning the task "
             "moves it (up: higher, down: lower). The p = 1/2 model's scores "
             "say 'attends to the parent and applies Pi^T' (a); the p = 1 model's say 'averages all tokens' (b). On "
             "QA task 1 (c) the trained model answers every list and puts more attention on the fruit slots (its "
             "parents) than random models; its patching scores are 1 for random models too, as clean and corrupted "
             "sentences differ only at the fruit slots."),
    runs=RUNS,
    panels=[Panel("custom", LABELS[name], draw=draw(name), ylabel="score") for name in LABELS],
    claims=CLAIMS,
    layout=(1, 3),
    reduced={**fig04.SPEC.reduced},
)
