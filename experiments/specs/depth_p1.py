"""Does depth, width, random or standard initialisation, or added positional embeddings, fix the
deterministic walk (p = 1) that the paper's one-layer zero-initialised model cannot learn?

Theorem 4.1's argument: a deterministic walk with N = rK + 1 visits every node r times, so the
uniformly averaged token is the same for every walk, and from zero initialisation nothing ever
breaks that symmetry. The argument does not care how many layers or heads average the same
tokens, so depth and width should not help; anything that breaks the symmetry at the start (random
weights) or makes positions differ in what they add to the values (added, non-orthogonal
positional embeddings) may. A deterministic walk also has a peculiarity: every earlier token fixes
the label (s_N = s_j + N - j mod K), so a model can be perfect while attending anywhere.

All runs: circle, K = 6, p = 1, N = 25 (r = 4), 1000 training and 1000 test walks; the paper's
training (gradient descent, lr 1, loss -log(f_y + 0.1), 50 steps) except the standard transformer
(AdamW, cross-entropy on next-state prediction, 80 steps). Concatenated embeddings use M = 128.
"""

from __future__ import annotations

from experiments.spec import (Claim, Computed, FigureSpec, Final, History, Panel, accuracy_near, at_least,
                              at_most, binomial_tol)
from experiments.specs.depth_common import STANDARD, STANDARD_TRAIN, deep_run, query_attention, score_table

K, N, M = 6, 25, 128
TASK = {"kind": "circle", "K": K, "p": 1.0, "N": N}
ADDED = {"pos_mode": "added", "d_model": 64, "values": "all"}

VARIANTS = [  # name, model options, training options, label
    ("paper", {}, {}, "paper (1 layer)"),
    ("2L", {"n_layers": 2, "residual": True}, {}, "2 layers + residual"),
    ("2L-nores", {"n_layers": 2}, {}, "2 layers, no residual"),
    ("2H", {"n_heads": 2}, {}, "2 heads"),
    ("gauss", {"init": "gaussian", "init_sigma": 0.01}, {}, "Gaussian init 0.01"),
    ("gpt2", {"init": "standard"}, {}, "GPT-2 init"),
    ("add-sine", {**ADDED, "pos_embedding": "sine"}, {}, "added sine positions"),
    ("add-learn", {**ADDED, "pos_embedding": "learned", "init": "standard"}, {}, "added learned + GPT-2 init"),
    ("standard", STANDARD, STANDARD_TRAIN, "standard transformer"),
]
NAMES = [v[0] for v in VARIANTS]
RUNS = [deep_run(name, TASK, {"pos_dim": M, **model}, train, label=label,
                 reduced={"train": {"steps": 20}} if name == "standard" else {})
        for name, model, train, label in VARIANTS]
CHANCE = 1 / K


def _final(key: str):
    return Computed(lambda r: {name: float(r[name].final[key]) for name in NAMES})


def _steps_to_solve(results):
    return {name: min(results[name].first_step("test_accuracy", lambda a: a >= 0.99),
                      results[name].history[-1]["step"] + 1) for name in NAMES}


def _top_attention(results, run: str) -> float:
    """The largest mean attention of the first layer's query slot on one position (heads averaged)."""
    return float(query_attention(results, run)[0].mean(0).max())


SPEC = FigureSpec(
    id="depth-p1",
    title="the deterministic walk (p = 1): what breaks the zero-initialisation symmetry",
    caption=(f"K = {K}, p = 1, N = {N} (every node visited {(N - 1) // K} times), M = {M}, 1000/1000 walks. "
             "Zero-initialised models stay at chance 1/K however many layers or heads they have (the symmetry "
             "of Theorem 4.1 survives depth; their curves lie on each other in (a)); random initialisation, added "
             "positional embeddings and a standard transformer break it; the Gaussian- and GPT-2-initialised "
             "models of the paper's architecture solve the walk by attending to an arbitrary position rather than "
             "the parent, while the one-layer model with added learned positions and GPT-2 init does not solve it "
             f"(a). In (d), uniform attention is 1/(N-1) = {1 / (N - 1):.3f}. In (e), nan: a model that gives every "
             "walk the same scores has no patching effect to share out; a random model's necessity leaves [0, 1] "
             "when its total effect is near 0."),
    runs=RUNS,
    layout=(2, 3),
    panel_size=(5.5, 3.6),
    panels=[
        Panel("line", "(a) test accuracy by step", series={label: History(name, "test_accuracy")
                                                           for name, _, _, label in VARIANTS},
              ref={"chance 1/K": CHANCE}, xlabel="step", ylabel="accuracy", ylim=(0, 1.6),
              options={"legend_loc": "upper center", "legend_columns": 2, "yticks": [0, 0.2, 0.4, 0.6, 0.8, 1.0],
                       "dashes": True}),
        Panel("bar", "(b) final test accuracy", data=_final("test_accuracy"), ref={"chance 1/K": CHANCE},
              ylabel="accuracy", options={"rotation": 45}),
        Panel("bar", "(c) steps to reach 99% test accuracy (last step + 1: never)", data=Computed(_steps_to_solve),
              ylabel="steps", options={"rotation": 45}),
        Panel("bar", "(d) mean attention on the parent (layer 0, head 0)", data=_final("parent_attention"),
              ylabel="attention", options={"rotation": 45}),
        Panel("table", "(e) probe scores on the first 100 test walks, trained / random-initialised (mean of 2 seeds)",
              data=Computed(lambda r: score_table(r, NAMES))),
    ],
    claims=[
        *[Claim(f"{label} from zero initialisation stays at chance 1/K", Final(name, "test_accuracy"),
                accuracy_near(name, CHANCE), reduced=True,
                note="Theorem 4.1's symmetry holds for any number of layers and heads (also checked exactly, "
                     "on the population, in tests/test_deep.py).")
          for name, _, _, label in VARIANTS[:4]],
        Claim("a small Gaussian initialisation (sigma 0.01, no normalisation) solves the walk",
              Final("gauss", "test_accuracy"), at_least(0.99)),
        Claim("... without attending to the parent (parent attention)", Final("gauss", "parent_attention"),
              at_most(0.1), note="With squared positional norm M/2 = 64 the random attention logits are large: "
                                 "the query slot attends sharply to one arbitrary position, which determines the "
                                 "label of a deterministic walk as well as the parent does."),
        Claim("... but sharply to a single other position (largest mean attention)",
              Computed(lambda r: _top_attention(r, "gauss")), at_least(0.9)),
        Claim("GPT-2-style initialisation of the paper's architecture solves the walk",
              Final("gpt2", "test_accuracy"), at_least(0.99)),
        Claim("added sine positional embeddings break the symmetry from zero initialisation (accuracy above "
              "chance by more than 3 standard errors)", Final("add-sine", "test_accuracy"),
              at_least(CHANCE + binomial_tol(CHANCE, 1000)),
              note="Values then read the positions too, and sine embeddings are not orthogonal with equal "
                   "overlaps, so the key-query gradient differs between positions."),
        Claim("the standard transformer (added learned positions, causal, AdamW) solves the walk",
              Final("standard", "test_accuracy"), at_least(0.99)),
    ],
    reduced={"train": {"steps": 10, "n_train": 200, "n_test": 200}},
)
