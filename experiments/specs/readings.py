"""One reading for the whole paper: each reading of the loss, applied to every trained figure.

Two figures reproduce only under a reading that differs from the stated setting: Fig 10 under
softmax cross-entropy, Fig 11 under the loss summed over the training walks. The paper ran one
code base, so a reading that explains it should reproduce every figure at the hyper-parameters the
figure states. This study checks that: it reruns the stated-setting runs of every figure that
trains (4 to 13) under each reading in :data:`LOSS_READINGS` (one change each; the stated runs are
the figures' own, shared with them) and checks each figure's own claims of the paper
(:data:`FIGURES`) on them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np

from experiments.spec import (Claim, ClaimResult, Computed, FigureSpec, Panel, Results, RunSpec, at_least,
                             format_measured)
from experiments.specs import fig04, fig05, fig06, fig07, fig08, fig09, fig10, fig11, fig12, fig13
from experiments.specs._random_init import reading_named, run_name

#: The readings: name -> (label, training-config overrides).
LOSS_READINGS: dict[str, tuple[str, dict]] = {
    "stated": ("as stated: -log(f_y + eps), mean over the training set", {}),
    "summed": ("the same loss summed over the training set (Fig 11's reading)", {"reduction": "sum"}),
    "xent": ("softmax cross-entropy, mean (Fig 10's reading, here at the stated lr)", {"loss": "xent"}),
}


def _qa_paper_claim(claim: Claim) -> bool:
    return claim.claim.startswith("task ") and claim.claim.endswith("[the paper's setting]")


def _random_init_paper_claim(claim: Claim) -> bool:
    """The random-initialisation figures tag the paper's claims under the stated reading ``[paper]``
    (and their diagnostics ``[paper] why ...``)."""
    return claim.claim.startswith("[paper]") and not claim.claim.startswith("[paper] why")


@dataclass(frozen=True)
class TrainedFigure:
    """A figure of the paper that trains: its spec, the runs of its stated setting, and which of its
    claims are the paper's under that setting (``None``: all of them)."""

    spec: FigureSpec
    runs: tuple[str, ...]
    paper_claim: Optional[Callable[[Claim], bool]] = None

    def claims(self) -> list[Claim]:
        return [c for c in self.spec.claims if self.paper_claim is None or self.paper_claim(c)]


_P05, _P1 = (run_name(reading_named("paper"), p) for p in (0.5, 1.0))
FIGURES: dict[str, TrainedFigure] = {
    "4": TrainedFigure(fig04.SPEC, ("walk",)),
    "5": TrainedFigure(fig05.SPEC, ("walk",)),
    "6": TrainedFigure(fig06.SPEC, (_P05, _P1), _random_init_paper_claim),
    "7": TrainedFigure(fig07.SPEC, ("task1", "task2"), _qa_paper_claim),
    "8": TrainedFigure(fig08.SPEC, ("walk",)),
    "9": TrainedFigure(fig09.SPEC, ("walk",)),
    "10": TrainedFigure(fig10.SPEC, ("task1", "task2"), _qa_paper_claim),
    "11": TrainedFigure(fig11.SPEC, (_P05,), _random_init_paper_claim),
    "12": TrainedFigure(fig12.SPEC, (_P1,), _random_init_paper_claim),
    "13": TrainedFigure(fig13.SPEC, (_P1,), _random_init_paper_claim),
}


def run_of(fig: str, reading: str, run: str) -> str:
    return f"fig{fig}_{reading}_{run}"


def _reading_run(fig: TrainedFigure, fig_id: str, reading: str, run: RunSpec) -> RunSpec:
    """``run`` under ``reading``, keeping the reduced-mode overrides of its own figure."""
    reduced = copy.deepcopy(fig.spec.reduced)
    for part, values in run.reduced.items():
        reduced[part] = {**reduced.get(part, {}), **values}
    return replace(copy.deepcopy(run), name=run_of(fig_id, reading, run.name),
                   train={**run.train, **LOSS_READINGS[reading][1]}, reduced=reduced)


