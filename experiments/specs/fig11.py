"""Figure 11: p = 0.5 from small random initialisation: V at steps 100 to 1000 and the final attention."""

from experiments.spec import Computed, FigureSpec, Panel
from experiments.specs._random_init import (READINGS, REDUCED, attention_panel, fig11_claims, runs,
                                            snapshot_panels, verdict)

SPEC = FigureSpec(
    id="11",
    title="random initialisation, p = 0.5: V and attention, one row per reading",
    caption=("Each row is one reading of the setting. Where the walk is learned, V gains the pattern of Pi^T "
             "(the +1 and -1 neighbours of every column) on top of a large all-ones part, and the query slot puts "
             "almost all of its attention on the parent position N-1 (last panel of each row). As stated (mean "
             "loss) V stays near all-ones and attention uniform; with only the keys normalised, attention locks "
             "onto a position at odd distance from the label and V takes a checkerboard (odd-offset) pattern."),
    runs=runs((0.5,)),
    panels=[panel for reading in READINGS
            for panel in snapshot_panels(reading, 0.5, chr(97 + READINGS.index(reading)), "V")
            + [attention_panel(reading, 0.5)]]
    + [Panel("text", "which reading reproduces Fig 11", data=Computed(lambda r: verdict(r, fig11_claims)))],
    claims=[c for reading in READINGS for c in fig11_claims(reading)],
    layout=(len(READINGS) + 1, 5),
    panel_size=(3.4, 2.8),
    reduced=REDUCED,
)
