"""Figure 6: small random initialisation, p = 0.5 against p = 1: accuracy and KL by step, per reading."""

from experiments.spec import Computed, FigureSpec, History, Panel
from experiments.specs._random_init import (K, READINGS, REDUCED, fig6_claims, reading_series, runs,
                                            verdict)


def _curves(p: float, key: str) -> dict:
    return reading_series(p, lambda run: History(run, key))


def _panel(letter: str, p: float, key: str, what: str, **kw) -> Panel:
    return Panel("line", f"({letter}) p = {p:g}: {what}", series=_curves(p, key), xlabel="step",
                 ylabel=what, **kw)


SPEC = FigureSpec(
    id="6",
    title="small random initialisation: p = 0.5 against p = 1, four readings of the setting",
    caption=("Each colour is one reading of the paper's under-specified setting (K 6, N 97, M 1000, "
             "N(0, 0.01^2) init, unit-normalised x~, lr 0.01, 1000 steps). The paper's curves: p = 0.5 reaches "
             "0.5 accuracy near step 400 and its KL falls much faster than for p = 1, which stays below 100%. "
             "As stated (mean loss) nothing moves in 1000 steps; summing the loss over the walks learns p = 0.5 "
             "near step 400, but breaks the p = 1 symmetry earlier (about step 200) and reaches 100%; (h) says "
             "which reading satisfies every claim."),
    runs=runs(),
    panels=[
        _panel("a", 0.5, "test_accuracy", "test accuracy", ref={"Bayes 0.5": 0.5, "1/K": 1 / K}, ylim=(0, 1.05)),
        _panel("b", 0.5, "kl_normalised", "KL(P || f+/sum f+)", ylim=(0, 1.3)),
        _panel("c", 1.0, "test_accuracy", "test accuracy", ref={"1/K": 1 / K}, ylim=(0, 1.05)),
        _panel("d", 1.0, "kl_normalised", "KL(P || f+/sum f+)", ylim=(0, 2.1)),
        _panel("e", 0.5, "kl_softmax", "KL(P || softmax f)"),
        _panel("f", 1.0, "kl_softmax", "KL(P || softmax f)"),
        _panel("g", 0.5, "parent_attention", "attention on the parent", ylim=(0, 1.05)),
        Panel("text", "(h) which reading reproduces Fig 6",
              data=Computed(lambda r: verdict(r, fig6_claims), "verdict per reading")),
    ],
    claims=[c for reading in READINGS for c in fig6_claims(reading)],
    layout=(2, 4),
    reduced=REDUCED,
)
