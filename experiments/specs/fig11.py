"""Figure 11: p = 0.5 from small random initialisation: V at steps 100 to 1000 and the final attention."""

from experiments.spec import Claim, Computed, FigureSpec, Panel, at_most
from experiments.specs._random_init import (READINGS, REDUCED, attention_ceiling, attention_panel, fig11_claims,
                                            reading_named, run_name, runs, snapshot_panels, verdict)

PAPER = reading_named("paper")
CEILING = Claim(
    f"[{PAPER.name}] why attention stays spread as stated: with unit-norm keys and query every logit lies in "
    "[-||u||, ||u||] (u = W x~_N/||x~_N||), so after 1000 steps no position can get more than "
    "1/(1 + (N-1) e^(-2||u||)) of the attention",
    Computed(lambda r: attention_ceiling(r[run_name(PAPER, 0.5)].model)), at_most(0.9),
    note="measured: that ceiling for the trained model; reaching 0.9 on one position needs ||u|| >= "
         "ln(9 (N-1))/2 = 3.4 with N = 97, and the mean loss at lr 0.01 moves u by far less in 1000 steps")

SPEC = FigureSpec(
    shortfall='As in Fig 6: the stated mean loss at lr 0.01 learns nothing in 1000 steps (the summed loss reproduces this figure).',
    id="11",
    title="random initialisation, p = 0.5: V and attention, one row per reading",
    caption=("Each row is one reading of the setting. Where the walk is learned, V gains the pattern of Pi^T (the +1 "
             "and -1 neighbours of every column) on top of a large all-ones part, and the query slot puts almost all "
             "of its attention on the parent position N-1 (last panel of each row, on a log axis; dashed: uniform "
             "attention 1/N). V's colour scale starts at 0, so an all-ones V looks uniform. As stated (mean loss) V "
             "stays near all-ones and attention uniform; with only the keys normalised, attention locks onto a "
             "position at odd distance from the label and V takes a checkerboard (odd-offset) pattern."),
    runs=runs((0.5,)),
    panels=[panel for i, reading in enumerate(READINGS)
            for panel in snapshot_panels(reading, 0.5, chr(97 + i), "V")
            + [attention_panel(reading, 0.5, chr(97 + i) + "5")]]
    + [Panel("text", "which reading reproduces Fig 11", data=Computed(lambda r: verdict(r, fig11_claims)))],
    claims=[c for reading in READINGS for c in fig11_claims(reading)] + [CEILING],
    layout=(len(READINGS) + 1, 5),
    panel_size=(3.4, 2.8),
    reduced=REDUCED,
)
