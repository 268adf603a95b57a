"""Figure 12: p = 1 from small random initialisation: V at steps 100, 400, 700, 1000."""

from experiments.spec import Computed, FigureSpec, History, Panel
from experiments.specs._random_init import (ONES_SPREAD, READINGS, REDUCED, fig12_claims, reading_series, runs,
                                            snapshot_panels, verdict)

SPEC = FigureSpec(
    shortfall='As in Fig 6: under the readings that learn p = 0.5, p = 1 breaks its symmetry well before step 700 instead of holding it.',
    id="12",
    title="random initialisation, p = 1: V at steps 100, 400, 700, 1000, one row per reading",
    caption=("The paper: V stays proportional to all-ones up to about step 700 and is no longer so at step 1000 "
             "(the random initialisation slowly breaks the symmetry of the deterministic walk). The last row "
             "shows V's column spread max_j |V[:, j] - V[:, 1]| / max|V| (columns 1..K) by step for every reading "
             f"(dashed: the {ONES_SPREAD} threshold for 'proportional to all-ones') and which reading reproduces the "
             "figure: only the summed loss with sigma tuned to 4e-6 on seed 0 (Fig 13 shows it does not carry over to "
             "other seeds)."),
    runs=runs((1.0,)),
    panels=[panel for reading in READINGS
            for panel in snapshot_panels(reading, 1.0, chr(97 + READINGS.index(reading)), "V")]
    + [Panel("line", "(e) V column spread by step", series=reading_series(
        1.0, lambda run: History(run, "v_column_spread")), ref={"proportional to all-ones below": ONES_SPREAD},
        logy=True, xlabel="step", ylabel="column spread (log)",
        options={"legend_loc": "lower left", "legend_anchor": (1.04, 0.0)}),
       Panel("text", "which reading reproduces Fig 12", data=Computed(lambda r: verdict(r, fig12_claims)))],
    claims=[c for reading in READINGS for c in fig12_claims(reading)],
    layout=(len(READINGS) + 1, 4),
    panel_size=(3.4, 2.8),
    reduced=REDUCED,
)
