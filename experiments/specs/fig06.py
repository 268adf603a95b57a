"""Figure 6: small random initialisation, p = 0.5 against p = 1: accuracy and KL by step, per reading."""

from experiments.spec import Claim, Computed, FigureSpec, History, Panel, near
from experiments.specs._random_init import (K, LR_SWEEP, READINGS, REDUCED, ROUGHLY_400, fig6_claims, lr_matching_paper,
                                            lr_sweep_runs, lr_sweep_series, reading_series, runs, verdict)


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
             "which reading satisfies every claim. (i): under the mean loss, only lr 10 (the summed loss at the "
             "stated lr 0.01) learns p = 0.5 after roughly 400 steps: the paper's timing points to the summed loss."),
    runs=runs() + lr_sweep_runs(),
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
        Panel("line", "(i) p = 0.5, mean loss: test accuracy by learning rate", series=lr_sweep_series(),
              xlabel="step", ylabel="test accuracy", ref={"Bayes 0.5": 0.5}, ylim=(0, 1.05)),
    ],
    claims=[c for reading in READINGS for c in fig6_claims(reading)] + [
        Claim("[lr sweep] of the mean-loss learning rates 0.01 (paper), "
              + ", ".join(f"{lr:g}" for lr in sorted((*LR_SWEEP, 10.0)))
              + " (10 = the summed reading), only lr 10 learns p = 0.5 after roughly 400 steps",
              Computed(lr_matching_paper), near(10.0, 0.0),
              note=(f"measured: the one swept lr whose first step within 3 standard errors of 0.5 lies in "
                    f"[{ROUGHLY_400[0]}, {ROUGHLY_400[1]}] (NaN if none or several); panel (i) shows every curve. "
                    "Evidence on which reading the paper ran, not a claim of the paper.")),
    ],
    layout=(2, 5),
    reduced=REDUCED,
)