RUNS = [_reading_run(fig, fig_id, reading, run)
        for fig_id, fig in FIGURES.items() for reading in LOSS_READINGS
        for run in fig.spec.runs if run.name in fig.runs]


def figure_claims(results: Results, fig_id: str, reading: str) -> list[ClaimResult]:
    """The figure's own paper claims, checked on its runs under ``reading`` (computed once)."""
    from experiments.runner import evaluate_claims

    fig = FIGURES[fig_id]

    def compute() -> list[ClaimResult]:
        view = Results({name: results[run_of(fig_id, reading, name)] for name in fig.runs})
        view.reduced = results.reduced
        return evaluate_claims(replace(fig.spec, claims=fig.claims()), view)

    return results[run_of(fig_id, reading, fig.runs[0])].memo(f"readings:{fig_id}:{reading}", compute)


def reproduced(results: Results, reading: str) -> list[str]:
    """The figures all of whose paper claims hold under ``reading``."""
    return [f for f in FIGURES if all(c.holds for c in figure_claims(results, f, reading))]


def holding_fraction(results: Results) -> np.ndarray:
    """[reading, figure]: the fraction of the figure's paper claims that hold under the reading."""
    return np.array([[np.mean([c.holds for c in figure_claims(results, f, r)]) for f in FIGURES]
                     for r in LOSS_READINGS])


def summary(results: Results) -> str:
    """Per reading: the figures it reproduces, and the claims that fail in the others."""

    lines = []
    for reading, (label, _) in LOSS_READINGS.items():
        good = reproduced(results, reading)
        lines.append(f"{reading}: {label}\n  reproduces {len(good)} of {len(FIGURES)} figures ({', '.join(good)})")
        for f in FIGURES:
            for c in figure_claims(results, f, reading):
                if not c.holds:
                    text = c.claim.removesuffix(" [the paper's setting]").removeprefix("[paper] ")
                    text = text if len(text) <= 110 else text[:107] + "..."
                    lines.append(f"  Fig {f} fails: {text} = {format_measured(c.measured)}")
    return "\n".join(lines)


SPEC = FigureSpec(
    shortfall='Deliberately: each row checks whether one reading of the setting reproduces every trained figure, and none does.',
    id="readings",
    title="one reading for the whole paper: each reading of the loss on every trained figure",
    caption=("Each row reruns the stated setting of every figure that trains (4 to 13) with one change to the loss, "
             "and each cell is the fraction of that figure's own claims of the paper (not its diagnostics or other "
             "readings) that then hold (1: the figure reproduces). The summed loss rescues Fig 11 but breaks figures "
             "that the stated loss reproduces; cross-entropy at the stated learning rates rescues neither Fig 10 (it "
             "needs lr 1) nor Fig 11. No one reading reproduces the whole paper."),
    runs=RUNS,
    panels=[
        Panel("heatmap", "(a) fraction of each figure's paper claims that hold", data=Computed(holding_fraction),
              xlabel="figure", ylabel="reading",
              options={"xticklabels": list(FIGURES), "yticklabels": list(LOSS_READINGS), "cmap": "rocket",
                       "fmt": ".2f"}),
        Panel("text", "(b) what each reading reproduces", data=Computed(summary)),
    ],
    claims=[
        Claim(f"[{reading}] one reading reproduces every trained figure of the paper "
              f"({', '.join(FIGURES)}): the number of figures all of whose claims hold",
              Computed(lambda r, reading=reading: len(reproduced(r, reading))), at_least(len(FIGURES)),
              note=f"{label}; each figure's claims are its own claims of the paper under the stated setting, "
                   "checked on its stated runs with only the loss changed (the text panel lists which fail)")
        for reading, (label, _) in LOSS_READINGS.items()
    ],
    layout=(2, 1),
    panel_size=(11.0, 5.6),
)
