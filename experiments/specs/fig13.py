"""Figure 13: p = 1 from small random initialisation: the attention-averaged token and its variance."""

from experiments.spec import Computed, FigureSpec, Panel
from experiments.specs._random_init import (BROKEN_VARIANCE, READINGS, REDUCED, SEEDS, fig13_claims,
                                            fig13_seed_claim, max_variance, reading_named, reading_series, runs,
                                            seed_runs, seed_run_name, snapshot_panels, verdict)

SUMMED = reading_named("summed")


def _variance_curve(run: str) -> Computed:
    def get(results):
        by_step = results[run].snapshots["averaged_token"]
        steps = sorted(by_step)
        return steps, [max_variance(by_step[s]) for s in steps]

    return Computed(get, f"largest averaged-token variance of {run} by step")


SPEC = FigureSpec(
    id="13",
    title="random initialisation, p = 1: the averaged token X softmax(...) of one walk and its variance over walks",
    caption=("Per reading, two rows: the attention-averaged token of the first test walk, and its per-coordinate "
             "variance over the 1000 test walks, at steps 100, 400, 700, 1000. The paper: the variance stays near 0 "
             "up to about step 700 (every walk averages to the same token), then one token receives much more "
             "weight. The last row plots the largest variance by step for every reading, and for the summed reading "
             f"with two more seeds (dashed: the {BROKEN_VARIANCE} threshold taken as 'symmetry broken')."),
    runs=runs((1.0,)) + seed_runs(SUMMED),
    panels=[panel for i, reading in enumerate(READINGS)
            for what, letter in (("example", chr(97 + i)), ("var", chr(97 + i) + "'"))
            for panel in snapshot_panels(reading, 1.0, letter, what)]
    + [Panel("line", "(e) largest averaged-token variance by step",
             series={**reading_series(1.0, _variance_curve),
                     **{f"{SUMMED.label}, seed {s}": _variance_curve(seed_run_name(SUMMED, s)) for s in SEEDS[1:]}},
             ref={"threshold": BROKEN_VARIANCE}, logy=True,
             xlabel="step", ylabel="variance over walks (log)"),
       Panel("text", "which reading reproduces Fig 13", data=Computed(lambda r: verdict(r, fig13_claims)))],
    claims=[c for reading in READINGS for c in fig13_claims(reading)] + [fig13_seed_claim(SUMMED)],
    layout=(2 * len(READINGS) + 1, 4),
    panel_size=(3.2, 2.4),
    reduced=REDUCED,
)
